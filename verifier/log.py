"""The signed, append-only verdict log: DSSE entries in an RFC 6962 tree, a signed checkpoint per batch.

Opening a log replays its leaf hashes into an in-memory ``MerkleTree`` and checks the result against
the newest stored checkpoint (signature and root): a log whose rows were reordered, truncated or
rewritten after that checkpoint refuses to open (``LogCorrupted``). ``append`` signs each statement
with the active key, writes the entries and the new checkpoint in one transaction, and only then
makes them visible; a failed transaction leaves the tree and the database as they were.

Not thread-safe for writers: one thread appends (the service's writer thread). Readers may compute
proofs concurrently for tree sizes up to ``size`` (committed entries never change).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from core.canonical import canonical_json
from core.errors import InvalidArgument, NotFound
from verifier.keys import KeyRing, PublicKey
from verifier.merkle import MerkleTree, ProofError, leaf_hash
from verifier.signing import Checkpoint, SignatureError, open_checkpoint, sign_envelope
from verifier.store import LogCorrupted, LogStore


@dataclass(frozen=True, slots=True)
class Receipt:
    """Where a verdict landed: ``{"log_index", "leaf_hash", "envelope"}`` on the wire."""

    log_index: int
    leaf_hash: bytes
    envelope: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        h = base64.b64encode(self.leaf_hash).decode()
        return {"log_index": self.log_index, "leaf_hash": h, "envelope": self.envelope}


class TransparencyLog:
    """A verdict log over a ``LogStore``, signing with ``keys.active``."""

    def __init__(self, store: LogStore, keys: KeyRing, origin: str) -> None:
        self.store = store
        self.keyring = keys
        self.origin = origin
        store.add_keys([k.public for k in keys.keys.values()])
        self.keys: dict[str, PublicKey] = {k.keyid: k for k in store.public_keys()}
        self.tree = MerkleTree(store.leaf_hashes())
        self.size = self.tree.size
        latest = store.latest_checkpoint()
        if latest is None:
            if self.size:
                raise LogCorrupted(f"the log has {self.size} entries and no signed checkpoint")
            self.note = ""
            self.append([])  # the signed empty tree: GET /v1/log/checkpoint always has an answer
        else:
            self.note = latest[1]
            self._check(*latest)

    def _check(self, size: int, note: str) -> None:
        try:
            cp = open_checkpoint(note, self.keys.values(), self.origin)
        except SignatureError as exc:
            raise LogCorrupted(f"the stored checkpoint at size {size} does not verify: {exc}") from exc
        if cp.tree_size != size or size != self.size:
            raise LogCorrupted(
                f"the newest signed checkpoint covers {cp.tree_size} entries; the database holds {self.size} "
                "(truncated or rewritten)"
            )
        if self.tree.root(size) != cp.root_hash:
            raise LogCorrupted(f"the entries do not hash to the signed root of tree size {size} (rewritten)")

    def append(self, statements: Sequence[Mapping[str, Any]]) -> list[Receipt]:
        """Sign and append ``statements`` and a checkpoint, in one transaction."""
        key = self.keyring.active
        start = self.tree.size
        rows, receipts = [], []
        try:
            for i, statement in enumerate(statements):
                envelope = sign_envelope(statement, key)
                leaf = canonical_json(envelope)
                h = leaf_hash(leaf)
                self.tree.append(h)
                rows.append((start + i, leaf, h, key.public.keyid))
                receipts.append(Receipt(start + i, h, envelope))
            note = Checkpoint(self.origin, self.tree.size, self.tree.root()).sign(key)
            self.store.append(rows, (self.tree.size, note))
        except BaseException:
            self.tree.truncate(start)
            raise
        self.size, self.note = self.tree.size, note
        return receipts

    def checkpoint(self) -> dict[str, Any]:
        return Checkpoint(self.origin, self.size, self.tree.root(self.size)).to_json(self.note)

    def entry(self, index: int) -> dict[str, Any]:
        """``{"leaf": base64, "envelope"}`` of a stored entry (the leaf parsed as stored, not re-signed)."""
        if not 0 <= index < self.size:
            raise NotFound(f"index: no entry {index} in a log of {self.size}")
        row = self.store.entry(index)
        if row is None:
            raise LogCorrupted(f"entry {index} is missing from the database")
        leaf, _ = row
        try:
            envelope = json.loads(leaf)
        except ValueError:
            envelope = None  # a damaged row is served as is: verification shows it
        return {"leaf": base64.b64encode(leaf).decode(), "envelope": envelope}

    def inclusion_proof(self, index: int, tree_size: int) -> list[str]:
        self._size_ok(tree_size, "tree_size")
        if not 0 <= index < tree_size:
            raise InvalidArgument(f"index: {index} is outside a tree of size {tree_size}")
        return _b64(self.tree.inclusion_proof(index, tree_size))

    def consistency_proof(self, first: int, second: int) -> list[str]:
        self._size_ok(second, "second")
        if not 0 <= first <= second:
            raise InvalidArgument(f"first: {first} must be between 0 and second ({second})")
        try:
            return _b64(self.tree.consistency_proof(first, second))
        except ProofError as exc:
            raise InvalidArgument(str(exc)) from exc

    def _size_ok(self, size: int, field: str) -> None:
        if not 0 <= size <= self.size:
            raise InvalidArgument(f"{field}: tree size {size} is outside 0..{self.size}")

    def rotate_key(self) -> PublicKey:
        """A new active key; entries and checkpoints signed before stay verifiable (their keys stay listed)."""
        public = self.keyring.rotate().public
        self.store.add_keys([public])
        self.keys[public.keyid] = public
        return public

    def key_list(self) -> dict[str, Any]:
        active = self.keyring.active.public.keyid
        keys = [k.to_json(self.origin, k.keyid == active) for k in self.keys.values()]
        return {"origin": self.origin, "keys": keys}


def _b64(hashes: list[bytes]) -> list[str]:
    return [base64.b64encode(h).decode() for h in hashes]
