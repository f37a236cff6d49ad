"""`make run`: start a real bridge process, run a multi-turn chat episode through it, stop it.

The engine is the embedded SmolLM2-135M-Instruct (converted from the GGUF on PyPI into the model
cache on first use, ~30 s; seconds afterwards); ``PRIMERL_DEMO_ENGINE=toy`` picks the toy engine.
Prints each turn's text, token ids and logprobs, then the trajectory summary.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np

from rl_client import BridgeClient


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    engine = os.environ.get("PRIMERL_DEMO_ENGINE", "embedded")
    port = free_port()
    cmd = [sys.executable, "-m", "server", "serve", "--engine", engine, "--port", str(port), "--metrics-port", "0"]
    print(f"$ {' '.join(cmd[1:])}")
    bridge = subprocess.Popen(cmd)
    started = time.perf_counter()
    try:
        with BridgeClient(f"127.0.0.1:{port}") as client:
            client.wait_until_ready(timeout=900)
            info = client.server_info().models[0]
            print(
                f"bridge ready in {time.perf_counter() - started:.1f} s: model {info.name!r} on {info.engine}, "
                f"vocab {info.vocab_size}, context {info.max_model_len}, policy v{info.policy_version}"
            )
            ep = client.start_episode(
                [{"role": "user", "content": "What is 2+2?"}],
                sampling={"temperature": 0.7, "max_tokens": 48, "seed": 1},
            )
            print(f"episode {ep.episode_id} on {ep.replica}, prompt of {ep.prompt_tokens} tokens")
            observations = [
                None,
                [{"role": "user", "content": "And what is 3+5?"}],
                [{"role": "user", "content": "Thanks! Say goodbye in French."}],
            ]
            for observation in observations:
                turn = client.step(ep.episode_id, observation)
                print(
                    f"\n-- turn {turn.turn_index} ({turn.finish_reason}, {turn.usage.generated_tokens} tokens, "
                    f"{turn.usage.cached_tokens} cached of {turn.usage.prompt_tokens} prompt) --"
                )
                print(f"text:     {turn.text!r}")
                more = " ..." if len(turn.token_ids) > 16 else ""
                print(f"ids:      {turn.token_ids.tolist()[:16]}{more}")
                print(f"logprobs: {[round(float(x), 3) for x in turn.logprobs[:16]]}{more}")
            traj = client.end_episode(ep.episode_id, reward=1.0)
            sampled = int(traj.loss_mask.sum())
            print(
                f"\ntrajectory: {len(traj)} tokens, {sampled} sampled (loss mask 1), {len(traj.turns)} turns, "
                f"mean logprob {float(np.mean(traj.logprobs[traj.loss_mask])):.3f}, reward {traj.reward}"
            )
    finally:
        bridge.send_signal(signal.SIGTERM)
        code = bridge.wait(timeout=60)
    return code


if __name__ == "__main__":
    sys.exit(main())
