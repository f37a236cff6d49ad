"""DSSE envelopes and C2SP tlog-checkpoint signed notes.

DSSE (v1.0): the signature covers ``PAE(type, body) = "DSSEv1" SP LEN(type) SP type SP LEN(body) SP body``
(LEN: ASCII decimal byte count); the envelope is ``{"payloadType", "payload": base64(body),
"signatures": [{"keyid", "sig": base64}]}``. A log leaf is the envelope's canonical JSON.

Checkpoint (C2SP tlog-checkpoint over C2SP signed-note)::

    <origin>\\n<tree size>\\n<base64(root hash)>\\n      <- the note text the signatures cover
    \\n
    — <key name> <base64(note key hash (4 bytes) || Ed25519 signature)>\\n   (one line per signer)

The key name is the origin. A verifier ignores signature lines of keys it does not know and needs one
valid line from a key it trusts.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from core.canonical import canonical_json
from verifier.keys import PublicKey, SigningKey, note_key_hash

PAYLOAD_TYPE = "application/vnd.in-toto+json"
_DASH = "\u2014 "


class SignatureError(ValueError):
    """A signature, envelope or note that does not verify (or is malformed)."""


def pae(payload_type: str, body: bytes) -> bytes:
    t = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(body), body)


def sign_envelope(statement: Mapping[str, Any], key: SigningKey) -> dict[str, Any]:
    body = canonical_json(statement)
    sig = key.sign(pae(PAYLOAD_TYPE, body))
    return {
        "payloadType": PAYLOAD_TYPE,
        "payload": base64.b64encode(body).decode(),
        "signatures": [{"keyid": key.public.keyid, "sig": base64.b64encode(sig).decode()}],
    }


def _b64(value: object, what: str) -> bytes:
    if not isinstance(value, str):
        raise SignatureError(f"{what} is not a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except binascii.Error as exc:
        raise SignatureError(f"{what} is not base64: {exc}") from exc


def open_envelope(envelope: object, keys: Mapping[str, PublicKey]) -> dict[str, Any]:
    """The statement of a DSSE envelope signed by one of ``keys`` (by keyid); SignatureError otherwise."""
    if not isinstance(envelope, dict) or set(envelope) != {"payloadType", "payload", "signatures"}:
        raise SignatureError("not a DSSE envelope (payloadType, payload, signatures)")
    ptype = envelope["payloadType"]
    if ptype != PAYLOAD_TYPE:
        raise SignatureError(f"payloadType {ptype!r} is not {PAYLOAD_TYPE!r}")
    body = _b64(envelope["payload"], "payload")
    sigs = envelope["signatures"]
    if not isinstance(sigs, list) or not sigs:
        raise SignatureError("the envelope has no signatures")
    message = pae(ptype, body)
    known = [s for s in sigs if isinstance(s, dict) and s.get("keyid") in keys]
    if not known:
        raise SignatureError("no signature by a known key (keyids: " + ", ".join(map(str, _keyids(sigs))) + ")")
    for s in known:
        if not keys[s["keyid"]].verify(_b64(s.get("sig"), "sig"), message):
            raise SignatureError(f"the signature by key {s['keyid']} does not verify")
    try:
        statement = json.loads(body)
    except ValueError as exc:
        raise SignatureError(f"the payload is not JSON: {exc}") from exc
    if not isinstance(statement, dict):
        raise SignatureError("the payload is not a statement object")
    return statement


def _keyids(sigs: Iterable[object]) -> list[object]:
    return [s.get("keyid") for s in sigs if isinstance(s, dict)]


@dataclass(frozen=True, slots=True)
class Checkpoint:
    origin: str
    tree_size: int
    root_hash: bytes

    def text(self) -> str:
        return f"{self.origin}\n{self.tree_size}\n{base64.b64encode(self.root_hash).decode()}\n"

    def sign(self, key: SigningKey) -> str:
        """The signed note."""
        text = self.text()
        sig = note_key_hash(self.origin, key.public.public_key) + key.sign(text.encode())
        return f"{text}\n{_DASH}{self.origin} {base64.b64encode(sig).decode()}\n"

    def to_json(self, note: str) -> dict[str, Any]:
        root = base64.b64encode(self.root_hash).decode()
        return {"origin": self.origin, "tree_size": self.tree_size, "root_hash": root, "note": note}


def open_checkpoint(note: str, keys: Iterable[PublicKey], origin: str | None = None) -> Checkpoint:
    """Parse a signed checkpoint note and check that a trusted key signed it (and its origin, if given)."""
    text, sep, sig_block = note.rpartition("\n\n")
    if not sep or not sig_block.endswith("\n"):
        raise SignatureError("not a signed note (text, blank line, signature lines)")
    text += "\n"
    lines = text.split("\n")[:-1]
    if len(lines) < 3:
        raise SignatureError("a checkpoint has an origin, a tree size and a root hash")
    name, size, root = lines[0], lines[1], lines[2]
    if origin is not None and name != origin:
        raise SignatureError(f"checkpoint origin {name!r} is not {origin!r}")
    if not size.isdigit() or (size != "0" and size.startswith("0")):
        raise SignatureError(f"tree size {size!r} is not a decimal number")
    root_hash = _b64(root, "root hash")
    if len(root_hash) != 32:
        raise SignatureError("the root hash is not 32 bytes")
    by_hash = {note_key_hash(name, k.public_key): k for k in keys}
    verified = False
    for line in sig_block[:-1].split("\n"):
        signer, _, sig64 = line.removeprefix(_DASH).rpartition(" ")
        if not line.startswith(_DASH) or not signer:
            raise SignatureError(f"malformed signature line {line!r}")
        sig = _b64(sig64, "note signature")
        key = by_hash.get(sig[:4]) if signer == name else None
        if key is not None:
            if not key.verify(sig[4:], text.encode()):
                raise SignatureError(f"the checkpoint signature by key {key.keyid} does not verify")
            verified = True
    if not verified:
        raise SignatureError("the checkpoint is not signed by a known key")
    return Checkpoint(name, int(size), root_hash)
