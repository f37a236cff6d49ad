"""The verifier's RFC 6962 tree against a second, independent implementation and the CT test vectors.

``Rfc6962`` below is written straight from RFC 6962 §2.1 (MTH), §2.1.1 (PATH) and §2.1.2 (PROOF /
SUBPROOF) as recursive functions over the full list of leaves: no cached levels, no bit tricks, nothing
shared with ``verifier.merkle``. The vectors are those of certificate-transparency-go
(``merkletree/merkle_verifier_test.go``): 8 leaves, the roots of every prefix, audit paths and
consistency proofs.
"""

from __future__ import annotations

import hashlib

import pytest

from verifier.merkle import (
    MerkleTree,
    ProofError,
    leaf_hash,
    root_from_inclusion,
    verify_consistency,
    verify_inclusion,
)


class Rfc6962:
    """RFC 6962 §2.1 verbatim: D[n] is a list of leaf inputs."""

    @staticmethod
    def k(n: int) -> int:
        k = 1
        while k * 2 < n:
            k *= 2
        return k

    @classmethod
    def mth(cls, d: list[bytes]) -> bytes:
        if not d:
            return hashlib.sha256(b"").digest()
        if len(d) == 1:
            return hashlib.sha256(b"\x00" + d[0]).digest()
        k = cls.k(len(d))
        return hashlib.sha256(b"\x01" + cls.mth(d[:k]) + cls.mth(d[k:])).digest()

    @classmethod
    def path(cls, m: int, d: list[bytes]) -> list[bytes]:
        if len(d) == 1:
            return []
        k = cls.k(len(d))
        if m < k:
            return [*cls.path(m, d[:k]), cls.mth(d[k:])]
        return [*cls.path(m - k, d[k:]), cls.mth(d[:k])]

    @classmethod
    def proof(cls, m: int, d: list[bytes]) -> list[bytes]:
        return cls.subproof(m, d, True)

    @classmethod
    def subproof(cls, m: int, d: list[bytes], b: bool) -> list[bytes]:
        n = len(d)
        if m == n:
            return [] if b else [cls.mth(d)]
        k = cls.k(n)
        if m <= k:
            return [*cls.subproof(m, d[:k], b), cls.mth(d[k:])]
        return [*cls.subproof(m - k, d[k:], False), cls.mth(d[:k])]


LEAVES = [bytes.fromhex(h) for h in ("", "00", "10", "2021", "3031", "40414243", "5051525354555657")] + [
    bytes.fromhex("606162636465666768696a6b6c6d6e6f")
]
ROOTS = [
    bytes.fromhex(h)
    for h in (
        "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
        "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
        "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
        "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
        "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
        "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
        "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
        "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
    )
]
# (leaf index, tree size, audit path)
INCLUSION = [
    (0, 8, ["96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4"]),
    (5, 8, ["bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"]),
    (2, 3, ["fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125"]),
    (1, 5, ["6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b"]),
]  # fmt: skip
# (first, second, consistency proof)
CONSISTENCY = [
    (1, 8, ["96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4"]),
    (6, 8, ["0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"]),
    (2, 5, ["5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b"]),
]  # fmt: skip


def _tree(leaves: list[bytes]) -> MerkleTree:
    return MerkleTree([leaf_hash(x) for x in leaves])


def test_roots_match_the_ct_vectors_and_the_rfc_definition() -> None:
    tree = _tree(LEAVES)
    assert tree.root(0) == hashlib.sha256(b"").digest() == Rfc6962.mth([])
    for n in range(1, 9):
        assert tree.root(n) == ROOTS[n - 1] == Rfc6962.mth(LEAVES[:n])


@pytest.mark.parametrize(("index", "size", "path"), INCLUSION)
def test_inclusion_vectors(index: int, size: int, path: list[str]) -> None:
    expected = [bytes.fromhex(h) for h in path]
    assert _tree(LEAVES).inclusion_proof(index, size) == expected == Rfc6962.path(index, LEAVES[:size])
    verify_inclusion(index, size, leaf_hash(LEAVES[index]), expected, ROOTS[size - 1])


@pytest.mark.parametrize(("first", "second", "proof"), CONSISTENCY)
def test_consistency_vectors(first: int, second: int, proof: list[str]) -> None:
    expected = [bytes.fromhex(h) for h in proof]
    assert _tree(LEAVES).consistency_proof(first, second) == expected == Rfc6962.proof(first, LEAVES[:second])
    verify_consistency(first, second, ROOTS[first - 1], ROOTS[second - 1], expected)


def test_every_proof_up_to_33_leaves_equals_the_rfc_definition_and_verifies() -> None:
    leaves = [f"leaf {i}".encode() for i in range(33)]
    tree = _tree(leaves)
    for n in range(1, 34):
        root = Rfc6962.mth(leaves[:n])
        assert tree.root(n) == root
        for m in range(n):
            path = tree.inclusion_proof(m, n)
            assert path == Rfc6962.path(m, leaves[:n]), (m, n)
            verify_inclusion(m, n, leaf_hash(leaves[m]), path, root)
        for m in range(1, n + 1):
            proof = tree.consistency_proof(m, n)
            assert proof == Rfc6962.proof(m, leaves[:n]), (m, n)
            verify_consistency(m, n, Rfc6962.mth(leaves[:m]), root, proof)


def test_mutated_inclusion_proofs_are_rejected() -> None:
    index, size, path = INCLUSION[0]
    proof = [bytes.fromhex(h) for h in path]
    leaf_h, root = leaf_hash(LEAVES[index]), ROOTS[size - 1]
    bad = [
        (index + 1, size, leaf_h, proof),
        (index, size * 2, leaf_h, proof),
        (index, size // 2, leaf_h, proof),
        (index, size, leaf_hash(b"WrongLeaf"), proof),
        (index, size, leaf_h, proof[:-1]),
        (index, size, leaf_h, [*proof, root]),
        (index, size, leaf_h, [root, *proof]),
        (index, size, leaf_h, [proof[0], hashlib.sha256(b"").digest(), proof[2]]),
    ]
    for args in bad:
        with pytest.raises(ProofError):
            verify_inclusion(*args, root)
    with pytest.raises(ProofError):
        root_from_inclusion(8, 8, leaf_h, proof)


def test_mutated_consistency_proofs_are_rejected() -> None:
    first, second, hexes = CONSISTENCY[1]
    proof = [bytes.fromhex(h) for h in hexes]
    r1, r2 = ROOTS[first - 1], ROOTS[second - 1]
    bad = [
        (first - 1, second, r1, r2, proof),
        (first + 1, second, r1, r2, proof),
        (first, second * 2, r1, r2, proof),
        (first, second, r2, r1, proof),
        (first, second, r1, r2, []),
        (first, second, r1, r2, proof[:-1]),
        (first, second, r1, r2, [*proof, r1]),
        (first, second, r1, r2, [proof[0], *proof]),
        (second, first, r2, r1, proof),  # a log that shrank
        (first, first, r1, r2, []),  # two roots for one size: a fork
    ]
    for args in bad:
        with pytest.raises(ProofError):
            verify_consistency(*args)


def test_truncate_undoes_appends() -> None:
    tree = _tree(LEAVES[:5])
    root5 = tree.root()
    for x in LEAVES[5:]:
        tree.append(leaf_hash(x))
    tree.truncate(5)
    assert tree.size == 5 and tree.root() == root5
    tree.append(leaf_hash(LEAVES[5]))
    assert tree.root() == ROOTS[5]
