"""Offline verification: an entry against a signed checkpoint, two checkpoints against each other, a whole log.

Only public keys are needed (``GET /v1/keys``'s JSON). Every failure raises ``VerificationError`` with
the reason; nothing here trusts the service that produced the files:

- ``verify_entry``: the checkpoint note is signed by a known key (and has the expected origin); the
  leaf is the canonical JSON of a DSSE envelope whose signature verifies under its keyid; the leaf's
  RFC 6962 hash with the inclusion proof gives the checkpoint's root at the checkpoint's tree size.
- ``verify_consistency``: both checkpoints are signed, and the consistency proof shows the newer tree
  extends the older one (a shrunk, rewritten or forked log fails here).
- ``audit``: replays a stored log (every leaf rehashed, every envelope and checkpoint checked).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from core.canonical import canonical_json
from core.errors import PrimeRLError
from verifier.keys import PublicKey
from verifier.merkle import MerkleTree, ProofError, leaf_hash, verify_inclusion
from verifier.merkle import verify_consistency as _consistent
from verifier.signing import Checkpoint, SignatureError, open_checkpoint, open_envelope
from verifier.statement import PREDICATE_TYPE, STATEMENT_TYPE
from verifier.store import LogStore


class VerificationError(ValueError):
    """The material does not verify; the message says which check failed."""


@dataclass(frozen=True, slots=True)
class VerifiedEntry:
    log_index: int
    checkpoint: Checkpoint
    statement: dict[str, Any]


def parse_keys(data: object) -> list[PublicKey]:
    """``GET /v1/keys``'s JSON (``{"keys": [...]}``) or a bare list of its entries."""
    items = data.get("keys") if isinstance(data, dict) else data
    if not isinstance(items, list) or not items:
        raise VerificationError("keys: expected {'keys': [...]} with at least one key")
    try:
        return [PublicKey.from_json(k) for k in items]
    except PrimeRLError as exc:
        raise VerificationError(exc.message) from exc


def _hashes(values: object, what: str) -> list[bytes]:
    """Base64 strings decoded (hashes of a proof, a leaf, a leaf hash); VerificationError naming ``what``."""
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise VerificationError(f"{what}: expected base64 strings")
    try:
        return [base64.b64decode(v, validate=True) for v in values]
    except binascii.Error as exc:
        raise VerificationError(f"{what}: not base64 ({exc})") from exc


def _leaf_of(entry: Mapping[str, Any]) -> tuple[bytes, int | None, bytes | None]:
    """(leaf bytes, claimed log index, claimed leaf hash) from an entry, a receipt, a score response or an envelope."""
    if isinstance(entry.get("receipt"), dict):  # a POST /v1/score response
        entry = entry["receipt"]
    claimed_index = entry.get("log_index")
    claimed_hash = _hashes([entry["leaf_hash"]], "leaf_hash")[0] if "leaf_hash" in entry else None
    envelope = entry.get("envelope", entry if "payload" in entry else None)
    if "leaf" in entry:  # GET /v1/log/entries/{i}: the exact stored bytes
        leaf = _hashes([entry["leaf"]], "leaf")[0]
    elif envelope is not None:
        leaf = canonical_json(envelope)
    else:
        raise VerificationError("envelope: expected a DSSE envelope, a receipt or a log entry")
    return leaf, claimed_index if isinstance(claimed_index, int) else None, claimed_hash


def verify_entry(
    entry: Mapping[str, Any],
    proof: Mapping[str, Any],
    note: str,
    keys: Iterable[PublicKey],
    origin: str | None = None,
) -> VerifiedEntry:
    keys = list(keys)
    try:
        cp = open_checkpoint(note, keys, origin)
        leaf, claimed_index, claimed_hash = _leaf_of(entry)
        try:
            envelope = json.loads(leaf)
        except ValueError as exc:
            raise VerificationError(f"the leaf is not a JSON envelope ({exc})") from exc
        if canonical_json(envelope) != leaf:
            raise VerificationError("the leaf is not the canonical encoding of its envelope")
        statement = open_envelope(envelope, {k.keyid: k for k in keys})
        if statement.get("_type") != STATEMENT_TYPE or statement.get("predicateType") != PREDICATE_TYPE:
            raise VerificationError("the payload is not an in-toto Statement v1 verdict")
        index = proof.get("index", claimed_index)
        if not isinstance(index, int) or (claimed_index is not None and index != claimed_index):
            raise VerificationError(f"the proof's index {index} is not the entry's log index {claimed_index}")
        size = proof.get("tree_size", cp.tree_size)
        if size != cp.tree_size:
            raise VerificationError(f"the proof is for tree size {size}; the checkpoint covers {cp.tree_size}")
        h = leaf_hash(leaf)
        if claimed_hash is not None and claimed_hash != h:
            raise VerificationError("the receipt's leaf_hash is not the hash of its envelope")
        verify_inclusion(index, cp.tree_size, h, _hashes(proof.get("hashes"), "proof"), cp.root_hash)
    except (SignatureError, ProofError) as exc:
        raise VerificationError(str(exc)) from exc
    return VerifiedEntry(index, cp, statement)


def verify_consistency(
    old_note: str, new_note: str, proof: Mapping[str, Any], keys: Iterable[PublicKey], origin: str | None = None
) -> tuple[Checkpoint, Checkpoint]:
    keys = list(keys)
    try:
        old, new = open_checkpoint(old_note, keys, origin), open_checkpoint(new_note, keys, origin)
        if old.origin != new.origin:
            raise VerificationError(f"checkpoints of two logs ({old.origin!r}, {new.origin!r})")
        if (proof.get("first", old.tree_size), proof.get("second", new.tree_size)) != (old.tree_size, new.tree_size):
            raise VerificationError("the consistency proof is for other tree sizes than the checkpoints")
        hashes = _hashes(proof.get("hashes"), "consistency proof")
        _consistent(old.tree_size, new.tree_size, old.root_hash, new.root_hash, hashes)
    except (SignatureError, ProofError) as exc:
        raise VerificationError(str(exc)) from exc
    return old, new


def audit(store: LogStore, origin: str, keys: Iterable[PublicKey] = ()) -> int:
    """Replay a stored log: every leaf rehashed and its envelope checked, every stored checkpoint matched."""
    known = {k.keyid: k for k in [*store.public_keys(), *keys]}
    tree = MerkleTree()
    for idx, leaf, keyid in store.entries():
        if idx != tree.size:
            raise VerificationError(f"entry {tree.size} is missing (next stored index is {idx})")
        try:
            envelope = json.loads(leaf)
            open_envelope(envelope, {keyid: known[keyid]} if keyid in known else {})
        except (ValueError, SignatureError) as exc:
            raise VerificationError(f"entry {idx}: {exc}") from exc
        tree.append(leaf_hash(leaf))
    for size, note in store.checkpoints():
        try:
            cp = open_checkpoint(note, known.values(), origin)
        except SignatureError as exc:
            raise VerificationError(f"checkpoint at size {size}: {exc}") from exc
        if cp.tree_size != size or size > tree.size or tree.root(size) != cp.root_hash:
            raise VerificationError(f"the signed checkpoint of size {size} does not match the stored entries")
    return tree.size
