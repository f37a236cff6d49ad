"""The verdict log on a real database, SQLite and a private PostgreSQL (``postgres_server``), same tests.

Tampering is done the way an attacker with database access would (SQL on the stored rows); detection
is by the offline ``verify`` functions a client runs with what it kept (a receipt, a signed checkpoint)
and the public keys, and by the log itself when it reopens.
"""

from __future__ import annotations

import base64
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest

from core.errors import NotFound
from tests.integration.verifier_db import db_url
from verifier.keys import KeyRing
from verifier.log import TransparencyLog
from verifier.statement import Verdict
from verifier.store import LogCorrupted, LogStore
from verifier.verify import VerificationError, audit, parse_keys, verify_consistency, verify_entry

ORIGIN = "test.local/verifier"

__all__ = ["db_url"]  # the fixture, parametrized over SQLite and PostgreSQL

OpenLog = Callable[..., TransparencyLog]


def statement(i: int) -> dict[str, Any]:
    return Verdict(
        subject_digest=f"{i:064x}",
        episode_id=f"ep-{i}",
        grader="constant",
        grader_version="1",
        reward=float(i),
        params={"value": i},
        policy_version=1,
        started_at="2026-01-01T00:00:00+00:00",
        grade_seconds=0.0,
    ).statement()


@pytest.fixture
def open_log(db_url: str, tmp_path: Path) -> Iterator[OpenLog]:
    opened: list[LogStore] = []

    def _open(url: str = db_url, keys: Path = tmp_path / "keys") -> TransparencyLog:
        store = LogStore(url)
        opened.append(store)
        return TransparencyLog(store, KeyRing.open(keys), ORIGIN)

    yield _open
    for s in opened:
        s.close()


@contextmanager
def attacker(url: str) -> Iterator[Callable[..., None]]:
    """A connection of its own to the log's database, running statements behind the log's back."""
    if url.startswith("sqlite"):
        conn = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        try:
            yield lambda q, p=(): conn.execute(q, p) and None
        finally:
            conn.close()
        return
    with psycopg.connect(url, autocommit=True) as pg:
        yield lambda q, p=(): pg.execute(q.replace("?", "%s"), p) and None


def sql(url: str, query: str, params: tuple[Any, ...] = ()) -> None:
    with attacker(url) as run:
        run(query, params)


def keys_of(log: TransparencyLog) -> list[Any]:
    return parse_keys(log.key_list())


def inclusion(log: TransparencyLog, index: int, size: int) -> dict[str, Any]:
    return {"index": index, "tree_size": size, "hashes": log.inclusion_proof(index, size)}


def test_entries_verify_offline_and_the_log_survives_a_restart(open_log: OpenLog) -> None:
    log = open_log()
    receipts = log.append([statement(i) for i in range(5)]) + log.append([statement(i) for i in range(5, 7)])
    note = log.checkpoint()["note"]
    for r in receipts:
        got = verify_entry(r.to_json(), inclusion(log, r.log_index, 7), note, keys_of(log), ORIGIN)
        assert got.statement["predicate"]["reward"] == float(r.log_index)
    log.store.close()
    again = open_log()
    assert again.size == 7 and again.checkpoint()["note"] == note
    assert again.entry(3)["envelope"] == receipts[3].envelope
    assert audit(again.store, ORIGIN) == 7


def test_flipping_any_byte_of_a_stored_entry_is_detected(open_log: OpenLog, db_url: str) -> None:
    log = open_log()
    log.append([statement(i) for i in range(8)])
    saved_note, keys = log.checkpoint()["note"], keys_of(log)
    leaf = base64.b64decode(log.entry(5)["leaf"])
    with attacker(db_url) as run:
        for pos in range(len(leaf)):
            tampered = bytearray(leaf)
            tampered[pos] ^= 0x01
            run("UPDATE verifier_entries SET leaf = ? WHERE idx = 5", (bytes(tampered),))
            served = {"leaf": base64.b64encode(log.store.entry(5)[0]).decode()}  # type: ignore[index]
            proof = {"index": 5, "tree_size": 8, "hashes": _proof_from_rows(log.store, 5, 8)}
            with pytest.raises(VerificationError):
                verify_entry(served, proof, saved_note, keys)
            with pytest.raises(VerificationError):
                audit(log.store, ORIGIN)


def _proof_from_rows(store: LogStore, index: int, size: int) -> list[str]:
    """The inclusion proof a server recomputing its tree from the stored leaves would hand out."""
    from verifier.merkle import MerkleTree, leaf_hash

    tree = MerkleTree([leaf_hash(leaf) for _, leaf, _ in store.entries()])
    return [base64.b64encode(h).decode() for h in tree.inclusion_proof(index, size)]


def test_reordering_two_entries_is_detected(open_log: OpenLog, db_url: str) -> None:
    log = open_log()
    receipts = log.append([statement(i) for i in range(6)])
    saved_note, keys = log.checkpoint()["note"], keys_of(log)
    log.store.close()
    a, b = receipts[1], receipts[4]
    for idx, r in ((1, b), (4, a)):  # swap the rows (leaf, its hash and signer together)
        sql(db_url, "UPDATE verifier_entries SET leaf = ?, leaf_hash = ? WHERE idx = ?", (_leaf(r), r.leaf_hash, idx))
    with pytest.raises(LogCorrupted, match="do not hash to the signed root"):
        open_log()
    store = LogStore(db_url)
    try:
        entry_at_1 = {"leaf": base64.b64encode(_leaf(b)).decode(), "log_index": 1}
        with pytest.raises(VerificationError):
            verify_entry(entry_at_1, {"index": 1, "hashes": _proof_from_rows(store, 1, 6)}, saved_note, keys)
        with pytest.raises(VerificationError, match="does not match the stored entries"):
            audit(store, ORIGIN)
    finally:
        store.close()


def _leaf(receipt: Any) -> bytes:
    from core.canonical import canonical_json

    return canonical_json(receipt.envelope)


def test_truncating_the_log_is_detected(open_log: OpenLog, db_url: str) -> None:
    log = open_log()
    log.append([statement(i) for i in range(4)])
    old_note, keys = log.checkpoint()["note"], keys_of(log)
    receipt = log.append([statement(i) for i in range(4, 9)])[-1]
    kept_note = log.checkpoint()["note"]  # a client kept the size-9 checkpoint and its receipt for entry 8
    log.store.close()
    sql(db_url, "DELETE FROM verifier_entries WHERE idx >= 4")
    with pytest.raises(LogCorrupted, match="covers 9 entries; the database holds 4"):
        open_log()
    # the attacker also drops the later checkpoints and lets the log grow back to 9 other entries
    sql(db_url, "DELETE FROM verifier_checkpoints WHERE tree_size > 4")
    regrown = open_log()
    regrown.append([statement(100 + i) for i in range(5)])
    new_note = regrown.checkpoint()["note"]
    with pytest.raises(VerificationError):
        verify_entry(receipt.to_json(), inclusion(regrown, 8, 9), new_note, keys)
    with pytest.raises(VerificationError, match="two different roots"):
        verify_consistency(kept_note, new_note, {"hashes": regrown.consistency_proof(9, 9)}, keys)
    # the size-4 checkpoint is still consistent with it: only what came after was rewritten
    verify_consistency(old_note, new_note, {"hashes": regrown.consistency_proof(4, 9)}, keys)


def test_a_checkpoint_from_a_forked_log_is_detected(open_log: OpenLog, tmp_path: Path) -> None:
    main = open_log()
    main.append([statement(i) for i in range(5)])
    trusted_note = main.checkpoint()["note"]
    receipt = main.append([statement(i) for i in range(5, 8)])[1]  # log index 6
    # same key and origin, same first 5 entries, then different ones: a split view
    fork = open_log(url=f"sqlite:///{tmp_path / 'fork.sqlite3'}")
    fork.append([statement(i) for i in range(5)])
    fork.append([statement(i) for i in range(50, 53)])
    fork_note, keys = fork.checkpoint()["note"], keys_of(main)
    assert main.checkpoint()["tree_size"] == fork.checkpoint()["tree_size"] == 8
    with pytest.raises(VerificationError, match="two different roots"):
        verify_consistency(main.checkpoint()["note"], fork_note, {"hashes": []}, keys)
    with pytest.raises(VerificationError):
        verify_entry(receipt.to_json(), inclusion(fork, 6, 8), fork_note, keys)
    with pytest.raises(VerificationError):
        verify_consistency(trusted_note, fork_note, {"hashes": main.consistency_proof(5, 8)}, keys)
    # the fork shares the first 5 entries, so it does extend the size-5 checkpoint: the split shows at size 8
    verify_consistency(trusted_note, fork_note, {"hashes": fork.consistency_proof(5, 8)}, keys)


def test_a_failed_append_writes_nothing(open_log: OpenLog, db_url: str) -> None:
    log = open_log()
    log.append([statement(i) for i in range(3)])
    before = log.checkpoint()
    sql(db_url, "INSERT INTO verifier_checkpoints (tree_size, note) VALUES (?, ?)", (5, "squatter"))
    with pytest.raises((sqlite3.IntegrityError, psycopg.errors.UniqueViolation)):
        log.append([statement(3), statement(4)])  # its checkpoint row collides: the transaction rolls back
    assert log.size == 3 and log.tree.size == 3 and log.checkpoint() == before
    sql(db_url, "DELETE FROM verifier_checkpoints WHERE tree_size = 5")
    log.store.close()
    again = open_log()
    assert again.size == 3 and again.entry(2)["envelope"] is not None
    with pytest.raises(NotFound, match="no entry 3"):
        again.entry(3)


def test_key_rotation_keeps_old_entries_verifiable(open_log: OpenLog, tmp_path: Path) -> None:
    log = open_log()
    old = log.append([statement(0)])[0]
    first_key = log.keyring.active.public.keyid
    new_key = log.rotate_key()
    new = log.append([statement(1)])[0]
    assert old.envelope["signatures"][0]["keyid"] == first_key != new.envelope["signatures"][0]["keyid"]
    (tmp_path / "keys" / f"{first_key}.pem").unlink()  # the old private key is gone for good
    log.store.close()
    again = open_log()
    listed = again.key_list()["keys"]
    assert {k["keyid"] for k in listed} == {first_key, new_key.keyid}
    assert [k["active"] for k in listed if k["keyid"] == new_key.keyid] == [True]
    note, keys = again.checkpoint()["note"], parse_keys(again.key_list())
    for r in (old, new):
        verify_entry(r.to_json(), inclusion(again, r.log_index, 2), note, keys, ORIGIN)
    with pytest.raises(VerificationError, match="no signature by a known key"):
        only_new = [k for k in keys if k.keyid == new_key.keyid]
        verify_entry(old.to_json(), inclusion(again, 0, 2), note, only_new)


def test_cli_audit_and_rotate_key(open_log: OpenLog, db_url: str, tmp_path: Path) -> None:
    from server.cli import main

    log = open_log()
    first = log.keyring.active.public.keyid
    log.append([statement(i) for i in range(3)])
    audit_argv = ["verifier", "audit", "--database-url", db_url, "--origin", ORIGIN]
    assert main(audit_argv) == 0
    assert main(["verifier", "rotate-key", "--key-dir", str(tmp_path / "keys")]) == 0
    log.store.close()
    rotated = open_log()
    assert rotated.keyring.active.public.keyid != first
    rotated.append([statement(3)])
    assert main(audit_argv) == 0  # entries of both keys verify
    sql(db_url, "UPDATE verifier_entries SET keyid = ? WHERE idx = 0", (rotated.keyring.active.public.keyid,))
    assert main(audit_argv) == 1  # the row now claims the wrong signer
