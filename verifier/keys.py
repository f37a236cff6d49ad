"""Ed25519 signing keys: the key directory, key ids, rotation.

A key directory holds one PKCS#8 PEM file per private key (``<keyid>.pem``, mode 0600) and ``ACTIVE``,
the key id that signs new entries and checkpoints. ``rotate`` adds a key and makes it active; the old
files may stay or go: the log's database keeps every public key that ever signed (``keys`` table),
so entries signed before a rotation stay verifiable (``GET /v1/keys`` lists them all).

Two ids per key, both derived from the raw 32-byte public key:

- ``keyid`` (DSSE ``signatures[].keyid``): hex of the first 8 bytes of ``SHA-256(public key)``;
- the C2SP note key hash: ``SHA-256(name || 0x0A || 0x01 || public key)[:4]``, the prefix of each
  checkpoint signature, and the ``vkey`` ``<name>+<hex key hash>+<base64(0x01 || public key)>``.
"""

from __future__ import annotations

import base64
import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from core.errors import FailedPrecondition, InvalidArgument

ED25519_NOTE_TYPE = b"\x01"


def key_id(public_raw: bytes) -> str:
    return hashlib.sha256(public_raw).digest()[:8].hex()


def note_key_hash(name: str, public_raw: bytes) -> bytes:
    return hashlib.sha256(name.encode() + b"\n" + ED25519_NOTE_TYPE + public_raw).digest()[:4]


@dataclass(frozen=True, slots=True)
class PublicKey:
    """A verification key as listed by ``GET /v1/keys``."""

    keyid: str
    public_key: bytes  # raw 32 bytes
    created_at: float = 0.0

    def verify(self, signature: bytes, message: bytes) -> bool:
        try:
            Ed25519PublicKey.from_public_bytes(self.public_key).verify(signature, message)
        except (InvalidSignature, ValueError):
            return False
        return True

    def vkey(self, name: str) -> str:
        raw = base64.b64encode(ED25519_NOTE_TYPE + self.public_key).decode()
        return f"{name}+{note_key_hash(name, self.public_key).hex()}+{raw}"

    def to_json(self, name: str, active: bool) -> dict[str, object]:
        return {
            "keyid": self.keyid,
            "algorithm": "ed25519",
            "public_key": base64.b64encode(self.public_key).decode(),
            "note_key_hash": note_key_hash(name, self.public_key).hex(),
            "vkey": self.vkey(name),
            "created_at": self.created_at,
            "active": active,
        }

    @classmethod
    def from_json(cls, data: object) -> PublicKey:
        """One entry of ``GET /v1/keys``'s ``keys`` (keyid checked against the key)."""
        if not isinstance(data, dict) or not isinstance(data.get("public_key"), str):
            raise InvalidArgument("keys: each entry needs a base64 'public_key'")
        try:
            raw = base64.b64decode(data["public_key"], validate=True)
        except ValueError as exc:
            raise InvalidArgument(f"keys: public_key is not base64: {exc}") from exc
        if len(raw) != 32:
            raise InvalidArgument(f"keys: an Ed25519 public key has 32 bytes, not {len(raw)}")
        if data.get("keyid", key_id(raw)) != key_id(raw):
            raise InvalidArgument(f"keys: keyid {data.get('keyid')!r} does not match its public key")
        return cls(key_id(raw), raw, float(data.get("created_at", 0.0)))


@dataclass(frozen=True, slots=True)
class SigningKey:
    private: Ed25519PrivateKey
    public: PublicKey

    def sign(self, message: bytes) -> bytes:
        return self.private.sign(message)

    @classmethod
    def generate(cls, created_at: float) -> SigningKey:
        return cls._wrap(Ed25519PrivateKey.generate(), created_at)

    @classmethod
    def _wrap(cls, private: Ed25519PrivateKey, created_at: float) -> SigningKey:
        raw = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return cls(private, PublicKey(key_id(raw), raw, created_at))


class KeyRing:
    """The private keys of a key directory; ``active`` signs."""

    def __init__(self, directory: Path, keys: dict[str, SigningKey], active: str) -> None:
        self.directory = directory
        self.keys = keys
        self.active = keys[active]

    @classmethod
    def open(cls, directory: str | Path, create: bool = True) -> KeyRing:
        """Load every ``*.pem``; an empty (or missing) directory gets a first key when ``create``."""
        path = Path(directory)
        keys: dict[str, SigningKey] = {}
        for pem in sorted(path.glob("*.pem")):
            private = serialization.load_pem_private_key(pem.read_bytes(), password=None)
            if not isinstance(private, Ed25519PrivateKey):
                raise FailedPrecondition(f"{pem}: not an Ed25519 private key")
            key = SigningKey._wrap(private, pem.stat().st_mtime)
            keys[key.public.keyid] = key
        active_file = path / "ACTIVE"
        if not keys:
            if not create:
                raise FailedPrecondition(f"no signing key (*.pem) in {path}")
            return cls._first(path)
        newest = max(keys, key=lambda k: keys[k].public.created_at)
        active = active_file.read_text().strip() if active_file.exists() else newest
        if active not in keys:
            raise FailedPrecondition(f"{active_file} names key {active!r}, which has no .pem file in {path}")
        return cls(path, keys, active)

    @classmethod
    def _first(cls, path: Path) -> KeyRing:
        key = _write_new(path)
        return cls(path, {key.public.keyid: key}, key.public.keyid)

    def rotate(self) -> SigningKey:
        """A new key becomes active; the old ones stay listed (and in the log's key table)."""
        key = _write_new(self.directory)
        self.keys[key.public.keyid] = key
        self.active = key
        return key


def _write_new(directory: Path) -> SigningKey:
    directory.mkdir(parents=True, exist_ok=True)
    key = SigningKey.generate(time.time())
    pem = key.private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    target = directory / f"{key.public.keyid}.pem"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    key = SigningKey._wrap(key.private, target.stat().st_mtime)  # created_at as KeyRing.open will read it
    tmp = directory / "ACTIVE.tmp"
    tmp.write_text(key.public.keyid + "\n")
    tmp.replace(directory / "ACTIVE")  # atomic: a crash leaves the old or the new active key, never neither
    return key
