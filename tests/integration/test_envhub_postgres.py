"""PostgreSQL connector against a real server (acceptance point 2, PostgreSQL half).

Uses the session's private cluster (``postgres_server``: its own free port on 127.0.0.1, trust
auth, database ``test``, superuser ``postgres``), never a shared server; creates a uniquely
named schema and a least-privilege login role, and drops both afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import time
import uuid
import warnings
from collections.abc import AsyncIterator

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from core.errors import ToolError
from envhub.config import SqlConfig
from envhub.connectors.sql import PostgresReadOnly
from tests.integration.postgres_proc import PrivatePostgres


@pytest.fixture(scope="module")
async def pg(postgres_server: PrivatePostgres) -> AsyncIterator[tuple[str, str, str]]:
    """(reader DSN, schema, admin DSN) with a table ``<schema>.items`` of 3 rows."""
    admin_dsn = postgres_server.dsn("test")
    admin = await psycopg.AsyncConnection.connect(admin_dsn, autocommit=True)
    tag = f"envhub_{uuid.uuid4().hex[:10]}"
    schema, role = tag, f"{tag}_ro"
    await admin.execute(f"CREATE SCHEMA {schema}")
    await admin.execute(f"CREATE TABLE {schema}.items (id int PRIMARY KEY, name text)")
    await admin.execute(f"INSERT INTO {schema}.items VALUES (1, 'apple'), (2, 'pear'), (3, 'plum')")
    await admin.execute(f"CREATE ROLE {role} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE")
    await admin.execute(f"GRANT USAGE ON SCHEMA {schema} TO {role}")
    await admin.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.items TO {role}")  # the guard, not grants
    try:
        yield postgres_server.dsn("test", user=role), schema, admin_dsn
    finally:
        await admin.execute(f"DROP SCHEMA {schema} CASCADE")
        await admin.execute(f"DROP OWNED BY {role}")
        await admin.execute(f"DROP ROLE {role}")
        await admin.close()


async def test_reads_work(pg: tuple[str, str, str]) -> None:
    dsn, schema, _ = pg
    conn = PostgresReadOnly(dsn, SqlConfig(max_rows=2))
    out = await conn.query(f"SELECT id, name FROM {schema}.items ORDER BY id")
    assert out.splitlines()[:3] == ["id\tname", "1\tapple", "2\tpear"] and "more rows" in out
    await conn.close()


@pytest.mark.parametrize(
    "sql",
    [
        "INSERT INTO {s}.items VALUES (9, 'kiwi')",
        "UPDATE {s}.items SET name = 'x'",
        "DELETE FROM {s}.items",
        "DROP TABLE {s}.items",
        "CREATE TABLE {s}.evil (a int)",
        "WITH d AS (DELETE FROM {s}.items RETURNING *) SELECT count(*) FROM d",
        "SELECT 1; DELETE FROM {s}.items",
        "COMMIT",
        "SET TRANSACTION READ WRITE",
        "SET default_transaction_read_only = off",
        "/* hi */ TRUNCATE {s}.items",
        "COPY {s}.items TO STDOUT",
        "SELECT set_config('transaction_read_only', 'off', true)",  # too late: the snapshot is taken
        "SELECT lo_import('/etc/hostname')",
        "SELECT nextval('pg_catalog.pg_class')",
    ],
)
async def test_writes_are_refused(pg: tuple[str, str, str], sql: str) -> None:
    dsn, schema, admin_dsn = pg
    conn = PostgresReadOnly(dsn)
    with pytest.raises(ToolError) as err:
        await conn.query(sql.format(s=schema))
    assert err.value.kind == "refused"
    # Nothing changed, and the same connection still reads.
    assert (await conn.query(f"SELECT count(*) FROM {schema}.items")).splitlines()[1] == "3"
    await conn.close()
    async with await psycopg.AsyncConnection.connect(admin_dsn) as admin:
        cur = await admin.execute(f"SELECT string_agg(name, ',' ORDER BY id) FROM {schema}.items")
        assert (await cur.fetchone()) == ("apple,pear,plum",)


async def test_long_statement_is_cancelled(pg: tuple[str, str, str]) -> None:
    dsn, _, _ = pg
    conn = PostgresReadOnly(dsn, SqlConfig(timeout_s=0.3))
    t0 = time.monotonic()
    with pytest.raises(ToolError) as err:
        await conn.query("SELECT pg_sleep(10)")
    assert err.value.kind == "timeout" and time.monotonic() - t0 < 3
    with pytest.raises(ToolError) as err:
        await conn.query("WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT count(*) FROM r")
    assert err.value.kind == "timeout"
    assert (await conn.query("SELECT 7 AS x")).splitlines() == ["x", "7"]
    await conn.close()


async def test_timeout_cannot_be_switched_off(pg: tuple[str, str, str]) -> None:
    dsn, _, _ = pg
    conn = PostgresReadOnly(dsn, SqlConfig(timeout_s=0.3))
    await conn.query("SELECT set_config('statement_timeout', '0', false)")  # rolled back with the call
    with pytest.raises(ToolError) as err:
        await conn.query("SELECT pg_sleep(5)")
    assert err.value.kind == "timeout"
    await conn.close()


async def test_superuser_is_refused_unless_allowed(pg: tuple[str, str, str]) -> None:
    _, _, admin_dsn = pg
    async with await psycopg.AsyncConnection.connect(admin_dsn) as probe:
        cur = await probe.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
        assert (await cur.fetchone()) == (True,)  # the private cluster's admin is its superuser
    conn = PostgresReadOnly(admin_dsn)
    with pytest.raises(ToolError, match="superuser"):
        await conn.query("SELECT 1")
    conn = PostgresReadOnly(admin_dsn, SqlConfig(allow_superuser=True))
    assert (await conn.query("SELECT 1 AS one")).splitlines() == ["one", "1"]
    with pytest.raises(ToolError):
        await conn.query("CREATE TABLE envhub_should_not_exist (a int)")
    await conn.close()


async def _backends(admin_dsn: str, role: str) -> list[tuple[int, str, str]]:
    """(pid, state, query) of the sessions ``role`` has open."""
    async with await psycopg.AsyncConnection.connect(admin_dsn, autocommit=True) as admin:
        cur = await admin.execute("SELECT pid, state, query FROM pg_stat_activity WHERE usename = %s", (role,))
        return [(int(r[0]), str(r[1]), str(r[2])) for r in await cur.fetchall()]


async def _wait_for_backend(admin_dsn: str, role: str, query_prefix: str) -> int:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        for pid, state, query in await _backends(admin_dsn, role):
            if state == "active" and query.startswith(query_prefix):
                return pid
        await asyncio.sleep(0.02)
    raise AssertionError(f"no active backend of {role} running {query_prefix!r}")


async def test_concurrent_first_queries_open_one_connection(pg: tuple[str, str, str]) -> None:
    dsn, schema, admin_dsn = pg
    role = str(conninfo_to_dict(dsn)["user"])
    conn = PostgresReadOnly(dsn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = await asyncio.gather(*(conn.query(f"SELECT count(*) FROM {schema}.items") for _ in range(6)))
        gc.collect()
    assert [o.splitlines()[1] for o in outs] == ["3"] * 6
    # a connection opened by a racing caller and then dropped is reported by psycopg's __del__
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
    assert len(await _backends(admin_dsn, role)) == 1  # not one connection per racing caller
    await conn.close()
    assert await _backends(admin_dsn, role) == []


async def test_queries_queued_behind_a_dropped_connection_reconnect(pg: tuple[str, str, str]) -> None:
    """The backend of a running query is terminated while others wait on the lock: the victim
    gets a ToolError, the queued queries (one of them timing out server-side) run on a new
    connection, and exactly one connection is left."""
    dsn, schema, admin_dsn = pg
    role = str(conninfo_to_dict(dsn)["user"])
    conn = PostgresReadOnly(dsn, SqlConfig(timeout_s=1.0))

    async def kill_the_sleeper() -> None:
        pid = await _wait_for_backend(admin_dsn, role, "SELECT pg_sleep(30)")
        async with await psycopg.AsyncConnection.connect(admin_dsn, autocommit=True) as admin:
            await admin.execute("SELECT pg_terminate_backend(%s)", (pid,))

    victim = asyncio.ensure_future(conn.query("SELECT pg_sleep(30)"))
    await asyncio.sleep(0)  # the victim takes the lock first
    count = f"SELECT count(*) FROM {schema}.items"
    results = await asyncio.gather(
        victim,
        conn.query(count),
        conn.query("SELECT pg_sleep(5)"),  # cancelled by statement_timeout
        conn.query(count),
        conn.query("SELECT 7 AS x"),
        kill_the_sleeper(),
        return_exceptions=True,
    )
    assert isinstance(results[1], str) and results[1].splitlines()[1] == "3", repr(results[1])
    assert isinstance(results[2], ToolError) and results[2].kind == "timeout", repr(results[2])
    assert isinstance(results[3], str) and results[3].splitlines()[1] == "3", repr(results[3])
    assert isinstance(results[4], str) and results[4].splitlines() == ["x", "7"], repr(results[4])
    assert isinstance(results[0], ToolError) and results[0].kind == "unavailable", repr(results[0])
    assert len(await _backends(admin_dsn, role)) == 1
    await conn.close()


@pytest.mark.slow
async def test_client_deadline_cancels_and_reconnects(pg: tuple[str, str, str]) -> None:
    """A backend that stops answering (SIGSTOPped, so statement_timeout cannot fire) hits the
    client-side deadline: a timeout ToolError, the event loop stays responsive, and the next
    query gets a fresh connection."""
    dsn, schema, admin_dsn = pg
    role = str(conninfo_to_dict(dsn)["user"])
    conn = PostgresReadOnly(dsn, SqlConfig(timeout_s=0.5))
    assert (await conn.query("SELECT 1 AS one")).splitlines() == ["one", "1"]
    # The private server runs as this user, or as `postgres` under root: either way it can be signalled.
    (pid, _, _), *_ = await _backends(admin_dsn, role)
    gaps: list[float] = []

    async def ticker() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.05)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    tick = asyncio.ensure_future(ticker())
    # A detached safety net resumes the backend even if this process dies mid-test.
    guard = await asyncio.create_subprocess_exec(
        "sh", "-c", f"sleep 20; kill -CONT {pid} 2>/dev/null", start_new_session=True
    )
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(ToolError) as err:
            await asyncio.wait_for(conn.query("SELECT 1"), timeout=15)  # TimeoutError here = the bug
        elapsed = time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
        tick.cancel()
        with contextlib.suppress(ProcessLookupError):  # gone already if it fired
            os.killpg(guard.pid, signal.SIGKILL)  # its own session: the sleep goes too
        await guard.wait()
    assert err.value.kind == "timeout" and elapsed < 10, elapsed
    assert max(gaps) < 0.5, max(gaps)
    assert (await conn.query(f"SELECT count(*) FROM {schema}.items")).splitlines()[1] == "3"
    backends = await _backends(admin_dsn, role)
    assert len(backends) == 1 and backends[0][0] != pid
    await conn.close()
