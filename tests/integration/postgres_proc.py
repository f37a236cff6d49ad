"""A private PostgreSQL cluster on a free port for tests (never the shared 5432).

``initdb`` into a temporary directory (trust auth, no fsync, small buffers), ``pg_ctl start``
listening on 127.0.0.1 only with its socket in that directory, databases created with
``createdb``; ``close()`` stops it (immediate mode) and deletes the directory.

Binaries: ``initdb`` on PATH, else the newest ``/usr/lib/postgresql/<version>/bin`` (where
Debian's ``postgresql`` package puts them; ``make setup`` installs it). initdb refuses to run
as root, so under root the server runs as the unprivileged ``postgres`` system user (created
by that package) via ``runuser``, and the directory is handed to that user. The cluster's
superuser is named ``postgres`` either way.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from tests.integration.redis_proc import free_port

SUPERUSER = "postgres"
_RUN_AS = "postgres"  # the system user the server runs as when the tests run as root
_START_TIMEOUT_S = 30


def postgres_bindir() -> Path:
    """The directory holding initdb, pg_ctl and createdb, or a RuntimeError naming the package."""
    on_path = shutil.which("initdb")
    if on_path is not None:
        return Path(on_path).resolve().parent  # Debian links them into PATH from /usr/lib/postgresql
    installed = [p for p in Path("/usr/lib/postgresql").glob("*/bin") if (p / "initdb").is_file()]
    if not installed:
        raise RuntimeError(
            "PostgreSQL server binaries (initdb, pg_ctl) not found on PATH or under /usr/lib/postgresql/*/bin: "
            "install Debian's `postgresql` package (`make setup` does)"
        )
    return max(installed, key=lambda p: tuple(int(x) for x in p.parent.name.split(".") if x.isdigit()))


class PrivatePostgres:
    """``start(databases)`` / ``close()``; ``dsn(dbname, user)`` for clients (TCP on 127.0.0.1)."""

    def __init__(self) -> None:
        self.bindir = postgres_bindir()
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="primerl-pg-"))
        self.data = self.dir / "data"
        self.log = self.dir / "server.log"
        self._as_user: list[str] = []
        if os.geteuid() == 0:
            try:
                owner = pwd.getpwnam(_RUN_AS)
            except KeyError:
                raise RuntimeError(
                    f"running as root and there is no {_RUN_AS!r} user to run PostgreSQL as "
                    "(Debian's `postgresql` package creates it)"
                ) from None
            os.chown(self.dir, owner.pw_uid, owner.pw_gid)
            self._as_user = ["runuser", "-u", _RUN_AS, "--"]
        self._may_run = False  # set before pg_ctl start: a start that timed out may have left a server

    def dsn(self, dbname: str = "postgres", user: str = SUPERUSER) -> str:
        return f"host=127.0.0.1 port={self.port} dbname={dbname} user={user} connect_timeout=3"

    def _run(self, tool: str, *args: str, server_side: bool = True, timeout: float = 60) -> None:
        cmd = [*(self._as_user if server_side else []), str(self.bindir / tool), *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        if done.returncode != 0:
            log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{tool} failed ({done.returncode}): {done.stderr.strip()}\n{log}".strip())

    def start(self, databases: tuple[str, ...] = ()) -> None:
        """Create the cluster, start it and wait until it accepts connections (bounded)."""
        # UTF8: under the C locale initdb would pick SQL_ASCII, and psycopg then returns text as bytes.
        initdb = ["-D", str(self.data), "-A", "trust", "-U", SUPERUSER, "-E", "UTF8", "--locale=C", "--no-sync"]
        self._run("initdb", *initdb)
        settings = {
            "port": str(self.port),
            "listen_addresses": "'127.0.0.1'",
            "unix_socket_directories": f"'{self.dir}'",
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "shared_buffers": "16MB",
            "max_connections": "40",
        }
        with (self.data / "postgresql.conf").open("a") as conf:  # appending keeps the file's owner
            conf.writelines(f"{key} = {value}\n" for key, value in settings.items())
        self._may_run = True
        # -w: pg_ctl returns once the server accepts connections, or fails after -t seconds.
        self._run(
            "pg_ctl", "start", "-D", str(self.data), "-l", str(self.log), "-w", "-t", str(_START_TIMEOUT_S),
            timeout=_START_TIMEOUT_S + 10,
        )  # fmt: skip
        for name in databases:
            self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", SUPERUSER, name, server_side=False)

    def close(self) -> None:
        if self._may_run:
            try:
                self._run("pg_ctl", "stop", "-D", str(self.data), "-m", "immediate", "-w", "-t", "10", timeout=20)
            except (RuntimeError, subprocess.TimeoutExpired):
                self._kill_postmaster()
            self._may_run = False
        shutil.rmtree(self.dir, ignore_errors=True)

    def _kill_postmaster(self) -> None:
        """SIGKILL the postmaster named in postmaster.pid (its backends exit when it is gone)."""
        try:
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
            os.kill(pid, 9)
        except (OSError, ValueError, IndexError):
            return
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)
