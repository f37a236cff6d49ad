"""``db_url``: a fresh verifier log database per test, SQLite or the session's private PostgreSQL."""

from __future__ import annotations

import itertools
from pathlib import Path

import psycopg
import pytest

from tests.integration.postgres_proc import PrivatePostgres

_counter = itertools.count()


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'log.sqlite3'}"
    pg: PrivatePostgres = request.getfixturevalue("postgres_server")
    name = f"vlog{next(_counter)}"
    with psycopg.connect(pg.dsn("postgres"), autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    return f"postgresql://postgres@127.0.0.1:{pg.port}/{name}"
