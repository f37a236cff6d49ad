"""Block fingerprints: stable values, chaining, salting, incremental extension."""

from __future__ import annotations

import struct
import subprocess
import sys

import pytest
import xxhash

from cache.config import CacheConfig
from cache.fingerprint import Fingerprinter
from core.salt import CacheSalt


def test_only_full_blocks_are_hashed() -> None:
    fp = Fingerprinter(block_size=4)
    assert len(fp.hashes(list(range(11)), "m||0")) == 2
    assert fp.hashes([1, 2, 3], "m||0") == []


def test_chain_identifies_the_whole_prefix() -> None:
    fp = Fingerprinter(block_size=4)
    a = fp.hashes([1, 2, 3, 4, 5, 6, 7, 8], "s")
    b = fp.hashes([9, 2, 3, 4, 5, 6, 7, 8], "s")  # same second block, other first block
    assert a[0] != b[0] and a[1] != b[1]
    c = fp.hashes([1, 2, 3, 4, 5, 6, 7, 9], "s")
    assert a[0] == c[0] and a[1] != c[1]


@pytest.mark.parametrize("algo", ["xxh3_64", "blake2b"])
def test_salt_separates_model_lora_and_policy_version(algo: str) -> None:
    fp = Fingerprinter(block_size=2, algo=algo)  # type: ignore[arg-type]
    toks = [5, 6, 7, 8]
    seen = {
        tuple(fp.hashes(toks, str(CacheSalt(m, v, lora=lora))))
        for m, lora, v in [("m", "", 1), ("m", "", 2), ("m", "a", 1), ("n", "", 1)]
    }
    assert len(seen) == 4


@pytest.mark.parametrize("algo", ["xxh3_64", "blake2b"])
def test_extend_equals_full_recomputation(algo: str) -> None:
    fp = Fingerprinter(block_size=3, algo=algo)  # type: ignore[arg-type]
    toks = list(range(100, 140))
    head = fp.hashes(toks[:10], "s")
    assert fp.extend(head, toks, "s") == fp.hashes(toks, "s")
    assert fp.extend(fp.hashes(toks, "s"), toks[:7], "s") == fp.hashes(toks[:7], "s")


def test_documented_values_are_stable_across_processes() -> None:
    # Pinned values: a change of the hash layout must be deliberate (it invalidates shared indexes).
    fp = Fingerprinter(block_size=4)
    expected = fp.hashes([1, 2, 3, 4, 5, 6, 7, 8], str(CacheSalt("smollm2", 3)))
    code = (
        "from cache.fingerprint import Fingerprinter; from core.salt import CacheSalt;"
        "print(Fingerprinter(block_size=4).hashes([1,2,3,4,5,6,7,8], CacheSalt('smollm2',3)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": "7"}
    )
    assert out.stdout.strip() == str(expected)
    assert expected == [0x39E64376C46833AF, 0x8A2A517BC0064603]
    b2 = Fingerprinter(block_size=4, algo="blake2b").hashes([1, 2, 3, 4, 5, 6, 7, 8], str(CacheSalt("smollm2", 3)))
    assert b2 == [0xC2FE728805B74CEF, 0x5B4FB8050301E1FF]


def test_layout_matches_the_documented_formula() -> None:
    root = xxhash.xxh3_64_intdigest(b"primerl/pfx/v1|m|lora|9")
    h0 = xxhash.xxh3_64_intdigest(struct.pack("<2I", 70000, 2), seed=root)
    h1 = xxhash.xxh3_64_intdigest(struct.pack("<2I", 3, 4), seed=h0)
    assert Fingerprinter(block_size=2).hashes([70000, 2, 3, 4], str(CacheSalt("m", 9, lora="lora"))) == [h0, h1]


def test_namespace_and_capacity() -> None:
    cfg = CacheConfig(block_size=16)
    assert cfg.namespace() == "primerl:pfx:xxh3_64:16"
    assert cfg.capacity_for(16 * 1000) == 1000
    assert CacheConfig(capacity_ratio=0.5).capacity_for(1600) == 50
    assert CacheConfig(capacity_blocks=7).capacity_for(10**6) == 7
    assert cfg.capacity_for(0) == cfg.default_capacity_blocks


@pytest.mark.parametrize(
    "salt",
    [
        CacheSalt("m", 0),
        CacheSalt("org/model", 7, lora="a"),
        CacheSalt("m", 3, tenant="team|a/b@c"),
        CacheSalt("m@x", 2),
    ],
)
def test_cache_salt_round_trips_through_its_one_wire_format(salt: CacheSalt) -> None:
    assert CacheSalt.parse(str(salt)) == salt
    assert salt.at(salt.policy_version + 1).policy_version == salt.policy_version + 1
    # Without a tenant the wire string is the documented fingerprint salt (pinned hashes keep their values).
    assert str(CacheSalt("smollm2", 3)) == "smollm2||3"


@pytest.mark.parametrize("text", ["", "toy@0", "m|a", "m||x", "m||-1", "m||²", "m||1|"])
def test_strings_not_written_by_cache_salt_are_opaque(text: str) -> None:
    assert CacheSalt.parse(text) is None


def test_cache_salt_refuses_ambiguous_fields() -> None:
    with pytest.raises(ValueError, match="may not contain"):
        CacheSalt("a|b", 1)
