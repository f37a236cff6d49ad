"""Code sandbox: a fresh, isolated, resource-limited Python process per call.

Layers (see reference spec C2):
1. a fresh process per call in its own process group (``start_new_session``); on the
   wall-clock deadline or the output cap the whole group is SIGKILLed, and bubblewrap's
   ``--die-with-parent`` plus the PID namespace take every descendant down with it;
2. rlimits set by a bootstrap inside the sandbox before the user code runs (CPU, address
   space, file size, processes, open files, no core files); hard limits, so the code can
   only lower them. Root is exempt from RLIMIT_NPROC, so a root hub drops to
   ``run_as_uid`` (``setpriv``) before entering the sandbox;
3. bubblewrap: new user/net/pid/ipc/uts/cgroup namespaces, all capabilities dropped,
   ``/usr`` bound read-only, no ``/etc``, ``/home`` or ``/root``, the root remounted
   read-only, a size-capped tmpfs work directory (``/work``) and ``/tmp``;
4. a seccomp deny list (``connectors.seccomp``: ptrace, mount, bpf, keyctl, ...; x86_64);
5. stdout+stderr capped; exceeding the cap kills the process.

Every run is under a ``SandboxPolicy`` (``sandbox.policies``): its mounts, limits and seccomp deny list
are the bwrap arguments, rlimits and BPF program below; the sandbox runs the ``default`` policy unless
given another, with the limits set explicitly in ``[envhub.sandbox]`` on top (``under_config``).

Without a working bubblewrap the sandbox refuses to run (``ToolError(kind="unavailable")``)
unless the config says ``isolation="none"`` and ``allow_unisolated=true``. Only a successful
bubblewrap probe is remembered; a failed one (bwrap's error, a timeout, a missing ``setpriv``)
is reported as ``ToolError(kind="unavailable")`` and probed again on the next call, so a
transient failure on a loaded host does not disable the sandbox for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

from core.errors import ToolError
from sandbox import seccomp
from sandbox.config import SandboxConfig
from sandbox.policies import SandboxPolicy, load_policy, under_config

# Runs inside the sandbox: sets hard rlimits, then executes the code read from stdin.
_BOOT = r"""
import resource, sys
cpu, mem, fsize, nproc, nofile = (int(x) for x in sys.argv[1:6])
for res, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, mem, mem),
                        (resource.RLIMIT_FSIZE, fsize, fsize), (resource.RLIMIT_NPROC, nproc, nproc),
                        (resource.RLIMIT_NOFILE, nofile, nofile), (resource.RLIMIT_CORE, 0, 0)):
    resource.setrlimit(res, (soft, hard))
src = sys.stdin.read()
sys.stdin.close()
sys.argv = ["main.py"]
exec(compile(src, "main.py", "exec"), {"__name__": "__main__", "__file__": "main.py"})
"""

_SIGNAL_NAMES = {
    signal.SIGKILL: "SIGKILL",
    signal.SIGXCPU: "SIGXCPU (CPU limit)",
    signal.SIGXFSZ: "SIGXFSZ (file size)",
}


@dataclass(frozen=True, slots=True)
class RunResult:
    """The outcome of one sandboxed run."""

    exit_code: int  # the process's status; 128 + n when killed by signal n
    stdout: str
    stderr: str
    timed_out: bool
    output_capped: bool
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.output_capped

    def describe(self) -> str:
        """The text shown to the model."""
        if self.timed_out:
            head = "error (timeout): killed after the wall-clock limit"
        elif self.output_capped:
            head = "error (limit): output exceeded the cap; process killed"
        elif self.exit_code > 128 and self.exit_code - 128 in _SIGNAL_NAMES:
            head = f"error (limit): killed by {_SIGNAL_NAMES[signal.Signals(self.exit_code - 128)]}"
        elif self.exit_code != 0:
            head = f"error (runtime): exit status {self.exit_code}"
        else:
            head = "exit status 0"
        parts = [head]
        if self.stdout:
            parts.append("--- stdout ---\n" + self.stdout)
        if self.stderr:
            parts.append("--- stderr ---\n" + self.stderr)
        return "\n".join(parts)


def default_python() -> str:
    """The interpreter for the sandbox when none is configured: it must live under ``/usr``
    (the only tree bound into the sandbox), so the hub's own interpreter when it does (the
    python:*-slim image's ``/usr/local/bin/python3``), else the distribution's."""
    own = os.path.realpath(sys.executable) if sys.executable else ""
    for candidate in (own, "/usr/bin/python3", "/usr/local/bin/python3"):
        if candidate.startswith("/usr/") and os.access(candidate, os.X_OK):
            return candidate
    return "/usr/bin/python3"


class CodeSandbox:
    """Runs Python code under ``policy`` (a policy or a shipped policy's name); one fresh process per ``run``."""

    def __init__(self, config: SandboxConfig | None = None, policy: SandboxPolicy | str = "default") -> None:
        self.config = config or SandboxConfig()
        self.policy = under_config(policy if isinstance(policy, SandboxPolicy) else load_policy(policy), self.config)
        self.python = self.config.python or default_python()
        self._works = False  # bubblewrap built a sandbox here once (failures are not remembered)

    def _limits(self) -> list[str]:
        c = self.policy.limits
        mib = 1024 * 1024
        limits = (c.cpu_s, c.memory_mb * mib, c.file_size_mb * mib, c.pids, c.open_files)
        return [str(v) for v in limits]

    def _seccomp_fd(self) -> int | None:
        """A memfd holding the BPF program (inherited by bwrap), or None when not in use."""
        deny = self.policy.syscalls.deny
        if self.config.isolation != "bwrap" or not deny or not seccomp.supported():
            return None
        fd = os.memfd_create("envhub-seccomp", 0)
        os.write(fd, seccomp.deny_list_program(tuple(seccomp.DENIED_X86_64[name] for name in deny)))
        os.lseek(fd, 0, os.SEEK_SET)
        return fd

    def _bwrap_argv(self, inner: list[str], seccomp_fd: int | None) -> list[str]:
        c, fs = self.config, self.policy.filesystem
        argv: list[str] = []
        if os.geteuid() == 0:
            setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
            argv += [setpriv, f"--reuid={c.run_as_uid}", f"--regid={c.run_as_uid}", "--clear-groups", "--"]
        argv += [c.bwrap_path, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent"]
        argv += ["--new-session", "--cap-drop", "ALL", "--hostname", "sandbox"]
        for path in fs.read_only:
            argv += ["--ro-bind", path, path]
        for path in fs.read_write:
            argv += ["--bind", path, path]
        for link in ("bin", "lib", "lib64", "sbin"):
            if os.path.islink(f"/{link}"):
                argv += ["--symlink", os.readlink(f"/{link}"), f"/{link}"]
        argv += ["--proc", "/proc", "--dev", "/dev"]
        for mount in fs.tmpfs:
            argv += ["--size", str(mount.size_mb * 1024 * 1024), "--tmpfs", mount.path]
        argv += ["--remount-ro", "/", "--chdir", fs.workdir, "--clearenv"]
        argv += ["--setenv", "PATH", "/usr/bin", "--setenv", "HOME", fs.workdir, "--setenv", "LANG", "C.UTF-8"]
        if seccomp_fd is not None:
            argv += ["--seccomp", str(seccomp_fd)]
        return [*argv, "--", *inner]

    async def _probe(self) -> str:
        """Check that bubblewrap can build the sandbox here; '' when it can, else why not.

        Success is remembered for the life of the sandbox object; a failure is not (bwrap can
        fail transiently, e.g. EAGAIN creating namespaces under load), so it costs one probe
        per call while the host cannot sandbox, and the sandbox recovers when it can again.
        """
        if self._works:
            return ""
        if not os.access(self.config.bwrap_path, os.X_OK):
            return f"{self.config.bwrap_path} is not installed"
        fd = self._seccomp_fd()
        try:
            proc = await _spawn(self._bwrap_argv(["/usr/bin/true"], fd), fd, probe=True)
        except OSError as e:  # FileNotFoundError: no setpriv (root hubs) or bwrap vanished
            return f"cannot start the isolation probe: {e}"
        finally:
            if fd is not None:
                os.close(fd)
        try:
            _, err = await asyncio.wait_for(proc.communicate(), timeout=self.config.probe_timeout_s)
        except TimeoutError:
            _kill_group(proc.pid)
            await _reap(proc)
            return f"the isolation probe did not finish in {self.config.probe_timeout_s:g} s"
        if proc.returncode != 0:
            return err.decode(errors="replace").strip()[:300] or f"bwrap exited with status {proc.returncode}"
        self._works = True
        return ""

    async def _command(self, workdir: str, seccomp_fd: int | None) -> tuple[list[str], str | None]:
        inner = [self.python, "-I", "-c", _BOOT, *self._limits()]
        if self.config.isolation == "none":
            if not self.config.allow_unisolated:
                raise ToolError(
                    "the code sandbox refuses to run without an isolation layer; set sandbox.allow_unisolated=true "
                    "to accept running code with rlimits only",
                    kind="unavailable",
                )
            return inner, workdir
        why = await self._probe()
        if why:
            raise ToolError(
                f"the code sandbox refuses to run: no working isolation layer ({why}); install bubblewrap or "
                "explicitly configure isolation='none' with allow_unisolated=true",
                kind="unavailable",
            )
        return self._bwrap_argv(inner, seccomp_fd), None

    async def run(self, code: str) -> RunResult:
        """Run ``code`` (Python source) and return its capped output and status."""
        with tempfile.TemporaryDirectory(prefix="envhub-sbx-") as tmp:
            fd = self._seccomp_fd()
            try:
                argv, cwd = await self._command(tmp, fd)
                env = {"PATH": "/usr/bin", "HOME": cwd or "/", "LANG": "C.UTF-8"}  # nothing of the hub's env
                t0 = time.monotonic()
                try:
                    proc = await _spawn(argv, fd, probe=False, cwd=cwd, env=env)
                except OSError as e:  # the interpreter (isolation none) or setpriv/bwrap is missing
                    raise ToolError(f"the code sandbox cannot start: {e}", kind="unavailable") from e
            finally:
                if fd is not None:
                    os.close(fd)
            try:
                return await self._supervise(proc, code, t0)
            finally:
                _kill_group(proc.pid)
                await _reap(proc)

    async def _supervise(self, proc: asyncio.subprocess.Process, code: str, t0: float) -> RunResult:
        cap = self.config.max_output_bytes
        out = bytearray()
        err = bytearray()
        capped = asyncio.Event()

        async def pump(stream: asyncio.StreamReader | None, buf: bytearray) -> None:
            assert stream is not None
            while chunk := await stream.read(65536):
                room = cap - len(out) - len(err)
                buf += chunk[: max(0, room)]
                if len(chunk) > room:
                    capped.set()
                    _kill_group(proc.pid)
                    return

        async def feed() -> None:
            assert proc.stdin is not None
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                proc.stdin.write(code.encode())
                await proc.stdin.drain()
                proc.stdin.close()

        timed_out = False
        try:
            async with asyncio.timeout(self.policy.limits.wall_s):
                await asyncio.gather(feed(), pump(proc.stdout, out), pump(proc.stderr, err))
                await proc.wait()
        except TimeoutError:
            # Output past the cap already killed the group: the clock then only ran out while the kill landed
            # (a loaded machine), and the cap stays the reason given.
            timed_out = not capped.is_set()
            _kill_group(proc.pid)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), timeout=5)
        rc = proc.returncode if proc.returncode is not None else -9
        exit_code = 128 - rc if rc < 0 else rc
        return RunResult(
            exit_code=exit_code,
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            timed_out=timed_out,
            output_capped=capped.is_set(),
            elapsed_s=time.monotonic() - t0,
        )


async def _spawn(
    argv: list[str], seccomp_fd: int | None, *, probe: bool, cwd: str | None = None, env: dict[str, str] | None = None
) -> asyncio.subprocess.Process:
    """Start ``argv`` as the leader of its own process group (so a kill reaches everything it started), handing
    it the seccomp filter's fd; a probe's stdin/stdout are discarded, a run's piped. stderr is always piped."""
    io = asyncio.subprocess.DEVNULL if probe else asyncio.subprocess.PIPE
    return await asyncio.create_subprocess_exec(
        *argv,
        stdin=io,
        stdout=io,
        stderr=asyncio.subprocess.PIPE,
        cwd=cwd,
        env=env,
        start_new_session=True,
        pass_fds=() if seccomp_fd is None else (seccomp_fd,),
    )


async def _reap(proc: asyncio.subprocess.Process) -> None:
    """Wait for the killed process and drain its pipes to EOF, which closes the transport."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(5):
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    while await stream.read(65536):
                        pass
            await proc.wait()


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
