"""The prefix-cache salt: one typed value, one wire format.

KV computed for one (model, LoRA adapter, policy version, tenant) must never be matched by a
request under another. The bridge builds a ``CacheSalt`` per turn; the prefix index
(``cache.Fingerprinter``) seeds its block-hash chain with ``str(salt)``; engine adapters get
the same string in ``GenerateRequest.cache_salt`` and, where they must know the version it
names (a turn held behind a weight update is re-salted with the version that runs it), read it
back with ``CacheSalt.parse`` instead of picking the string apart by hand.

Wire format: ``model|lora|version``, followed by ``|tenant`` when there is a tenant. Without a
tenant it is the string the fingerprint layout documents (``cache/fingerprint.py``), so hashes
pinned in tests and shared indexes keep their values. ``model`` and ``lora`` may not contain
``|``; the tenant is the last field and may contain anything. Engines with a stricter salt
alphabet (vLLM) hash the string; the salt is opaque to them otherwise.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

_SEP = "|"


@dataclass(frozen=True, slots=True)
class CacheSalt:
    """Whose KV a cached prefix is: model, adapter, policy version, and tenant (cached-token counts must
    not reveal another tenant's prompts)."""

    model: str
    policy_version: int = 0
    lora: str = ""
    tenant: str = ""

    def __post_init__(self) -> None:
        if _SEP in self.model or _SEP in self.lora:
            raise ValueError(f"a cache salt's model and lora may not contain {_SEP!r}: {self.model!r}, {self.lora!r}")
        if self.policy_version < 0:
            raise ValueError(f"policy_version must be >= 0, got {self.policy_version}")

    def __str__(self) -> str:
        head = f"{self.model}{_SEP}{self.lora}{_SEP}{self.policy_version}"
        return f"{head}{_SEP}{self.tenant}" if self.tenant else head

    def at(self, policy_version: int) -> CacheSalt:
        """The same salt under another policy version."""
        return self if policy_version == self.policy_version else replace(self, policy_version=policy_version)

    @classmethod
    def parse(cls, text: str) -> CacheSalt | None:
        """The salt ``str(salt)`` wrote, or None for any other string (a caller's own opaque salt)."""
        parts = text.split(_SEP, 3)
        if len(parts) < 3 or not (parts[2].isascii() and parts[2].isdigit()) or (len(parts) == 4 and not parts[3]):
            return None
        return cls(parts[0], int(parts[2]), parts[1], parts[3] if len(parts) == 4 else "")


@functools.lru_cache(maxsize=4096)
def salt_text(model: str, policy_version: int, tenant: str = "", lora: str = "") -> str:
    """``str(CacheSalt(model, policy_version, lora, tenant))``, memoised: the bridge salts every turn, and the
    (model, version, adapter, tenant) combinations in play are few. ``lora``: the adapter version's served name
    (``AdapterRef.served``), so KV of one adapter, or of one of its versions, is never matched by another."""
    return str(CacheSalt(model, policy_version, lora, tenant))


class SaltBook:
    """The salts an engine adapter sent, keyed by the form the engine saw (vLLM gets a digest), so that a
    KV event naming the engine's salt maps back to the bridge's (``cache/event_index.py``).

    ``wire`` turns a salt into what the engine receives (identity unless the engine restricts its
    alphabet). ``resolve`` answers a salt the engine reported, or, for an engine whose events carry no
    salt (SGLang), the salt last sent with that LoRA adapter. Bounded: the oldest of ``capacity`` goes.
    """

    def __init__(self, wire: Callable[[str], str] = str, capacity: int = 4096) -> None:
        self.wire = wire
        self.capacity = capacity
        self._by_wire: OrderedDict[str, str] = OrderedDict()
        self._latest: dict[str, str] = {}  # lora -> the salt last sent with it

    def note(self, salt: str) -> str:
        """Record that ``salt`` was sent; returns its wire form."""
        wire = self.wire(salt)
        self._by_wire[wire] = salt
        self._by_wire.move_to_end(wire)
        if len(self._by_wire) > self.capacity:
            self._by_wire.popitem(last=False)
        parsed = CacheSalt.parse(salt)
        self._latest[parsed.lora if parsed is not None else ""] = salt
        return wire

    def resolve(self, wire: str | None, lora: str | None = None) -> str | None:
        if wire is not None:
            return self._by_wire.get(wire)
        return self._latest.get(lora or "")
