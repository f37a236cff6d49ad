"""Code sandbox escape suite (acceptance point 1): each attempt is contained, reported as a
clear tool error, and leaves the host unchanged."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from core.errors import ToolError
from envhub.envs._data import load_tasks
from envhub.envs.code_math import CodeMathEnv
from envhub.loop import ToolLoop
from sandbox import seccomp
from sandbox.config import SandboxConfig
from sandbox.runner import CodeSandbox, default_python

# A uid no other test uses, so leftover processes of the run are countable (root hubs drop to it).
TEST_UID = 61_000 + os.getpid() % 1000
# RLIMIT_NOFILE of every sandbox of this run: a tag on the sandboxed Python's command line
# (``python -I -c <boot> cpu mem fsize nproc nofile``; forks inherit it), so leftovers are
# countable when the hub is not root and the code keeps the hub's uid.
NOFILE_TAG = 1_000 + os.getpid() % 1000


def sandbox(**kw: object) -> CodeSandbox:
    defaults: dict[str, object] = {
        "wall_s": 3.0,
        "cpu_s": 1,
        "memory_mb": 128,
        "run_as_uid": TEST_UID,
        "max_open_files": NOFILE_TAG,
    }
    defaults.update(kw)
    return CodeSandbox(SandboxConfig.model_validate(defaults))


def leftover_processes() -> list[int]:
    """PIDs of this run's sandboxes still alive, read from /proc: as root, every process of
    the test uid; in any case, every process whose command line is a tagged sandbox boot."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            uid = os.stat(f"/proc/{entry}").st_uid
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        tagged = b"import resource, sys" in b"".join(argv) and str(NOFILE_TAG).encode() in argv[-3:]
        if (os.geteuid() == 0 and uid == TEST_UID) or tagged:
            pids.append(int(entry))
    return pids


def assert_no_leftovers() -> None:
    deadline = time.monotonic() + 5
    while leftover_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leftover_processes() == []


async def test_leftover_detector_sees_a_running_sandbox() -> None:
    """The check the escape tests rely on must see sandboxed processes, root or not."""
    run = asyncio.ensure_future(sandbox(wall_s=3, max_processes=4).run("import os, time\nos.fork()\ntime.sleep(30)"))
    seen: list[int] = []
    deadline = time.monotonic() + 2.5
    while len(seen) < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        seen = leftover_processes()
    r = await run
    assert len(seen) >= 2, seen  # the sandboxed Python and its fork
    assert r.timed_out
    assert_no_leftovers()


async def test_plain_code_runs() -> None:
    r = await sandbox().run("import math\nprint(math.factorial(20))\nopen('scratch.txt', 'w').write('ok')")
    assert r.ok and r.stdout == "2432902008176640000\n"
    assert r.describe().startswith("exit status 0")


@pytest.mark.parametrize(
    "code",
    [
        "import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)",
        "import socket; socket.create_connection(('127.0.0.1', 5432), timeout=2)",  # the host's PostgreSQL
        "import urllib.request; urllib.request.urlopen('http://example.com', timeout=2)",
    ],
)
async def test_outbound_network_is_unreachable(code: str) -> None:
    r = await sandbox().run(code)
    assert not r.ok and r.exit_code == 1
    text = r.describe()
    assert text.startswith("error (runtime): exit status 1")
    assert any(
        s in text
        for s in (
            "Network is unreachable",
            "Connection refused",
            "Name or service not known",
            "Temporary failure in name resolution",
        )
    )


async def test_writes_outside_the_workdir_fail_and_host_is_unchanged(tmp_path: Path) -> None:
    marker = f"envhub-escape-{uuid.uuid4().hex}"
    outside = [f"/usr/{marker}", f"/etc/{marker}", str(tmp_path / marker), f"/{marker}", f"/usr/lib/python3/{marker}"]
    code = "\n".join(
        f"try:\n    open({t!r}, 'w').write('pwned')\n    print('WROTE', {t!r})\n"
        "except OSError as e:\n    print('DENIED', e.errno)"
        for t in [*outside, f"/tmp/{marker}"]
    )
    r = await sandbox().run(code)
    assert r.ok and r.stdout.count("DENIED") == len(outside)
    assert r.stdout.splitlines()[-1] == f"WROTE /tmp/{marker}"  # the sandbox's own tmpfs /tmp
    for t in [*outside, f"/tmp/{marker}"]:  # nothing appeared on the host
        assert not Path(t).exists()  # noqa: ASYNC240 (a stat in a test)


async def test_secrets_outside_the_workdir_are_not_visible(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-VALUE")
    code = (
        "import os\n"
        f"for p in [{str(secret)!r}, '/etc/shadow', '/etc/passwd', '/root/.bashrc', '/proc/1/environ']:\n"
        "    try:\n        print('READ', p, open(p).read()[:20])\n"
        "    except OSError as e:\n        print('DENIED', p, e.errno)\n"
        "print('ENV', sorted(os.environ))"
    )
    r = await sandbox().run(code)
    assert "TOP-SECRET-VALUE" not in r.stdout and "READ" not in r.stdout.replace("READ /proc/1/environ", "")
    env_line = next(line for line in r.stdout.splitlines() if line.startswith("ENV "))
    assert set(eval(env_line[4:])) <= {"HOME", "LANG", "PATH", "PWD"}  # the hub's environment is not inherited


async def test_fork_bomb_is_contained() -> None:
    r = await sandbox(max_processes=16).run("import os\nwhile True:\n    os.fork()")
    assert not r.ok
    assert "Resource temporarily unavailable" in r.stderr or r.timed_out
    assert_no_leftovers()


async def test_memory_bomb_is_contained() -> None:
    r = await sandbox(memory_mb=128).run("x = bytearray(1024 ** 3)\nprint(len(x))")
    assert not r.ok and "MemoryError" in r.stderr and r.stdout == ""


async def test_infinite_loop_is_killed_by_cpu_limit_or_wall_clock() -> None:
    r = await sandbox(cpu_s=1, wall_s=5).run("while True:\n    pass")
    assert not r.ok and r.describe().startswith("error (limit): killed by SIGXCPU")
    r2 = await sandbox(wall_s=1).run("import time\ntime.sleep(60)")  # no CPU use: the wall clock kills it
    assert r2.timed_out and r2.describe().startswith("error (timeout)")
    assert_no_leftovers()


async def test_huge_output_is_capped_and_the_process_killed() -> None:
    r = await sandbox(max_output_bytes=4096).run("import sys\nwhile True:\n    sys.stdout.write('A' * 65536)")
    assert r.output_capped and len(r.stdout) + len(r.stderr) <= 4096
    # the cap killed it (not the wall clock, even where the kill lands after the clock ran out on a loaded machine)
    assert not r.timed_out and r.exit_code == 128 + signal.SIGKILL, r
    assert r.describe().startswith("error (limit): output exceeded the cap")


async def test_big_file_is_refused() -> None:
    r = await sandbox(max_file_mb=1).run("open('big', 'wb').write(b'0' * (8 * 1024 * 1024))")
    assert not r.ok and "File too large" in r.stderr


SYSCALL_PROBE = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print("ptrace", libc.ptrace(0, 0, 0, 0), ctypes.get_errno())  # PTRACE_TRACEME needs no privilege
print("bpf", libc.syscall(321, 0, 0, 0), ctypes.get_errno())
print("seccomp", open("/proc/self/status").read().split("Seccomp:")[1].split()[0])
"""


@pytest.mark.skipif(not seccomp.supported(), reason="the seccomp deny list is built for x86_64")
async def test_seccomp_denies_kernel_attack_surface() -> None:
    r = await sandbox().run(SYSCALL_PROBE)
    assert r.ok and r.stdout.splitlines() == ["ptrace -1 1", "bpf -1 1", "seccomp 2"]  # EPERM = 1, filter mode
    off = await sandbox(seccomp=False).run(SYSCALL_PROBE)
    assert off.stdout.splitlines()[0] == "ptrace 0 0" and off.stdout.splitlines()[2] == "seccomp 0"


async def test_refuses_without_isolation_unless_configured() -> None:
    with pytest.raises(ToolError, match="no working isolation layer") as err:
        await sandbox(bwrap_path="/nonexistent/bwrap").run("print(1)")
    assert err.value.kind == "unavailable"
    with pytest.raises(ToolError, match="allow_unisolated"):
        await sandbox(isolation="none").run("print(1)")
    r = await sandbox(isolation="none", allow_unisolated=True).run("print(6 * 7)")
    assert r.ok and r.stdout == "42\n"


async def test_code_math_env_grades_a_sandboxed_solution() -> None:
    env = CodeMathEnv(sandbox(), load_tasks("code_math"))
    await env.reset(task_id="math-3")
    loop = ToolLoop(env)
    d = await loop.on_turn(
        '<tool_call>{"name": "run_python", "arguments": {"code": "print(sum(int(d) for d in str(2**1000)))"}}'
        "</tool_call>"
    )
    assert d.should_continue and d.observation[0].content == "exit status 0\n--- stdout ---\n1366\n"
    d = await loop.on_turn("<answer>1366</answer>")
    assert d.done and d.reward == 1.0


@pytest.fixture
def flaky_bwrap() -> Iterator[tuple[str, Callable[[str], None]]]:
    """A bwrap stand-in: fails, then (``state("hang")``) hangs, then (``state("ready")``)
    execs the real one."""
    with tempfile.TemporaryDirectory(prefix="envhub-probe-") as d:
        os.chmod(d, 0o755)  # the dropped uid must reach the script
        fake = Path(d, "bwrap")
        fake.write_text(
            f'#!/bin/sh\n[ -e {d}/ready ] && exec /usr/bin/bwrap "$@"\n[ -e {d}/hang ] && exec sleep 30\n'
            "echo 'bwrap: Creating new namespace failed: Resource temporarily unavailable' >&2\nexit 1\n"
        )
        fake.chmod(stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
        yield str(fake), lambda name: Path(d, name).touch()


async def test_probe_failures_are_tool_errors_and_not_remembered(
    flaky_bwrap: tuple[str, Callable[[str], None]],
) -> None:
    """A failing or hanging probe (a loaded host) is ``unavailable`` and not cached: once
    bubblewrap works again, the same sandbox object runs code."""
    fake, state = flaky_bwrap
    box = sandbox(bwrap_path=fake, probe_timeout_s=0.5)
    with pytest.raises(ToolError, match="Resource temporarily unavailable") as err:
        await box.run("print(1)")
    assert err.value.kind == "unavailable"
    state("hang")
    with pytest.raises(ToolError, match="did not finish") as err:  # the probe's 0.5 s timeout, not a hang
        await box.run("print(1)")
    assert err.value.kind == "unavailable"
    state("ready")
    r = await box.run("print(6 * 7)")
    assert r.ok and r.stdout == "42\n"
    assert_no_leftovers()


async def test_a_missing_interpreter_is_a_tool_error() -> None:
    box = sandbox(isolation="none", allow_unisolated=True, python="/nonexistent/python3")
    with pytest.raises(ToolError, match="cannot start") as err:
        await box.run("print(1)")
    assert err.value.kind == "unavailable"


def test_default_interpreter_lives_under_usr() -> None:
    python = default_python()
    assert python.startswith("/usr/") and os.access(python, os.X_OK)
    assert CodeSandbox().python == python and CodeSandbox(SandboxConfig(python="/usr/bin/x")).python == "/usr/bin/x"


FORK_AND_ALLOCATE = """
import os, time
held = [bytearray(48 * 1024 * 1024)]  # the parent's share
allocated = 1
for _ in range(16):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        held.append(bytearray(48 * 1024 * 1024)); time.sleep(1); os._exit(0)
    allocated += 1
print(allocated * 48)
"""


async def test_default_limits_cap_total_memory_at_memory_mb() -> None:
    """RLIMIT_AS is per process: the default max_processes leaves no room to fork, so the
    code's total stays under memory_mb; a larger max_processes multiplies it (documented)."""
    default = SandboxConfig()
    r = await sandbox(memory_mb=64, max_processes=default.max_processes).run(FORK_AND_ALLOCATE)
    assert r.ok and int(r.stdout) <= 64, r.describe()
    r = await sandbox(memory_mb=64, max_processes=4).run(FORK_AND_ALLOCATE)
    assert r.ok and int(r.stdout) == 3 * 48, r.describe()  # (max_processes - 1) x memory_mb at most
    assert_no_leftovers()
