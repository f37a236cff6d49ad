"""PostgreSQL connector against the local server (acceptance point 2, PostgreSQL half).

Uses 127.0.0.1:5432 (trust auth, database ``test``); creates a uniquely named schema and a
least-privilege login role, and drops both afterwards.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import pytest

from envhub.config import SqlConfig
from envhub.connectors.sql import PostgresReadOnly
from server.errors import ToolError

psycopg = pytest.importorskip("psycopg")
ADMIN_DSN = "host=127.0.0.1 port=5432 dbname=test connect_timeout=3"


@pytest.fixture(scope="module")
async def pg() -> AsyncIterator[tuple[str, str, str]]:
    """(reader DSN, schema, admin DSN) with a table ``<schema>.items`` of 3 rows."""
    try:
        admin = await psycopg.AsyncConnection.connect(ADMIN_DSN, autocommit=True)
    except psycopg.OperationalError as e:
        pytest.skip(f"no PostgreSQL at 127.0.0.1:5432: {e}")
    tag = f"envhub_{uuid.uuid4().hex[:10]}"
    schema, role = tag, f"{tag}_ro"
    await admin.execute(f"CREATE SCHEMA {schema}")
    await admin.execute(f"CREATE TABLE {schema}.items (id int PRIMARY KEY, name text)")
    await admin.execute(f"INSERT INTO {schema}.items VALUES (1, 'apple'), (2, 'pear'), (3, 'plum')")
    await admin.execute(f"CREATE ROLE {role} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE")
    await admin.execute(f"GRANT USAGE ON SCHEMA {schema} TO {role}")
    await admin.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.items TO {role}")  # the guard, not grants
    try:
        yield f"{ADMIN_DSN} user={role}", schema, ADMIN_DSN
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
        row = await cur.fetchone()
    if not (row and row[0]):
        pytest.skip("the default PostgreSQL user is not a superuser here")
    conn = PostgresReadOnly(admin_dsn)
    with pytest.raises(ToolError, match="superuser"):
        await conn.query("SELECT 1")
    conn = PostgresReadOnly(admin_dsn, SqlConfig(allow_superuser=True))
    assert (await conn.query("SELECT 1 AS one")).splitlines() == ["one", "1"]
    with pytest.raises(ToolError):
        await conn.query("CREATE TABLE envhub_should_not_exist (a int)")
    await conn.close()
