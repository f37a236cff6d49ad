"""Read-only SQL connectors: SQLite (embedded) and PostgreSQL (psycopg).

SQLite guards, layered because ``mode=ro`` alone is not read-only (ATTACH and VACUUM INTO
write new files; temp tables are writable):
1. ``file:...?mode=ro`` URI and extension loading disabled;
2. ``SQLITE_LIMIT_ATTACHED = 0`` (ATTACH and VACUUM INTO fail);
3. ``PRAGMA query_only = 1``;
4. an authorizer allowing only SELECT/READ/FUNCTION/RECURSIVE and a short list of
   read-only introspection PRAGMAs (``load_extension`` is denied by name);
5. a progress handler that interrupts a statement past its deadline;
6. one statement per call, rows and rendered bytes capped.

PostgreSQL guards: extended query protocol (one statement per call), a first-keyword
allowlist, ``BEGIN READ ONLY`` with ``SET LOCAL statement_timeout`` and a snapshot taken
before the user statement (so ``SET TRANSACTION READ WRITE`` is too late), rollback after
every call, a client-side deadline that cancels the query, refusal to run as a superuser
unless configured (a superuser can read server files even in a read-only transaction).
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from envhub.config import SqlConfig
from server.errors import ToolError

_READ_PRAGMAS = frozenset({"table_info", "table_xinfo", "table_list", "index_list", "index_info", "foreign_key_list"})
_FIRST_WORD = re.compile(r"^\s*(?:--[^\n]*\n\s*|/\*.*?\*/\s*)*([A-Za-z]+)", re.DOTALL)
_PG_ALLOWED_FIRST = frozenset({"select", "with", "values", "table", "explain", "show"})


def render_rows(columns: Sequence[str], rows: Sequence[Sequence[Any]], more: bool, max_bytes: int) -> str:
    """A tab-separated table with a header; truncated to ``max_bytes`` characters."""
    lines = ["\t".join(columns)]
    lines += ["\t".join("NULL" if v is None else str(v) for v in row) for row in rows]
    text = "\n".join(lines)
    note = ""
    if more:
        note = f"\n... (more rows; showing the first {len(rows)})"
    if len(text) > max_bytes:
        text = text[:max_bytes]
        note = f"\n... (truncated at {max_bytes} characters)"
    return text + note


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
                rows = cur.fetchmany(self.config.max_rows + 1)
                cur.close()
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
    """Read-only statements against a PostgreSQL server (one connection, calls serialised)."""

    def __init__(self, conninfo: str, config: SqlConfig | None = None) -> None:
        self.conninfo = conninfo
        self.config = config or SqlConfig()
        self._conn: Any = None
        self._lock = asyncio.Lock()

    async def connect(self) -> None:
        import psycopg

        try:
            self._conn = await asyncio.wait_for(
                psycopg.AsyncConnection.connect(self.conninfo, autocommit=True), timeout=self.config.timeout_s + 5
            )
        except (psycopg.Error, TimeoutError) as e:
            raise ToolError(f"cannot connect to PostgreSQL: {e}", kind="unavailable") from e
        cur = await self._conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
        row = await cur.fetchone()
        if row and row[0] and not self.config.allow_superuser:
            await self._conn.close()
            self._conn = None
            raise ToolError(
                "refusing to query as a PostgreSQL superuser (read-only transactions do not bind them); "
                "connect as a least-privilege role or set sql.allow_superuser",
                kind="refused",
            )
        await self._conn.execute("SET default_transaction_read_only = on")

    async def query(self, sql: str) -> str:
        import psycopg

        if self._conn is None:
            await self.connect()
        word = first_keyword(sql)
        if word not in _PG_ALLOWED_FIRST:
            raise ToolError(f"query refused: only read statements are allowed, got {word.upper() or 'nothing'!r}")
        timeout_ms = int(self.config.timeout_s * 1000)
        async with self._lock:
            conn = self._conn
            try:
                await conn.execute("BEGIN READ ONLY")
                await conn.execute(f"SET LOCAL statement_timeout = {timeout_ms}")
                await conn.execute("SELECT 1")  # takes the snapshot: the access mode is now fixed
                cur = conn.cursor()
                # binary=True forces the extended protocol: exactly one statement per call.
                await asyncio.wait_for(cur.execute(sql, binary=True), timeout=self.config.timeout_s + 1)
                columns = [d.name for d in cur.description or ()]
                rows = await cur.fetchmany(self.config.max_rows + 1) if cur.description else []
            except psycopg.errors.QueryCanceled as e:
                raise ToolError(f"query cancelled after {self.config.timeout_s:g} s", kind="timeout") from e
            except TimeoutError as e:
                conn.cancel()
                raise ToolError(f"query cancelled after {self.config.timeout_s:g} s", kind="timeout") from e
            except psycopg.Error as e:
                raise ToolError(f"query refused: {str(e).strip()}", kind="refused") from e
            finally:
                try:
                    await conn.execute("ROLLBACK")
                except psycopg.Error:
                    await self._reconnect()
        more = len(rows) > self.config.max_rows
        return render_rows(columns, rows[: self.config.max_rows], more, self.config.max_bytes)

    async def _reconnect(self) -> None:
        try:
            await self._conn.close()
        finally:
            self._conn = None

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None
