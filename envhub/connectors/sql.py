"""Read-only SQL connectors: SQLite (embedded) and PostgreSQL (psycopg).

SQLite guards, layered because ``mode=ro`` alone is not read-only (ATTACH and VACUUM INTO
write new files; temp tables are writable):
1. ``file:...?mode=ro`` URI and extension loading disabled;
2. ``SQLITE_LIMIT_ATTACHED = 0`` (ATTACH and VACUUM INTO fail);
3. ``PRAGMA query_only = 1``;
4. an authorizer allowing only SELECT/READ/FUNCTION/RECURSIVE and a short list of
   read-only introspection PRAGMAs (``load_extension`` is denied by name);
5. a progress handler that interrupts a statement past its deadline;
6. one statement per call, rows and rendered bytes capped: ``SQLITE_LIMIT_LENGTH`` (a small
   multiple of ``max_bytes``) refuses huge values (``zeroblob(50000000)``) before they are
   built, rows are fetched only until they exceed the cap, and each cell is cut before it is
   rendered.

PostgreSQL guards: extended query protocol (one statement per call), a first-keyword
allowlist, ``BEGIN READ ONLY`` with ``SET LOCAL statement_timeout`` and a snapshot taken
before the user statement (so ``SET TRANSACTION READ WRITE`` is too late), rollback after
every call, a client-side deadline over the whole call (psycopg cancels the statement with
``cancel_safe``; the connection is then replaced), refusal to run as a superuser unless
configured (a superuser can read server files even in a read-only transaction). The one
connection is opened, used and replaced only under the lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
import sqlite3
import threading
import time
import urllib.request
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from core.errors import ToolError
from envhub.config import SqlConfig

_READ_PRAGMAS = frozenset({"table_info", "table_xinfo", "table_list", "index_list", "index_info", "foreign_key_list"})
_FIRST_WORD = re.compile(r"^\s*(?:--[^\n]*\n\s*|/\*.*?\*/\s*)*([A-Za-z]+)", re.DOTALL)
_PG_ALLOWED_FIRST = frozenset({"select", "with", "values", "table", "explain", "show"})


def _cell(value: Any, limit: int) -> str:
    """``value`` as text, at most ``limit`` characters (only a prefix is ever converted)."""
    if value is None:
        return "NULL"
    if isinstance(value, str):
        return value[:limit]
    if isinstance(value, bytes | bytearray | memoryview):
        return str(bytes(value[:limit]))[:limit]  # the prefix's repr, never the whole blob's
    return str(value)[:limit]


def render_rows(columns: Sequence[str], rows: Iterable[Sequence[Any]], more: bool, max_bytes: int) -> str:
    """A tab-separated table with a header; truncated to ``max_bytes`` characters.

    Each cell is cut to the budget left before it is rendered and rendering stops once the
    budget is spent, so a huge cell or many rows never build more than ~``max_bytes`` of text.
    """
    parts: list[str] = []
    used = 0
    shown = 0
    for i, row in enumerate(itertools.chain([columns], rows)):
        for j, value in enumerate(row):
            if used > max_bytes:
                break
            piece = ("\n" if i and j == 0 else "\t" if j else "") + _cell(value, max_bytes - used + 1)
            parts.append(piece)
            used += len(piece)
        if used > max_bytes:
            return "".join(parts)[:max_bytes] + f"\n... (truncated at {max_bytes} characters)"
        shown = i
    note = f"\n... (more rows; showing the first {shown})" if more else ""
    return "".join(parts) + note


def first_keyword(sql: str) -> str:
    m = _FIRST_WORD.match(sql)
    return m.group(1).lower() if m else ""


class SqliteReadOnly:
    """A read-only view of one SQLite database file (one connection, calls serialised)."""

    def __init__(self, path: str | Path, config: SqlConfig | None = None) -> None:
        self.path = Path(path).resolve()
        if not self.path.is_file():
            raise ToolError(f"database {self.path} does not exist", kind="unavailable")
        self.config = config or SqlConfig()
        uri = f"file:{urllib.request.pathname2url(str(self.path))}?mode=ro"
        self._conn = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None)
        if hasattr(self._conn, "enable_load_extension"):  # absent when Python is built without it
            self._conn.enable_load_extension(False)
        self._conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
        # No string/blob (e.g. ``zeroblob(50000000)``) longer than a few result caps is ever
        # built, and a result row has boundedly many columns: one row is <= 256 x 4 x max_bytes.
        self._value_limit = max(4 * self.config.max_bytes, 4096)
        self._conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, self._value_limit)
        self._conn.setlimit(sqlite3.SQLITE_LIMIT_COLUMN, 256)
        self._conn.execute("PRAGMA query_only = 1")
        self._conn.set_authorizer(self._authorize)
        self._lock = threading.Lock()
        self._deadline = 0.0

    @staticmethod
    def _authorize(action: int, arg1: str | None, arg2: str | None, _db: str | None, _trigger: str | None) -> int:
        if action in (sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE):
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_FUNCTION:
            return sqlite3.SQLITE_DENY if (arg2 or "").lower() == "load_extension" else sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_PRAGMA and (arg1 or "").lower() in _READ_PRAGMAS:  # argument = a table name
            return sqlite3.SQLITE_OK
        return sqlite3.SQLITE_DENY

    def _progress(self) -> int:
        return 1 if time.monotonic() > self._deadline else 0

    def _run(self, sql: str) -> str:
        with self._lock:
            self._deadline = time.monotonic() + self.config.timeout_s
            self._conn.set_progress_handler(self._progress, 1000)
            try:
                cur = self._conn.execute(sql)
                columns = [d[0] for d in cur.description or ()]
                rows = self._fetch(cur)
                cur.close()
            except sqlite3.DataError as e:  # SQLITE_TOOBIG: a value over SQLITE_LIMIT_LENGTH
                raise ToolError(
                    f"query refused: a value is too large (over {self._value_limit} bytes): {e}", kind="refused"
                ) from e
            except sqlite3.OperationalError as e:
                if "interrupted" in str(e):
                    raise ToolError(f"query cancelled after {self.config.timeout_s:g} s", kind="timeout") from e
                raise ToolError(f"query refused: {e}", kind="refused") from e
            except sqlite3.DatabaseError as e:
                raise ToolError(f"query refused: {e}", kind="refused") from e
            except sqlite3.Warning as e:  # e.g. "You can only execute one statement at a time."
                raise ToolError(f"query refused: {e}", kind="refused") from e
            except sqlite3.ProgrammingError as e:
                raise ToolError(f"query refused: {e}", kind="refused") from e
            finally:
                self._conn.set_progress_handler(None, 0)
        more = len(rows) > self.config.max_rows
        return render_rows(columns, rows[: self.config.max_rows], more, self.config.max_bytes)

    def _fetch(self, cur: sqlite3.Cursor) -> list[Any]:
        """Up to ``max_rows + 1`` rows, stopping early once they exceed what can be shown."""
        rows: list[Any] = []
        size = 0
        while len(rows) <= self.config.max_rows and size <= self.config.max_bytes:
            row = cur.fetchone()
            if row is None:
                break
            rows.append(row)
            # a lower bound of the row's rendered length, so stopping here means render_rows truncates
            size += sum(len(v) if isinstance(v, str | bytes) else len(str(v)) for v in row) + len(row)
        return rows

    async def query(self, sql: str) -> str:
        """Run one read-only statement; ``ToolError`` if it is refused or cancelled."""
        return await asyncio.to_thread(self._run, sql)

    def schema(self) -> str:
        """``CREATE`` statements of the tables (for prompts)."""
        with self._lock:
            self._conn.set_authorizer(None)
            try:
                rows = self._conn.execute("SELECT sql FROM sqlite_schema WHERE type = 'table' ORDER BY name").fetchall()
            finally:
                self._conn.set_authorizer(self._authorize)
        return "\n".join(r[0] for r in rows if r[0])

    def close(self) -> None:
        self._conn.close()


class PostgresReadOnly:
    """Read-only statements against a PostgreSQL server (one connection, calls serialised).

    The lock guards the connection itself: opening it, every statement of a call and dropping
    it all happen under the lock, so concurrent callers never see a half-open or discarded
    connection and never open a second one. Every server round trip has a deadline.
    """

    def __init__(self, conninfo: str, config: SqlConfig | None = None) -> None:
        self.conninfo = conninfo
        self.config = config or SqlConfig()
        self._conn: Any = None
        self._lock = asyncio.Lock()

    async def connect(self) -> None:
        """Open the connection now (``query`` opens it when needed)."""
        async with self._lock:
            await self._connection()

    async def _connection(self) -> Any:
        """The open connection, opened first if needed; call with the lock held."""
        if self._conn is not None and not self._conn.closed:
            return self._conn
        import psycopg
        from psycopg.conninfo import conninfo_to_dict, make_conninfo

        # Read-only by default from the first statement on: set at startup, no extra round trip.
        options = str(conninfo_to_dict(self.conninfo).get("options") or "")
        conninfo = make_conninfo(self.conninfo, options=f"{options} -c default_transaction_read_only=on".strip())
        try:
            conn = await asyncio.wait_for(
                psycopg.AsyncConnection.connect(conninfo, autocommit=True), timeout=self.config.timeout_s + 5
            )
        except (psycopg.Error, TimeoutError) as e:
            raise ToolError(f"cannot connect to PostgreSQL: {e}", kind="unavailable") from e
        # The server reports is_superuser at startup (and on role changes): no query needed.
        if conn.info.parameter_status("is_superuser") != "off" and not self.config.allow_superuser:
            await conn.close()
            raise ToolError(
                "refusing to query as a PostgreSQL superuser (read-only transactions do not bind them); "
                "connect as a least-privilege role or set sql.allow_superuser",
                kind="refused",
            )
        self._conn = conn
        return conn

    async def _discard(self, conn: Any) -> None:
        """Drop a connection in an unknown state; the next call opens a new one (lock held)."""
        if self._conn is conn:
            self._conn = None
        with contextlib.suppress(Exception):
            await asyncio.wait_for(conn.close(), timeout=2)

    async def query(self, sql: str) -> str:
        import psycopg

        word = first_keyword(sql)
        if word not in _PG_ALLOWED_FIRST:
            raise ToolError(f"query refused: only read statements are allowed, got {word.upper() or 'nothing'!r}")
        timeout_ms = int(self.config.timeout_s * 1000)
        async with self._lock:
            conn = await self._connection()
            try:
                # The whole call is under the client-side deadline (a hung server or network
                # cannot stall it); statement_timeout normally fires first, on the server.
                async with asyncio.timeout(self.config.timeout_s + 1):
                    await conn.execute("BEGIN READ ONLY")
                    await conn.execute(f"SET LOCAL statement_timeout = {timeout_ms}")
                    await conn.execute("SELECT 1")  # takes the snapshot: the access mode is now fixed
                    cur = conn.cursor()
                    # binary=True forces the extended protocol: exactly one statement per call.
                    await cur.execute(sql, binary=True)
                    columns = [d.name for d in cur.description or ()]
                    rows = await cur.fetchmany(self.config.max_rows + 1) if cur.description else []
            except psycopg.errors.QueryCanceled as e:
                await self._end(conn)
                raise ToolError(f"query cancelled after {self.config.timeout_s:g} s", kind="timeout") from e
            except TimeoutError as e:
                # psycopg cancels the interrupted statement itself (cancel_safe, non-blocking);
                # the connection's state is unknown afterwards, so it is replaced.
                await self._discard(conn)
                raise ToolError(f"query cancelled after {self.config.timeout_s:g} s", kind="timeout") from e
            except psycopg.Error as e:
                if conn.closed or conn.broken:
                    await self._discard(conn)
                    raise ToolError(f"PostgreSQL connection lost: {str(e).strip()}", kind="unavailable") from e
                await self._end(conn)
                raise ToolError(f"query refused: {str(e).strip()}", kind="refused") from e
            except BaseException:
                await self._discard(conn)  # cancelled by the caller mid-call
                raise
            await self._end(conn)
        more = len(rows) > self.config.max_rows
        return render_rows(columns, rows[: self.config.max_rows], more, self.config.max_bytes)

    async def _end(self, conn: Any) -> None:
        """Roll the call's transaction back; a connection that cannot is replaced (lock held)."""
        import psycopg

        try:
            await asyncio.wait_for(conn.execute("ROLLBACK"), timeout=self.config.timeout_s + 1)
        except (psycopg.Error, TimeoutError):
            await self._discard(conn)

    async def close(self) -> None:
        async with self._lock:
            if self._conn is not None:
                await self._discard(self._conn)
