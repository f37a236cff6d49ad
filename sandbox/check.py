"""``primerl sandbox check POLICY``: run the escape suite against a sandbox policy, print what was contained.

Each attack runs as untrusted code in a real ``CodeSandbox`` under the policy; the host sets bait first and
checks it afterwards, so "contained" is what the host observed, not only what the code reported:

- network egress: TCP to public addresses and to a listener the check opens on the host's 127.0.0.1, UDP, DNS;
- write outside the workdir: every read-only mount, the root, /etc and a host directory made for the check
  (the host looks for the files afterwards); writable mounts the policy declares are listed, not attacked;
- fork bomb: ``while True: os.fork()``; it must end by the wall clock and leave no process behind;
- memory bomb: allocate 4 x the policy's memory in 64 MiB chunks;
- another process's /proc: a host process holding a secret in its environment and command line; the code
  scans every /proc/PID/{environ,cmdline} it can see and reads the host process's and the checker's;
- ptrace: PTRACE_TRACEME and PTRACE_ATTACH to PID 1;
- raising limits: setrlimit to infinity for each limit, and the hard limits seen inside match the policy.

Exit status: 0 everything contained; 1 something escaped; 2 the policy is invalid or the sandbox cannot run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from core.errors import PrimeRLError
from sandbox.config import SandboxConfig
from sandbox.policies import SandboxPolicy, load_policy
from sandbox.runner import CodeSandbox, RunResult

_BOOT_MARK = b"import resource, sys"  # the sandbox bootstrap's command line (leftover detection)
_MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Bait:
    """What the host sets up before the attacks and checks after them."""

    token: str  # the secret in the decoy's environment and command line
    host_dir: str  # a host directory the sandbox must not write into
    listen_port: int  # a TCP listener on the host's 127.0.0.1
    decoy_pid: int
    checker_pid: int


@dataclass(frozen=True, slots=True)
class Outcome:
    attack: str
    contained: bool
    evidence: str


Judge = Callable[[RunResult, SandboxPolicy, Bait], tuple[bool, str]]


def _lines(r: RunResult, prefix: str) -> list[str]:
    return [line for line in r.stdout.splitlines() if line.startswith(prefix)]


def _tail(r: RunResult) -> str:
    if r.timed_out:
        return "killed at the wall clock"
    last = (r.stderr.strip().splitlines() or [f"exit status {r.exit_code}"])[-1]
    return last[:120]


def _network_code(p: SandboxPolicy, b: Bait) -> str:
    targets = [("1.1.1.1", 80), ("8.8.8.8", 53), ("127.0.0.1", b.listen_port), ("example.com", 443)]
    return f"""
import socket
for host, port in {targets!r}:
    try:
        socket.create_connection((host, port), timeout=1).close()
        print("OPEN", host, port)
    except OSError as e:
        print("BLOCKED", f"{{host}}:{{port}}", e.strerror or e)
try:
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("1.1.1.1", 53))
    print("OPEN udp")
except OSError as e:
    print("BLOCKED udp", e.strerror)
"""


def _network_judge(r: RunResult, p: SandboxPolicy, b: Bait) -> tuple[bool, str]:
    opened, blocked = _lines(r, "OPEN"), _lines(r, "BLOCKED")
    if opened:
        return False, "; ".join(opened)
    if not r.ok or len(blocked) != 5:
        return False, f"probe did not complete: {_tail(r)}"
    reasons = sorted({line.split(" ", 2)[2] for line in blocked})
    return True, f"5/5 blocked ({', '.join(reasons)})"


def _write_targets(p: SandboxPolicy, b: Bait) -> list[str]:
    dirs = [*p.filesystem.read_only, "/", "/etc", b.host_dir]
    return [os.path.join(d, f"escape-{b.token}") for d in dirs]


def _write_code(p: SandboxPolicy, b: Bait) -> str:
    return f"""
for path in {_write_targets(p, b)!r}:
    try:
        open(path, "w").write("pwned")
        print("WROTE", path)
    except OSError as e:
        print("DENIED", path, e.strerror)
"""


def _write_judge(r: RunResult, p: SandboxPolicy, b: Bait) -> tuple[bool, str]:
    targets = _write_targets(p, b)
    on_host = [t for t in targets if os.path.lexists(t)]
    wrote, denied = _lines(r, "WROTE"), _lines(r, "DENIED")
    if on_host or wrote:
        return False, f"written: {', '.join(on_host or wrote)}"
    if len(denied) != len(targets):
        return False, f"probe did not complete: {_tail(r)}"
    declared = f"; writable by declaration: {', '.join(p.filesystem.read_write)}" if p.filesystem.read_write else ""
    return True, f"{len(targets)}/{len(targets)} refused, none on the host{declared}"


def _fork_code(p: SandboxPolicy, b: Bait) -> str:
    return "import os\nwhile True:\n    os.fork()\n"


def _fork_judge(r: RunResult, p: SandboxPolicy, b: Bait) -> tuple[bool, str]:
    left = _wait_for_no_leftovers(3.0)
    if left:
        return False, f"{len(left)} processes left running: {left[:8]}"
    if r.elapsed_s > p.limits.wall_s + 3:
        return False, f"ran {r.elapsed_s:.1f} s, past wall_s={p.limits.wall_s:g}"
    return True, f"{_tail(r)} after {r.elapsed_s:.1f} s; no process left (pids={p.limits.pids})"


def _memory_code(p: SandboxPolicy, b: Bait) -> str:
    chunks = 4 * p.limits.memory_mb // 64 + 1
    return f"""
held = []
try:
    for _ in range({chunks}):
        held.append(bytearray(64 * 1024 * 1024))
    print("ALLOCATED", len(held) * 64)
except MemoryError:
    print("STOPPED", len(held) * 64)
"""


def _memory_judge(r: RunResult, p: SandboxPolicy, b: Bait) -> tuple[bool, str]:
    if _lines(r, "ALLOCATED"):
        return False, f"allocated {_lines(r, 'ALLOCATED')[0].split()[1]} MiB (memory_mb={p.limits.memory_mb})"
    stopped = _lines(r, "STOPPED")
    if stopped:
        return True, f"MemoryError after {stopped[0].split()[1]} MiB (memory_mb={p.limits.memory_mb})"
    return True, f"stopped: {_tail(r)}"


def _proc_code(p: SandboxPolicy, b: Bait) -> str:
    return f"""
import os
token = {b.token!r}.encode()
pids = [d for d in os.listdir("/proc") if d.isdigit()]
for pid in pids:
    for name in ("environ", "cmdline"):
        try:
            if token in open(f"/proc/{{pid}}/{{name}}", "rb").read():
                print("FOUND", pid, name)
        except OSError:
            pass
for pid in ({b.decoy_pid}, {b.checker_pid}):
    try:
        print("READ", pid, token in open(f"/proc/{{pid}}/environ", "rb").read())
    except OSError as e:
        print("DENIED", pid, e.strerror)
print("VISIBLE", len(pids))
"""


def _proc_judge(r: RunResult, p: SandboxPolicy, b: Bait) -> tuple[bool, str]:
    found = _lines(r, "FOUND") + [line for line in _lines(r, "READ") if line.endswith("True")]
    if found:
        return False, "the host process's secret was read: " + "; ".join(found)
    visible = _lines(r, "VISIBLE")
    if not r.ok or not visible:
        return False, f"probe did not complete: {_tail(r)}"
    return True, f"secret not found; {visible[0].split()[1]} PIDs visible (the sandbox's own)"


def _ptrace_code(p: SandboxPolicy, b: Bait) -> str:
    return """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
for what, req, pid in (("TRACEME", 0, 0), ("ATTACH(1)", 16, 1)):
    rc = libc.ptrace(req, pid, 0, 0)
    print("PTRACE", what, rc, ctypes.get_errno())
"""


def _ptrace_judge(r: RunResult, p: SandboxPolicy, b: Bait) -> tuple[bool, str]:
    calls = [line.split() for line in _lines(r, "PTRACE")]
    if len(calls) != 2:
        return False, f"probe did not complete: {_tail(r)}"
    allowed = [c[1] for c in calls if c[2] != "-1"]
    if allowed:
        return False, f"ptrace {', '.join(allowed)} succeeded"
    return True, "; ".join(f"{c[1]}: {os.strerror(int(c[3]))}" for c in calls)


_RLIMITS = ("RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_NPROC", "RLIMIT_NOFILE", "RLIMIT_FSIZE", "RLIMIT_CORE")


def _limits_code(p: SandboxPolicy, b: Bait) -> str:
    return f"""
import resource
for name in {_RLIMITS!r}:
    res = getattr(resource, name)
    try:
        resource.setrlimit(res, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        print("RAISED", name)
    except (ValueError, OSError):
        print("KEPT", name, resource.getrlimit(res)[1])
"""


def _limits_judge(r: RunResult, p: SandboxPolicy, b: Bait) -> tuple[bool, str]:
    lim = p.limits
    want = dict(
        zip(
            _RLIMITS,
            (lim.cpu_s + 1, lim.memory_mb * _MIB, lim.pids, lim.open_files, lim.file_size_mb * _MIB, 0),
            strict=True,
        )
    )
    raised = _lines(r, "RAISED")
    if raised:
        return False, "; ".join(raised)
    kept = {line.split()[1]: int(line.split()[2]) for line in _lines(r, "KEPT")}
    if kept != want:
        return False, f"hard limits inside {kept} are not the policy's {want}"
    return True, f"{len(kept)}/{len(kept)} setrlimit(INFINITY) refused; hard limits are the policy's"


ATTACKS: tuple[tuple[str, Callable[[SandboxPolicy, Bait], str], Judge], ...] = (
    ("network egress", _network_code, _network_judge),
    ("write outside the workdir", _write_code, _write_judge),
    ("fork bomb", _fork_code, _fork_judge),
    ("memory bomb", _memory_code, _memory_judge),
    ("another process's /proc", _proc_code, _proc_judge),
    ("ptrace", _ptrace_code, _ptrace_judge),
    ("raising limits", _limits_code, _limits_judge),
)


def _sandbox_processes() -> set[int]:
    """PIDs of live processes running the sandbox bootstrap (any sandbox on this host)."""
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if _BOOT_MARK in f.read():
                        pids.add(int(entry))
            except OSError:
                continue
    return pids


_BEFORE: set[int] = set()


def _wait_for_no_leftovers(timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := sorted(_sandbox_processes() - _BEFORE)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@contextmanager
def _bait() -> Iterator[Bait]:
    """The host side of the attacks: a secret-holding decoy process, a loopback listener, a host directory."""
    token = uuid.uuid4().hex
    listener = socket.create_server(("127.0.0.1", 0))
    decoy = subprocess.Popen(
        ["/bin/sh", "-c", "sleep 120", f"envhub-decoy-{token}"], env={"ENVHUB_SECRET": token, "PATH": "/usr/bin:/bin"}
    )
    try:
        with tempfile.TemporaryDirectory(prefix="envhub-check-") as host_dir:
            yield Bait(token, host_dir, listener.getsockname()[1], decoy.pid, os.getpid())
    finally:
        decoy.kill()
        decoy.wait()
        listener.close()


async def check_policy(
    policy: SandboxPolicy, config: SandboxConfig | None = None, attacks: Collection[str] = ()
) -> list[Outcome]:
    """Run the attacks (all, or those named in ``attacks``) under ``policy``; raises ``ToolError`` when the
    sandbox cannot run here."""
    if config is None:  # a uid of its own, so the fork bomb's RLIMIT_NPROC meets no other sandbox's processes
        config = SandboxConfig(run_as_uid=62_000 + os.getpid() % 1000)
    box = CodeSandbox(config, policy)
    outcomes = []
    with _bait() as bait:
        _BEFORE.clear()
        _BEFORE.update(_sandbox_processes())
        for attack, code, judge in ATTACKS:
            if attacks and attack not in attacks:
                continue
            result = await box.run(code(box.policy, bait))
            contained, evidence = judge(result, box.policy, bait)
            outcomes.append(Outcome(attack, contained, evidence))
    return outcomes


def render(policy: SandboxPolicy, source: str, outcomes: list[Outcome]) -> str:
    width = max(len(o.attack) for o in outcomes)
    rows = [f"policy {policy.name}  {policy.digest()}  ({source})", f"{'attack':<{width}}  {'result':<9}  evidence"]
    rows += [f"{o.attack:<{width}}  {'contained' if o.contained else 'ESCAPED':<9}  {o.evidence}" for o in outcomes]
    held = sum(o.contained for o in outcomes)
    rows.append(f"{held}/{len(outcomes)} contained")
    return "\n".join(rows)


def add_sandbox_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sandbox = subparsers.add_parser("sandbox", help="declarative sandbox policies (sandbox/policies)")
    sub = sandbox.add_subparsers(dest="sandbox_command", required=True)
    check = sub.add_parser("check", help="run the escape suite against policies and print what was contained")
    check.add_argument("policies", nargs="+", metavar="POLICY", help="a shipped policy's name or a YAML file")


def run_sandbox(args: argparse.Namespace) -> int:
    status = 0
    for ref in args.policies:
        try:
            policy = load_policy(ref)
            outcomes = asyncio.run(check_policy(policy))
        except PrimeRLError as exc:  # an invalid policy (InvalidArgument) or no working sandbox (ToolError)
            print(f"primerl sandbox check: {exc}", file=sys.stderr)
            return 2
        source = ref if Path(ref).is_file() else f"shipped: sandbox/policies/{ref}.yaml"
        print(render(policy, source, outcomes))
        status = max(status, 0 if all(o.contained for o in outcomes) else 1)
    return status
