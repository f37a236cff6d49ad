"""``primerl rl --trainer @ t.toml --orchestrator @ o.toml --inference @ i.toml``: the three components, as
prime-rl's ``rl`` starts them.

It starts ``primerl inference`` (the bridge, on a free port), waits until it serves, then ``primerl orchestrator``
(pointed at it) and ``primerl trainer``, each a process of its own; streams their output line by line with a
``[inference]`` / ``[orchestrator]`` / ``[trainer]`` prefix; and stops all three on Ctrl-C or as soon as one fails,
naming it and its exit code (a non-zero exit). When the trainer and the orchestrator are done it stops the bridge
and prints the per-step table (``<out_dir>/metrics.jsonl``: reward, loss, the policy each batch was sampled from and
the off-policy gap, the trainer-inference mismatch of the on-policy tokens (``grpo.mismatch``; NaN when a step had
none), rollout and training times) and the held-out evaluation.

Arguments: ``--trainer @ FILE`` (and ``--orchestrator``, ``--inference``) give a component its config files;
``--trainer.KEY VALUE`` sets one of its keys; the run-wide keys (``--max-steps``, ``--max-async-level``,
``--out-dir``, ``--ckpt...``, ``--log-level``) go to the trainer and the orchestrator both.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from grpo.bridge_proc import ROOT, free_port, terminate

COMPONENTS = ("inference", "orchestrator", "trainer")
SHARED = ("max-steps", "max-async-level", "out-dir", "ckpt", "log-level")


class LaunchError(ValueError):
    """Arguments ``primerl rl`` cannot split between the components."""


def is_launch(argv: Sequence[str]) -> bool:
    """Whether ``primerl rl`` was given component arguments (else it is the single-process loop).

    A bare ``--trainer`` (``--trainer @ file``) or any ``--orchestrator``/``--inference`` flag is a launch;
    ``--trainer.lr 1e-5`` alone is not: the single-process loop has a ``[trainer]`` section of its own.
    """
    bare = {f"--{c}" for c in COMPONENTS}
    launch_only = {f"--{c}" for c in COMPONENTS if c != "trainer"}
    return any(a in bare or a.split(".")[0].split("=")[0] in launch_only for a in argv)


def split_args(argv: Sequence[str]) -> dict[str, list[str]]:
    """Each component's arguments: its ``@`` files, its ``--component.key`` flags, and the run-wide flags."""
    out: dict[str, list[str]] = {c: [] for c in COMPONENTS}
    shared: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        name = a[2:].split("=")[0].split(".")[0] if a.startswith("--") else ""
        if a in {f"--{c}" for c in COMPONENTS}:
            i += 1
            if argv[i : i + 1] != ["@"] or i + 1 >= len(argv):
                raise LaunchError(f"{a}: expected '@ FILE' after it")
            while argv[i : i + 1] == ["@"] and i + 1 < len(argv):
                out[name] += ["@", argv[i + 1]]
                i += 2
            continue
        if name in COMPONENTS:  # --trainer.lr 1e-5 / --trainer.lr=1e-5
            flag = "--" + a[len(name) + 3 :]
            out[name].append(flag)
            if "=" not in a and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                out[name].append(argv[i + 1])
                i += 1
        elif name in SHARED or (name.startswith("no-") and name[3:] in SHARED):
            shared.append(a)
            if "=" not in a and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                shared.append(argv[i + 1])
                i += 1
        else:
            raise LaunchError(
                f"{a}: not a run-wide key ({', '.join('--' + s for s in SHARED)}); give it to one component as "
                f"--trainer{a[1:] if a.startswith('--') else '.' + a}, --orchestrator... or --inference..."
            )
        i += 1
    out["trainer"] += shared
    out["orchestrator"] += shared
    return out


class Child:
    """One component process with its output streamed to ours under a prefix."""

    def __init__(self, name: str, cmd: list[str], sink: TextIO, lock: threading.Lock) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
            preexec_fn=_die_with_parent,
        )  # fmt: skip
        self.thread = threading.Thread(target=self._pump, args=(sink, lock), daemon=True, name=f"pump-{name}")
        self.thread.start()

    def _pump(self, sink: TextIO, lock: threading.Lock) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            for part in line.rstrip("\n").split("\r"):
                if part.strip():
                    with lock:
                        sink.write(f"[{self.name}] {part}\n")
                        sink.flush()

    def describe_exit(self) -> str:
        code = self.proc.returncode
        if code is not None and code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"


def _die_with_parent() -> None:
    """A child gets SIGTERM when the launcher dies (Linux ``PR_SET_PDEATHSIG``), so no component outlives it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


def launch(argv: Sequence[str], sink: TextIO = sys.stdout) -> int:
    from core.layered_config import ConfigError, load_config
    from grpo.exchange import RunDir
    from grpo.orchestrator import OrchestratorConfig
    from grpo.trainer import TrainerConfig

    try:
        parts = split_args(argv)
        tcfg = load_config(TrainerConfig, parts["trainer"])
        ocfg = load_config(OrchestratorConfig, [*parts["orchestrator"], "--bridge.target", "127.0.0.1:1"])
    except (LaunchError, ConfigError) as exc:
        print(f"primerl rl: {exc}", file=sys.stderr)
        return 2
    if (tcfg.out_dir, tcfg.max_steps, tcfg.max_async_level) != (ocfg.out_dir, ocfg.max_steps, ocfg.max_async_level):
        print(
            "primerl rl: the trainer and the orchestrator disagree on out_dir, max_steps or max_async_level "
            f"({tcfg.out_dir}, {tcfg.max_steps}, {tcfg.max_async_level} vs {ocfg.out_dir}, {ocfg.max_steps}, "
            f"{ocfg.max_async_level}): set them once, as run-wide keys",
            file=sys.stderr,
        )
        return 2
    resume = tcfg.ckpt.resume_step if tcfg.ckpt else None
    RunDir(tcfg.out_dir).clear_after(resume or 0)  # an earlier run's batches and weights in this directory
    port = free_port()
    py = [sys.executable, "-m", "server"]
    lock = threading.Lock()
    children: list[Child] = []

    def say(msg: str) -> None:
        with lock:
            sink.write(f"primerl rl: {msg}\n")
            sink.flush()

    def stop_all() -> None:
        for c in reversed(children):
            terminate(c.proc, timeout=30)
        for c in children:
            c.thread.join(timeout=5)

    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        inference = Child(
            "inference",
            [*py, "inference", *parts["inference"], "--port", str(port), "--metrics-port", "0", "--http-port", "0"],
            sink,
            lock,
        )
        children.append(inference)
        if not _wait_serving(f"127.0.0.1:{port}", inference):
            say(f"the inference server {inference.describe_exit()} before it served; stopping")
            return 1
        say(f"inference serves on 127.0.0.1:{port} (pid {inference.proc.pid})")
        target = ["--bridge.target", f"127.0.0.1:{port}"]
        children.append(Child("orchestrator", [*py, "orchestrator", *parts["orchestrator"], *target], sink, lock))
        children.append(Child("trainer", [*py, "trainer", *parts["trainer"]], sink, lock))
        say("pids: " + ", ".join(f"{c.name} {c.proc.pid}" for c in children))
        while True:
            for c in children:
                code = c.proc.poll()
                if code is not None and (code != 0 or c.name == "inference"):
                    say(f"the {c.name} (pid {c.proc.pid}) {c.describe_exit()}; stopping the others")
                    return 1
            if all(c.proc.poll() == 0 for c in children if c.name != "inference"):
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        say("interrupted: stopping the trainer, the orchestrator and the inference server")
        return 130
    finally:
        stop_all()
        signal.signal(signal.SIGTERM, previous)
    rows = read_rows(Path(tcfg.out_dir))
    sink.write(table(Path(tcfg.out_dir), rows))
    if rows:
        from grpo.plots import plot

        plot(rows, Path(tcfg.out_dir) / "reward_curve.png", f"{tcfg.algorithm}, max_async_level {tcfg.max_async_level}")
        sink.write(f"reward curve: {Path(tcfg.out_dir) / 'reward_curve.png'}\n")
    return 0


def _wait_serving(target: str, child: Child, timeout: float = 900.0) -> bool:
    from rl_client import BridgeClient

    deadline = time.monotonic() + timeout
    with BridgeClient(target, timeout=timeout) as client:
        while time.monotonic() < deadline:
            if child.proc.poll() is not None:
                return False
            try:
                client.wait_until_ready(2.0)
                return True
            except Exception:  # noqa: BLE001 - not serving yet (the engine is loading)
                continue
    return False


def read_rows(out: Path) -> list[dict[str, Any]]:
    """The trainer's per-step records (``<out>/metrics.jsonl``), none before its first step."""
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def table(out: Path, rows: list[dict[str, Any]] | None = None) -> str:
    """The per-step table of a finished run (``rows``: its records, read from ``out`` when not given), and its
    held-out evaluation."""
    rows = read_rows(out) if rows is None else rows
    cols = ("step", "reward", "loss", "policy", "sampled", "gap", "k3_kl", "rollout_s", "train_s")
    lines = ["", " ".join(f"{c:>9}" for c in cols)]
    for r in rows:
        cells = [r["step"], r["reward"], r["loss"], r["policy_version"], r.get("batch_policy", "")]
        cells += [
            r.get("off_policy_gap", ""),
            r.get("mismatch/k3_kl", ""),
            r.get("rollout_s", 0.0),
            r.get("train_s", 0.0),
        ]
        lines.append(" ".join(f"{c:>9.4g}" if isinstance(c, float) else f"{c:>9}" for c in cells))
    ev = out / "eval.json"
    if ev.is_file():
        report = json.loads(ev.read_text())
        for when in ("before", "after"):
            if report.get(when):
                e = report[when]
                lines.append(
                    f"held-out {when}: {e['correct']:.1%} correct, reward {e['reward']:.3f} (policy {e['policy']:.0f})"
                )
    return "\n".join(lines) + "\n"


__all__ = ["COMPONENTS", "LaunchError", "is_launch", "launch", "split_args", "table"]
