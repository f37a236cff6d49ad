"""Prefix fingerprints: chained hashes of full KV blocks over the exact token ids an engine sees.

The hash (stable across processes, machines and Python versions; never ``hash()``):

- root seed = ``xxh3_64("primerl/pfx/v1|" + str(salt))`` (UTF-8), the salt being an
  ``core.salt.CacheSalt`` (``model|lora|policy_version``, then ``|tenant`` when there is one);
- block ``i`` (tokens ``[i*B, (i+1)*B)`` as little-endian uint32) hashes to
  ``h_i = xxh3_64(block_bytes, seed=h_{i-1})`` with ``h_{-1}`` = the root seed.

So ``h_i`` identifies the whole prefix ``tokens[: (i+1)*B]`` under that model, adapter and
weights. Only full blocks are hashed: engines (vLLM, SGLang pages) cache full blocks only,
and a router that hashed a partial tail would overcount hits. ``algo="blake2b"`` is the
fallback with the same layout (8-byte BLAKE2b digest of ``parent_le64 || block_bytes``,
root = BLAKE2b-64 of the same salt string); it is slower and gives other values, so every
bridge sharing one index must use the same algorithm and block size (both are in the
index namespace, see ``CacheConfig.namespace``).

Invariants: a policy-version bump changes every hash (KV computed by older weights is never
matched); ``extend`` continues a chain from hashes computed earlier, giving exactly what a
full recomputation gives (per-episode incremental hashing).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import xxhash

from core.salt import CacheSalt

HashAlgo = Literal["xxh3_64", "blake2b"]
_MASK = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class Fingerprinter:
    """Chained block hashes; ``block_size`` must equal the engine's KV block size."""

    block_size: int = 16
    algo: HashAlgo = "xxh3_64"

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    def root(self, salt: CacheSalt | str) -> int:
        data = ("primerl/pfx/v1|" + str(salt)).encode()
        if self.algo == "xxh3_64":
            return int(xxhash.xxh3_64_intdigest(data))
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")

    def hashes(self, token_ids: Sequence[int], salt: CacheSalt | str) -> list[int]:
        """Hashes of every full block of ``token_ids``."""
        return self.extend([], token_ids, salt)

    def extend(self, prev: Sequence[int], token_ids: Sequence[int], salt: CacheSalt | str) -> list[int]:
        """``prev`` (hashes of a prefix of ``token_ids`` under ``salt``) continued to every full block."""
        b = self.block_size
        n = len(token_ids) // b
        out = list(prev[:n])
        if len(out) == n:
            return out
        return out + self.chain(out[-1] if out else self.root(salt), token_ids[len(out) * b : n * b])

    def chain(self, parent: int, token_ids: Sequence[int]) -> list[int]:
        """Hashes of the full blocks of ``token_ids`` continuing the chain whose last hash is ``parent``
        (a block's hash, or ``root(salt)`` for a chain's first block)."""
        b = self.block_size
        out: list[int] = []
        data = np.asarray(token_ids[: len(token_ids) // b * b], dtype="<u4").tobytes()
        step = 4 * b
        if self.algo == "xxh3_64":
            digest = xxhash.xxh3_64_intdigest
            for off in range(0, len(data), step):
                parent = int(digest(data[off : off + step], seed=parent))
                out.append(parent)
        else:
            for off in range(0, len(data), step):
                h = hashlib.blake2b((parent & _MASK).to_bytes(8, "little"), digest_size=8)
                h.update(data[off : off + step])
                parent = int.from_bytes(h.digest(), "little")
                out.append(parent)
        return out
