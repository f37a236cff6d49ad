"""RFC 6962 Merkle tree hashing, proofs, and their verification (RFC 9162 §2.1.3.2 / §2.1.4.2).

Hashes: leaf ``SHA-256(0x00 || leaf)``, node ``SHA-256(0x01 || left || right)``, the empty tree
``SHA-256("")``. ``MTH(D[n])`` splits at ``k``, the largest power of two smaller than ``n``: the left
part is always a *perfect* subtree aligned to its size, so ``MerkleTree`` keeps every completed perfect
subtree hash (levels 0..log2 n) and computes any ``MTH`` / audit path / consistency proof in
O(log n) hashes. A completed perfect subtree never changes in an append-only tree: the levels are
only ever extended (``truncate`` exists to undo an append whose database transaction failed).
"""

from __future__ import annotations

import hashlib

EMPTY_ROOT = hashlib.sha256(b"").digest()


class ProofError(ValueError):
    """A proof that does not verify (or is malformed)."""


def leaf_hash(leaf: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + leaf).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def _split(n: int) -> int:
    """The largest power of two strictly smaller than ``n`` (n >= 2)."""
    return 1 << ((n - 1).bit_length() - 1)


class MerkleTree:
    """An append-only RFC 6962 tree over leaf hashes; every past tree size stays addressable."""

    def __init__(self, leaf_hashes: list[bytes] | None = None) -> None:
        self._levels: list[list[bytes]] = [[]]
        for h in leaf_hashes or ():
            self.append(h)

    @property
    def size(self) -> int:
        return len(self._levels[0])

    def append(self, h: bytes) -> None:
        self._levels[0].append(h)
        level = 0
        while len(self._levels[level]) % 2 == 0:  # a perfect subtree of 2^(level+1) leaves just completed
            nodes = self._levels[level]
            if len(self._levels) == level + 1:
                self._levels.append([])
            self._levels[level + 1].append(node_hash(nodes[-2], nodes[-1]))
            level += 1

    def truncate(self, size: int) -> None:
        """Forget every leaf from ``size`` on (undo of an append that was not committed)."""
        for level, nodes in enumerate(self._levels):
            del nodes[size >> level :]

    def leaf(self, index: int) -> bytes:
        return self._levels[0][index]

    def _subtree(self, start: int, n: int) -> bytes:
        """MTH(D[start:start+n])."""
        if n == 0:
            return EMPTY_ROOT
        level = n.bit_length() - 1
        if n == 1 << level and start % n == 0:
            return self._levels[level][start >> level]
        k = _split(n)
        return node_hash(self._subtree(start, k), self._subtree(start + k, n - k))

    def root(self, size: int | None = None) -> bytes:
        size = self.size if size is None else size
        self._check_size(size)
        return self._subtree(0, size)

    def inclusion_proof(self, index: int, size: int) -> list[bytes]:
        """PATH(index, D[size]) of RFC 6962 §2.1.1, leaf-side first."""
        self._check_size(size)
        if not 0 <= index < size:
            raise ProofError(f"index {index} is outside a tree of size {size}")
        out: list[bytes] = []
        start, n, m = 0, size, index
        while n > 1:  # walk down from the root; siblings are collected root-side first
            k = _split(n)
            if m < k:
                out.append(self._subtree(start + k, n - k))
                n = k
            else:
                out.append(self._subtree(start, k))
                start, n, m = start + k, n - k, m - k
        return out[::-1]

    def consistency_proof(self, first: int, second: int) -> list[bytes]:
        """PROOF(first, D[second]) of RFC 6962 §2.1.2 (empty when first is 0 or equals second)."""
        self._check_size(second)
        if not 0 <= first <= second:
            raise ProofError(f"first ({first}) must be between 0 and second ({second})")
        if first in (0, second):
            return []
        out: list[bytes] = []
        start, n, m, complete = 0, second, first, True
        while m != n:
            k = _split(n)
            if m <= k:
                out.append(self._subtree(start + k, n - k))
                n = k
            else:
                out.append(self._subtree(start, k))
                start, n, m, complete = start + k, n - k, m - k, False
        if not complete:
            out.append(self._subtree(start, n))
        return out[::-1]

    def _check_size(self, size: int) -> None:
        if not 0 <= size <= self.size:
            raise ProofError(f"tree size {size} is outside 0..{self.size}")


def _to_right_child(fn: int, sn: int) -> tuple[int, int]:
    """RFC 9162: "if LSB(fn) is not set, right-shift both fn and sn equally until either LSB(fn) is set or fn is 0"."""
    while fn and not fn & 1:
        fn, sn = fn >> 1, sn >> 1
    return fn, sn


def root_from_inclusion(index: int, size: int, leaf_h: bytes, proof: list[bytes]) -> bytes:
    """The root an inclusion proof leads to (RFC 9162 §2.1.3.2); ProofError if malformed."""
    if not 0 <= index < size:
        raise ProofError(f"index {index} is outside a tree of size {size}")
    fn, sn, r = index, size - 1, leaf_h
    for p in proof:
        if len(p) != 32 or sn == 0:
            raise ProofError("inclusion proof has a malformed or superfluous hash")
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            fn, sn = _to_right_child(fn, sn)
        else:
            r = node_hash(r, p)
        fn, sn = fn >> 1, sn >> 1
    if sn != 0:
        raise ProofError("inclusion proof is too short")
    return r


def verify_inclusion(index: int, size: int, leaf_h: bytes, proof: list[bytes], root: bytes) -> None:
    if root_from_inclusion(index, size, leaf_h, proof) != root:
        raise ProofError(f"inclusion proof of leaf {index} does not lead to the root of tree size {size}")


def verify_consistency(first: int, second: int, first_root: bytes, second_root: bytes, proof: list[bytes]) -> None:
    """RFC 9162 §2.1.4.2: the tree of size ``second`` extends the tree of size ``first``."""
    if not 0 <= first <= second:
        raise ProofError(f"tree size went from {first} to {second}: a log never shrinks")
    if first == second:
        if proof or first_root != second_root:
            raise ProofError(f"two different roots for the same tree size {first}")
        return
    if first == 0:
        if proof:
            raise ProofError("a consistency proof from the empty tree must be empty")
        return
    if not proof or any(len(p) != 32 for p in proof):
        raise ProofError("consistency proof is empty or has a malformed hash")
    if first & (first - 1) == 0:  # a power of two: the old root is itself a node of the new tree
        proof = [first_root, *proof]
    fn, sn = first - 1, second - 1
    while fn & 1:
        fn, sn = fn >> 1, sn >> 1
    fr = sr = proof[0]
    for c in proof[1:]:
        if sn == 0:
            raise ProofError("consistency proof has superfluous hashes")
        if fn & 1 or fn == sn:
            fr, sr = node_hash(c, fr), node_hash(c, sr)
            fn, sn = _to_right_child(fn, sn)
        else:
            sr = node_hash(sr, c)
        fn, sn = fn >> 1, sn >> 1
    if sn != 0:
        raise ProofError("consistency proof is too short")
    if fr != first_root or sr != second_root:
        raise ProofError(f"the tree of size {second} does not extend the tree of size {first}")
