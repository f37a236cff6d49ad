"""The bridge leg of scripts/dev_loop.sh: the quick-start bridge, a Prometheus scrape, a verifier reward.

1. starts the bridge exactly as the quick start does (``python -m server.main --engine toy``, ports from
   flags), runs ``--episodes`` two-turn episodes through ``rl_client`` and ends them with a reward;
2. scrapes its ``/metrics`` into ``OUT/metrics_scrape.txt`` (read it with scripts/analyze_metrics.py);
3. starts ``primerl verifier serve`` (SQLite log, fresh signing key under OUT) and scores the last
   episode's real trajectory with the ``exact`` grader: the signed answer is ``OUT/verifier_reward_sample.json``.

Every process it starts is stopped before it returns; exit code 0 only when every step worked.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The checkout, not scripts/ (whose grpc_health.py would shadow the package), is what imports resolve against.
sys.path[0] = str(ROOT)

from grpo.bridge_proc import free_port, terminate  # noqa: E402
from rl_client import BridgeClient, Trajectory  # noqa: E402

PROMPT = [{"role": "user", "content": "What is 2+2? Answer with the number."}]


def start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("wb") as sink:
        return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 30.0) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return bytes(resp.read())


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            http(url, timeout=2)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def run_episodes(grpc_port: int, episodes: int) -> tuple[Trajectory, str]:
    """Run the episodes; the last one's trajectory and its first turn's text (the answer to grade)."""
    traj, answer = None, ""
    with BridgeClient(f"127.0.0.1:{grpc_port}") as client:
        client.wait_until_ready(timeout=300)
        for i in range(episodes):
            ep = client.start_episode(PROMPT, sampling={"temperature": 0.8, "max_tokens": 16, "seed": i})
            answer = client.step(ep.episode_id).text
            client.step(ep.episode_id, [{"role": "user", "content": "Are you sure?"}])
            traj = client.end_episode(ep.episode_id, reward=float(i % 2))
    assert traj is not None
    return traj, answer


def trajectory_json(traj: Trajectory) -> dict[str, Any]:
    return {
        "episode_id": traj.episode_id,
        "token_ids": [int(t) for t in traj.token_ids],
        "logprobs": [None if math.isnan(float(x)) else float(x) for x in traj.logprobs],
        "loss_mask": [int(m) for m in traj.loss_mask],
        "origins": traj.origin_names(),
        "policy_versions": [int(v) for v in traj.policy_versions],
    }


def score(traj: Trajectory, answer: str, work: Path, log: Path) -> dict[str, Any]:
    port = free_port()
    db = f"sqlite:///{work / 'verifier.sqlite3'}"
    cmd = ["-m", "server", "verifier", "serve", "--http-port", str(port), "--database-url", db]
    proc = start([*cmd, "--key-dir", str(work / "verifier-keys")], log)
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/keys", proc, timeout=120)
        body = {"grader": "exact", "trajectory": trajectory_json(traj), "params": {"answer": answer, "reference": "4"}}
        return dict(json.loads(http(f"http://127.0.0.1:{port}/v1/score", body)))
    finally:
        terminate(proc)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="where metrics_scrape.txt and the verdict go")
    p.add_argument("--episodes", type=int, default=4)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    grpc_port, metrics_port = free_port(), free_port()
    cmd = ["-m", "server.main", "--engine", "toy", "--port", str(grpc_port), "--metrics-port", str(metrics_port)]
    print(f"$ PYTHONPATH=. python {' '.join(cmd[1:])} --http-port 0", flush=True)
    bridge = start([*cmd, "--http-port", "0"], args.out / "bridge.log")
    try:
        traj, answer = run_episodes(grpc_port, args.episodes)
        scrape = http(f"http://127.0.0.1:{metrics_port}/metrics").decode()
    finally:
        terminate(bridge)
    (args.out / "metrics_scrape.txt").write_text(scrape)
    print(f"{args.episodes} episodes through the bridge; /metrics scraped ({len(scrape.splitlines())} lines)")
    with tempfile.TemporaryDirectory() as work:
        verdict = score(traj, answer, Path(work), args.out / "verifier.log")
    (args.out / "verifier_reward_sample.json").write_text(json.dumps(verdict, indent=1) + "\n")
    print(f"verifier: reward {verdict['reward']} at log index {verdict['receipt']['log_index']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
