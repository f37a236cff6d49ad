"""Deterministic on-policy mode (issue 38): the embedded engine's ``batch_invariant`` mode records, for every
sampled token, bit for bit the logprob the trainer's ``batch_invariant`` forward recomputes from the same weights
(a separately loaded copy of the checkpoint), with two groups of 4 decoding side by side, KV reused across three
turns and sequences of mixed lengths; the same episodes replayed one at a time give the same tokens and logprobs. The
default mode, run the same way, is not exact (so the exact figure is a measurement, not a tautology).
``bench/mismatch.py`` runs the same check on 200 trajectories and records the figures.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from core.types import Message
from grpo.fidelity import Workload, recompute, replay, sample_groups
from rl_client import AsyncBridgeClient
from server.app import BridgeServer, create_server
from server.config import load_settings

pytestmark = pytest.mark.slow

SAMPLING = {"temperature": 0.8, "max_tokens": 5}
QUESTIONS = ["What is 2+2?", "Name three colors of the rainbow and say why the sky looks blue during the day."]


async def _bridge(invariant: bool) -> tuple[BridgeServer, AsyncBridgeClient]:
    engine = {"type": "embedded", "embedded": {"max_model_len": 1024, "batch_invariant": invariant}}
    server = await create_server(
        load_settings(engine=engine, server={"port": 0, "grace_period_s": 1.0}, metrics={"port": 0})
    )
    await server.start()
    return server, AsyncBridgeClient(f"127.0.0.1:{server.port}", timeout=300)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def invariant() -> AsyncIterator[tuple[BridgeServer, AsyncBridgeClient]]:
    server, client = await _bridge(True)
    yield server, client
    await client.close()
    await server.stop(0.5)


@pytest.fixture(scope="module")
def trainer_model() -> Any:
    from engines.model_store import ensure_converted, load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(ensure_converted())
    return model.eval()


def _prompts(server: BridgeServer) -> list[list[int]]:
    tokenizer = server.bridge.engines[0].tokenizer
    return [tokenizer.render_prompt([Message("user", q)]) for q in QUESTIONS]


async def test_deterministic_mode_records_the_trainers_logprobs_bit_for_bit(
    invariant: tuple[BridgeServer, AsyncBridgeClient], trainer_model: Any
) -> None:
    server, client = invariant
    prompts = _prompts(server)
    assert len(prompts[0]) != len(prompts[1])
    work = Workload(prompts, group_size=4, turns=3, sampling=SAMPLING, seed=5)
    together = await sample_groups(client, work)
    assert len(together) == 8 and all(len(t.turns) == 3 for t in together)
    assert server.bridge.engines[0].counters.cached_tokens > 0  # turns 2 and 3 reused their episode's KV
    figures = recompute(trainer_model, together, temperature=SAMPLING["temperature"])
    assert figures["mismatch/tokens"] >= 8 * 3  # every turn sampled at least one token
    assert figures["mismatch/abs_max"] == 0.0
    assert figures["mismatch/k3_kl"] == 0.0
    assert figures["mismatch/out_0.9_1.1"] == 0.0

    alone = await replay(client, work)
    for a, b in zip(together, alone, strict=True):
        assert np.array_equal(a.token_ids, b.token_ids)
        assert np.array_equal(a.logprobs, b.logprobs, equal_nan=True)


async def test_default_mode_is_close_but_not_exact(trainer_model: Any) -> None:
    server, client = await _bridge(False)
    try:
        prompts = _prompts(server)
        together = await sample_groups(client, Workload(prompts, group_size=4, turns=3, sampling=SAMPLING, seed=5))
        figures = recompute(trainer_model, together, temperature=SAMPLING["temperature"])
        default = recompute(trainer_model, together, temperature=SAMPLING["temperature"], batch_invariant=False)
    finally:
        await client.close()
        await server.stop(0.5)
    assert 0.0 < figures["mismatch/abs_max"] < 1e-3  # default kernels: the invariant ones differ in the last bits
    assert 0.0 < default["mismatch/abs_max"] < 1e-3  # and from the trainer's default (batched, fp32) forward
    assert figures["mismatch/k3_kl"] < 1e-8


def test_invariant_forward_rows_do_not_depend_on_how_the_sequence_was_cut(trainer_model: Any) -> None:
    """One forward over 45 tokens against: decoding one token at a time after a 13-token prefill, continuing a
    cropped cache, and continuing a fork; every row bit for bit (the engine's decode, speculation's crop and a
    group member's fork of the shared prompt)."""
    import torch

    from engines.embedded.invariant import CHUNK, InvariantCache, forward_rows

    ids = [int(x) for x in np.random.default_rng(0).integers(0, 49_000, size=45)]
    with torch.no_grad():
        whole, _ = forward_rows(trainer_model, ids, rows_from=0)
        cache = InvariantCache()
        rows = [forward_rows(trainer_model, ids[:13], cache, rows_from=0)[0]]
        rows += [forward_rows(trainer_model, ids[: i + 1], cache)[0] for i in range(13, 45)]
        assert torch.equal(torch.cat(rows), whole) and cache.length == 45
        cache.crop(-10)  # 35 left: the chunk at 32 is recomputed from there
        assert torch.equal(forward_rows(trainer_model, ids, cache, rows_from=32)[0], whole[32:])
        forked = InvariantCache()
        forward_rows(trainer_model, ids[:CHUNK], forked)
        again = forked.fork()
        assert torch.equal(forward_rows(trainer_model, ids, again, rows_from=CHUNK)[0], whole[CHUNK:])
        with pytest.raises(ValueError, match="rows_from"):
            forward_rows(trainer_model, ids, forked.fork(), rows_from=CHUNK - 1)
