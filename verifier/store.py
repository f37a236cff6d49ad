"""The log's database: SQLite (``sqlite:///PATH``) or PostgreSQL (``postgresql://...``), one schema.

Tables (prefixed ``verifier_`` so the log can share a database)::

    verifier_entries      idx (0, 1, 2 ... no gaps), leaf (the exact bytes hashed into the tree),
                          leaf_hash (RFC 6962, kept so opening a large log reads 32 bytes per entry),
                          keyid (the key that signed the envelope in the leaf)
    verifier_checkpoints  tree_size, note (the signed C2SP checkpoint issued after the batch)
    verifier_keys         keyid, public_key (raw 32 bytes), created_at: every key that ever signed

``append`` writes a batch of entries and its checkpoint in one transaction: a crash or an error leaves
the log as it was before the batch (nothing half-written). SQLite runs in WAL mode with
``synchronous=FULL``: a checkpoint is handed out only after its entries are durable.

The store is synchronous and used from one thread at a time (the log's writer thread).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from core.errors import FailedPrecondition
from verifier.keys import PublicKey


class LogCorrupted(FailedPrecondition):
    """The stored log contradicts itself or its own signed checkpoints (tampering or a lost write)."""


_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS verifier_entries (idx BIGINT PRIMARY KEY, leaf {blob} NOT NULL, "
    "leaf_hash {blob} NOT NULL, keyid TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS verifier_checkpoints (tree_size BIGINT PRIMARY KEY, note TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS verifier_keys (keyid TEXT PRIMARY KEY, public_key {blob} NOT NULL, "
    "created_at DOUBLE PRECISION NOT NULL)",
)


class LogStore:
    """Rows of the log in SQLite or PostgreSQL (``url`` picks)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._pg = url.startswith(("postgresql://", "postgres://"))
        self._conn: Any
        if self._pg:
            import psycopg

            self._conn = psycopg.connect(url, autocommit=True, connect_timeout=10)
        else:
            path = url.removeprefix("sqlite:///")
            if path != ":memory:":
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")
        with self._tx():
            for ddl in _SCHEMA:
                self._exec(ddl.format(blob="BYTEA" if self._pg else "BLOB"))

    @property
    def backend(self) -> str:
        return "postgresql" if self._pg else "sqlite"

    def _sql(self, sql: str) -> str:
        return sql.replace("?", "%s") if self._pg else sql

    def _exec(self, sql: str, params: Sequence[Any] = ()) -> Any:
        return self._conn.execute(self._sql(sql), params)

    @contextmanager
    def _tx(self) -> Iterator[None]:
        if self._pg:
            with self._conn.transaction():
                yield
            return
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    def leaf_hashes(self) -> list[bytes]:
        """Every leaf hash in index order; LogCorrupted if an index is missing."""
        rows = self._exec("SELECT idx, leaf_hash FROM verifier_entries ORDER BY idx").fetchall()
        for position, (idx, _) in enumerate(rows):
            if idx != position:
                raise LogCorrupted(f"the log has no entry {position} (next stored index is {idx})")
        return [bytes(h) for _, h in rows]

    def append(self, rows: Sequence[tuple[int, bytes, bytes, str]], checkpoint: tuple[int, str]) -> None:
        """Entries ``(idx, leaf, leaf_hash, keyid)`` and the checkpoint ``(tree_size, note)``, atomically."""
        with self._tx():
            cur = self._conn.cursor()
            cur.executemany(
                self._sql("INSERT INTO verifier_entries (idx, leaf, leaf_hash, keyid) VALUES (?, ?, ?, ?)"), rows
            )
            cur.execute(self._sql("INSERT INTO verifier_checkpoints (tree_size, note) VALUES (?, ?)"), checkpoint)

    def entry(self, idx: int) -> tuple[bytes, str] | None:
        row = self._exec("SELECT leaf, keyid FROM verifier_entries WHERE idx = ?", (idx,)).fetchone()
        return None if row is None else (bytes(row[0]), row[1])

    def entries(self) -> Iterator[tuple[int, bytes, str]]:
        for idx, leaf, keyid in self._exec("SELECT idx, leaf, keyid FROM verifier_entries ORDER BY idx"):
            yield idx, bytes(leaf), keyid

    def checkpoints(self) -> list[tuple[int, str]]:
        rows = self._exec("SELECT tree_size, note FROM verifier_checkpoints ORDER BY tree_size").fetchall()
        return [(int(size), note) for size, note in rows]

    def latest_checkpoint(self) -> tuple[int, str] | None:
        sql = "SELECT tree_size, note FROM verifier_checkpoints ORDER BY tree_size DESC LIMIT 1"
        row = self._exec(sql).fetchone()
        return None if row is None else (int(row[0]), row[1])

    def add_keys(self, keys: Sequence[PublicKey]) -> None:
        with self._tx():
            for k in keys:
                self._exec(
                    "INSERT INTO verifier_keys (keyid, public_key, created_at) VALUES (?, ?, ?) "
                    "ON CONFLICT (keyid) DO NOTHING",
                    (k.keyid, k.public_key, k.created_at),
                )

    def public_keys(self) -> list[PublicKey]:
        rows = self._exec("SELECT keyid, public_key, created_at FROM verifier_keys ORDER BY created_at, keyid")
        return [PublicKey(keyid, bytes(raw), float(created)) for keyid, raw, created in rows.fetchall()]

    def close(self) -> None:
        self._conn.close()
