"""SQLite connector: truly read-only (acceptance point 2, SQLite half)."""

from __future__ import annotations

import hashlib
import os
import resource
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.errors import ToolError
from envhub.config import SqlConfig
from envhub.connectors.sql import SqliteReadOnly, first_keyword, render_rows
from envhub.envs._data import BUNDLED_DB


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def db(tmp_path: Path) -> Iterator[SqliteReadOnly]:
    copy = tmp_path / "company.sqlite"
    shutil.copy(BUNDLED_DB, copy)
    conn = SqliteReadOnly(copy, SqlConfig(timeout_s=0.3, max_rows=5, max_bytes=2000))
    yield conn
    conn.close()


async def test_select_works_and_is_capped(db: SqliteReadOnly) -> None:
    out = await db.query("SELECT name, salary FROM employees ORDER BY id")
    lines = out.splitlines()
    assert lines[0] == "name\tsalary"
    assert lines[1] == "Ada Lovelace\t9100"
    assert len(lines) == 1 + 5 + 1 and "more rows" in lines[-1]  # max_rows = 5
    assert "employees" in db.schema()
    assert "department_id" in await db.query("PRAGMA table_info(employees)")


@pytest.mark.parametrize(
    "sql",
    [
        "INSERT INTO employees VALUES (99, 'Eve', 1, 1, '2024-01-01')",
        "UPDATE employees SET salary = 0",
        "DELETE FROM employees",
        "DROP TABLE employees",
        "CREATE TABLE x (a)",
        "CREATE TEMP TABLE t (a)",
        "CREATE TEMP VIEW v AS SELECT 1",
        "ATTACH DATABASE '{tmp}/attached.db' AS x",
        "VACUUM INTO '{tmp}/copy.db'",
        "VACUUM",
        "PRAGMA query_only = 0",
        "PRAGMA journal_mode = WAL",
        "PRAGMA writable_schema = 1",
        "PRAGMA user_version = 7",
        "SELECT load_extension('/usr/lib/x86_64-linux-gnu/libsqlite3.so.0')",
        "REINDEX",
        "SELECT 1; DELETE FROM employees",
    ],
)
async def test_writes_and_escapes_are_refused(db: SqliteReadOnly, tmp_path: Path, sql: str) -> None:
    before = _digest(db.path)
    with pytest.raises(ToolError) as err:
        await db.query(sql.format(tmp=tmp_path))
    assert err.value.kind == "refused"
    assert "refused" in err.value.message
    assert _digest(db.path) == before
    assert os.listdir(tmp_path) == ["company.sqlite"]  # ATTACH/VACUUM INTO wrote nothing
    assert (await db.query("SELECT count(*) FROM employees")).splitlines()[1] == "10"


async def test_runaway_recursive_cte_is_cancelled(db: SqliteReadOnly) -> None:
    with pytest.raises(ToolError) as err:
        await db.query("WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT count(*) FROM r")
    assert err.value.kind == "timeout"
    # The connection is still usable and the deadline resets per statement.
    assert (await db.query("SELECT 42 AS x")).splitlines() == ["x", "42"]


async def test_bounded_recursive_cte_is_allowed(db: SqliteReadOnly) -> None:
    out = await db.query(
        "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r WHERE n < 100) SELECT sum(n) FROM r"
    )
    assert out.splitlines()[1] == "5050"


async def test_byte_cap(tmp_path: Path) -> None:
    shutil.copy(BUNDLED_DB, tmp_path / "c.sqlite")
    conn = SqliteReadOnly(tmp_path / "c.sqlite", SqlConfig(max_rows=1000, max_bytes=300))
    out = await conn.query(
        "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r WHERE n < 500) SELECT n FROM r"
    )
    conn.close()
    assert "truncated at 300 characters" in out and len(out) < 400


def test_missing_database_is_a_tool_error(tmp_path: Path) -> None:
    with pytest.raises(ToolError):
        SqliteReadOnly(tmp_path / "nope.sqlite")


def test_first_keyword_skips_comments() -> None:
    assert first_keyword("  -- hi\n /* x */ SELECT 1") == "select"
    assert first_keyword("/* a */ delete from t") == "delete"


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


async def test_huge_cells_are_refused_quickly_with_bounded_memory(db: SqliteReadOnly) -> None:
    """A model-written ``zeroblob`` query must neither materialise 100 MB nor overrun the deadline."""
    before = _peak_rss_mib()
    t0 = time.monotonic()
    with pytest.raises(ToolError) as err:
        await db.query("SELECT zeroblob(50000000), zeroblob(50000000)")
    elapsed = time.monotonic() - t0
    assert err.value.kind == "refused" and "too large" in str(err.value)
    assert elapsed < 1.0, elapsed  # well inside the deadline (timeout_s = 0.3 plus thread hop)
    assert _peak_rss_mib() - before < 64


async def test_wide_rows_are_truncated_per_cell_and_in_total(db: SqliteReadOnly) -> None:
    # Each cell is under SQLITE_LIMIT_LENGTH but the rows together are far over max_bytes (2000).
    out = await db.query("SELECT hex(zeroblob(3000)) AS a, hex(zeroblob(3000)) AS b FROM employees")
    assert len(out) <= 2000 + 60 and "truncated at 2000 characters" in out
    assert out.startswith("a\tb\n" + "0" * 100)


def test_render_rows_never_builds_more_than_the_cap() -> None:
    class Huge:
        """A cell whose full rendering would be enormous; only a prefix may be asked for."""

        def __str__(self) -> str:
            raise AssertionError("rendered the whole cell")

    big = "x" * 1_000_000
    out = render_rows(["a", "b"], [[big, b"\x00" * 1_000_000], [1, None]], False, 300)
    assert len(out) <= 300 + 60 and "truncated at 300 characters" in out
    # rows after the cap is reached are not rendered at all
    out = render_rows(["a"], [[big], [Huge()]], False, 300)
    assert "truncated at 300 characters" in out
