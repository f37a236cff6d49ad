"""Run one stand-in server as its own process, so a test can kill it (SIGKILL) and start it again.

``python -m tests.standins.serve --kind sglang --port P [--token-delay-s S]`` serves the SGLang (or
TensorRT-LLM, ``--kind trtllm``) wire format in front of a toy engine until the process dies. The
toy engine's seed is fixed, so every process (and a restarted one) serves the same model at policy
version 0: a restart loses every weight update, as a real engine's restart does.

``StandinProcess`` is the test side: start on a given (or free) port, wait until ``/health``
answers, ``kill()`` with SIGKILL, ``restart()`` on the same port, ``stop()``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from engines.config import ToyConfig
    from engines.toy import ToyEngine
    from tests.standins.sglang import SglangStandin
    from tests.standins.trtllm import TrtllmStandin

    parser = argparse.ArgumentParser(prog="python -m tests.standins.serve", description=__doc__)
    parser.add_argument("--kind", choices=("sglang", "trtllm"), required=True, help="wire format to serve")
    parser.add_argument("--port", type=int, required=True, help="HTTP port on 127.0.0.1")
    parser.add_argument("--served-name", default="toy", help="model name the server reports")
    parser.add_argument("--yield-every", type=int, default=3, help="toy engine: tokens per streamed chunk")
    parser.add_argument("--token-delay-s", type=float, default=0.0, help="toy engine: time per generated token")
    args = parser.parse_args(argv)

    toy = ToyEngine(ToyConfig(yield_every=args.yield_every, token_delay_s=args.token_delay_s))
    standin = (
        SglangStandin(toy, served_model_name=args.served_name)
        if args.kind == "sglang"
        else TrtllmStandin(toy, served_model_name=args.served_name)
    )
    uvicorn.run(standin.app(), host="127.0.0.1", port=args.port, log_level="warning", lifespan="off", access_log=False)


class StandinProcess:
    """One ``python -m tests.standins.serve`` child (see module docstring)."""

    def __init__(self, kind: str, port: int, *extra: str) -> None:
        self.kind, self.port, self.extra = kind, port, extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout_s: float = 30.0) -> StandinProcess:
        cmd = [sys.executable, "-m", "tests.standins.serve", "--kind", self.kind, "--port", str(self.port)]
        self.proc = subprocess.Popen([*cmd, *self.extra], cwd=ROOT, env=dict(os.environ))
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"stand-in {self.kind} on port {self.port} exited with {self.proc.returncode}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.url}/health").status_code == 200:
                        return self
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"stand-in {self.kind} on port {self.port} did not answer /health in {timeout_s:.0f} s")

    def kill(self) -> None:
        """SIGKILL: the process dies at once, mid-stream connections are cut without a final event."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def restart(self) -> StandinProcess:
        """A fresh process on the same port (toy weights at version 0)."""
        return self.start()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


if __name__ == "__main__":
    main()
