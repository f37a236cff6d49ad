"""Code sandbox escape suite (acceptance point 1): each attempt is contained, reported as a
clear tool error, and leaves the host unchanged."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

import pytest

from envhub.config import SandboxConfig
from envhub.connectors import seccomp
from envhub.connectors.sandbox import CodeSandbox
from envhub.envs._data import load_tasks
from envhub.envs.code_math import CodeMathEnv
from envhub.loop import ToolLoop
from server.errors import ToolError

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is installed by `make setup`")

# A uid no other test uses, so leftover processes of the run are countable (root hubs drop to it).
TEST_UID = 61_000 + os.getpid() % 1000


def sandbox(**kw: object) -> CodeSandbox:
    defaults: dict[str, object] = {"wall_s": 3.0, "cpu_s": 1, "memory_mb": 128, "run_as_uid": TEST_UID}
    defaults.update(kw)
    return CodeSandbox(SandboxConfig(**defaults))  # type: ignore[arg-type]


def leftover_processes() -> list[int]:
    """PIDs still running as the test uid (root hubs drop to it), read from /proc."""
    if os.geteuid() != 0:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == TEST_UID:
                    pids.append(int(entry))
            except FileNotFoundError:
                continue
    return pids


def assert_no_leftovers() -> None:
    deadline = time.monotonic() + 5
    while leftover_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leftover_processes() == []


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
    t0 = time.monotonic()
    r = await sandbox(max_processes=16).run("import os\nwhile True:\n    os.fork()")
    assert not r.ok and time.monotonic() - t0 < 5
    assert "Resource temporarily unavailable" in r.stderr or r.timed_out
    assert_no_leftovers()


async def test_memory_bomb_is_contained() -> None:
    r = await sandbox(memory_mb=128).run("x = bytearray(1024 ** 3)\nprint(len(x))")
    assert not r.ok and "MemoryError" in r.stderr and r.stdout == ""


async def test_infinite_loop_is_killed_by_cpu_limit_or_wall_clock() -> None:
    t0 = time.monotonic()
    r = await sandbox(cpu_s=1, wall_s=5).run("while True:\n    pass")
    assert not r.ok and r.describe().startswith("error (limit): killed by SIGXCPU")
    r2 = await sandbox(wall_s=1).run("import time\ntime.sleep(60)")  # no CPU use: the wall clock kills it
    assert r2.timed_out and r2.describe().startswith("error (timeout)")
    assert time.monotonic() - t0 < 6
    assert_no_leftovers()


async def test_huge_output_is_capped_and_the_process_killed() -> None:
    t0 = time.monotonic()
    r = await sandbox(max_output_bytes=4096).run("import sys\nwhile True:\n    sys.stdout.write('A' * 65536)")
    assert r.output_capped and len(r.stdout) + len(r.stderr) <= 4096
    assert r.describe().startswith("error (limit): output exceeded the cap")
    assert time.monotonic() - t0 < 3


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
