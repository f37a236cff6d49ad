"""The TensorRT-LLM adapter against the trtllm-serve stand-in (strict /v1/completions, quirks included).

TensorRT-LLM cannot run on this CPU-only machine: these tests check the adapter's contract with
a faithful stand-in backed by a real engine (the toy model; see tests/standins/trtllm.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from core.errors import DeadlineExceeded, EngineProtocolError, InvalidArgument, TokenOutOfVocabulary, Unimplemented
from core.types import FinishReason, GenerateRequest, ModelFacts, SamplingParams, TokenChunk, WeightUpdate
from engines.config import ToyConfig, TrtllmConfig
from engines.http.trtllm import TrtllmEngine
from engines.toy import ToyEngine
from rl_client.errors import DeadlineExceededError, UnavailableError, UnimplementedError
from tests.integration.engine_script import bridge_over, end_when_idle, run_episode_script
from tests.standins._common import StandinServer
from tests.standins.trtllm import TrtllmStandin

PROMPT = (1, 4, 30, 31, 32, 2, 5)


def adapter(url: str, toy: ToyEngine, request_timeout_s: float = 30, **config: object) -> TrtllmEngine:
    facts = ModelFacts("toy", toy.info.vocab_size, toy.info.eos_token_ids, toy.info.max_model_len)
    return TrtllmEngine(
        url,
        TrtllmConfig.model_validate({"connect_retries": 0, **config}),
        facts,
        model="toy",
        tokenizer=toy.tokenizer,
        request_timeout_s=request_timeout_s,
        replica="trtllm-0",
    )


@pytest.fixture
async def standin() -> AsyncIterator[tuple[TrtllmStandin, StandinServer, ToyEngine]]:
    toy = ToyEngine(ToyConfig(yield_every=3))
    trt = TrtllmStandin(toy, served_model_name="toy-trt")
    server = await trt.serve()
    yield trt, server, toy
    await server.stop()


async def collect(engine: TrtllmEngine | ToyEngine, request: GenerateRequest) -> list[TokenChunk]:
    return [c async for c in engine.generate(request)]


def request(rid: str = "r1", **params: object) -> GenerateRequest:
    return GenerateRequest(rid, PROMPT, SamplingParams(**params), cache_salt="toy@0")  # type: ignore[arg-type]


async def test_request_passes_strict_validation_with_every_knob(standin) -> None:  # type: ignore[no-untyped-def]
    trt, server, toy = standin
    eng = adapter(server.url, toy)
    await eng.start()
    await collect(eng, request(seed=5, max_tokens=4, top_k=7))
    body = trt.requests[-1]
    assert body["model"] == "toy-trt"  # the served name, learnt from /v1/models
    assert body["prompt"] == list(PROMPT) and body["detokenize"] is False and body["logprobs"] == 1
    assert body["seed"] == 5 and body["max_tokens"] == 4 and body["top_k"] == 7
    for absent in ("cache_salt", "return_token_ids", "return_tokens_as_token_ids", "request_id"):
        assert absent not in body
    # End to end: the backing engine gets no salt (trtllm-serve has none, and no weight updates).
    assert [r.cache_salt for r in trt.received] == [""] and trt.received[-1].token_ids == PROMPT
    async with httpx.AsyncClient() as http:  # what the adapter must not send is really rejected
        for extra in ({"cache_salt": "x"}, {"return_token_ids": True}):
            r = await http.post(f"{server.url}/v1/completions", json={**body, "stream": False, **extra})
            assert r.status_code == 400, extra
        no_model = {k: v for k, v in body.items() if k not in ("model", "stream", "stream_options")}
        assert (await http.post(f"{server.url}/v1/completions", json=no_model)).status_code == 400
        plain = {**body, "stream": False, "detokenize": True, "logprobs": 0}
        plain.pop("stream_options")
        choice = (await http.post(f"{server.url}/v1/completions", json=plain)).json()["choices"][0]
        assert choice["token_ids"] is None and choice["logprobs"] is None and choice["text"]  # the quirks
    await eng.close()


async def test_stream_equals_the_backing_engine(standin) -> None:  # type: ignore[no-untyped-def]
    _, server, toy = standin
    eng = adapter(server.url, toy)
    got = await collect(eng, request(seed=3, max_tokens=20, ignore_eos=True))
    want = await collect(toy, request(seed=3, max_tokens=20, ignore_eos=True))
    assert [t for c in got for t in c.token_ids] == [t for c in want for t in c.token_ids]
    assert [x for c in got for x in c.logprobs] == pytest.approx([x for c in want for x in c.logprobs], abs=1e-12)
    assert len(got) > 2 and got[-1].finish_reason == FinishReason.LENGTH
    assert got[-1].usage is not None and (got[-1].usage.prompt_tokens, got[-1].usage.generated_tokens) == (7, 20)
    await eng.close()


async def test_episode_script_through_the_bridge(standin) -> None:  # type: ignore[no-untyped-def]
    _, server, toy = standin
    async with bridge_over([adapter(server.url, toy)]) as (_, client):
        result = await run_episode_script(client)
        assert result["started"].engine == "trtllm"
        with pytest.raises(UnimplementedError, match="cannot load new weights"):
            await client.update_weights("/ckpt")


async def test_weight_updates_are_unimplemented_with_a_reason(standin) -> None:  # type: ignore[no-untyped-def]
    _, server, toy = standin
    eng = adapter(server.url, toy)
    assert not eng.info.supports_weight_updates
    with pytest.raises(Unimplemented, match="CUDA IPC"):
        await eng.update_weights(WeightUpdate("/ckpt", 1))
    await eng.close()


async def test_abort_drops_the_connection_and_stops_the_engine(standin) -> None:  # type: ignore[no-untyped-def]
    _, server, toy = standin
    toy.config = toy.config.model_copy(update={"token_delay_s": 0.01, "yield_every": 1})
    eng = adapter(server.url, toy)
    chunks = []
    async for chunk in eng.generate(request(rid="slow", max_tokens=2000, ignore_eos=True)):
        chunks.append(chunk)
        if len(chunks) == 3:
            await eng.abort("slow")
    assert chunks[-1].finish_reason == FinishReason.ABORT
    for _ in range(100):  # the toy counts its tokens when its stream ends: on the disconnect
        if toy.counters.generated_tokens:
            break
        await asyncio.sleep(0.02)
    assert 3 <= toy.counters.generated_tokens < 100
    await eng.close()


async def test_errors_are_mapped(standin) -> None:  # type: ignore[no-untyped-def]
    trt, server, toy = standin
    eng = adapter(server.url, toy)
    with pytest.raises(TokenOutOfVocabulary, match="out of vocabulary"):
        await collect(eng, GenerateRequest("oov", (1, 99999), SamplingParams(max_tokens=2)))
    with pytest.raises(InvalidArgument, match="exceeds"):
        await collect(eng, GenerateRequest("long", (1,) * 5000, SamplingParams(max_tokens=2)))
    trt.faults.malformed = "field"
    with pytest.raises(EngineProtocolError, match=r"trtllm replica trtllm-0 .*`choices\[0\]\.token_ids\[0\]`"):
        await collect(eng, request(max_tokens=4))
    trt.faults.malformed = ""
    await eng.close()


async def test_engine_dies_mid_turn_and_slow_engine(standin) -> None:  # type: ignore[no-untyped-def]
    trt, server, toy = standin
    trt.faults.drop_after_tokens = 6
    async with bridge_over([adapter(server.url, toy)]) as (_, client):
        ep = (await client.start_episode(list(PROMPT), sampling={"max_tokens": 50, "ignore_eos": True})).episode_id
        with pytest.raises(UnavailableError, match="dropped the stream"):
            await client.step(ep)
        traj = await end_when_idle(client, ep)
        assert traj.turns[0].finish_reason == "abort" and 0 < traj.turns[0].end - traj.turns[0].generation_start < 50
        trt.faults.drop_after_tokens = None
        trt.faults.first_byte_delay_s = 2.0
        ep = (await client.start_episode(list(PROMPT), sampling={"max_tokens": 5})).episode_id
        with pytest.raises(DeadlineExceededError):
            await client.step(ep, timeout=0.3)


async def test_request_timeout_bounds_a_whole_turn_and_a_silent_engine(standin) -> None:  # type: ignore[no-untyped-def]
    trt, server, toy = standin
    toy.config = toy.config.model_copy(update={"token_delay_s": 0.02, "yield_every": 1})
    eng = adapter(server.url, toy, request_timeout_s=0.4)
    got: list[TokenChunk] = []
    with pytest.raises(DeadlineExceeded, match=r"longer than engine\.request_timeout_s"):
        async for chunk in eng.generate(request(max_tokens=1000, ignore_eos=True)):
            got.append(chunk)  # tokens keep flowing, but the turn as a whole is too long
    assert 0 < len(got) < 100
    trt.faults.first_byte_delay_s = 2.0
    with pytest.raises(DeadlineExceeded, match=r"did not start answering|sent nothing"):
        await collect(eng, request(max_tokens=2))
    await eng.close()


async def test_min_p_reaches_the_payload_and_raw_logprobs_are_refused(standin) -> None:  # type: ignore[no-untyped-def]
    trt, server, toy = standin
    eng = adapter(server.url, toy)
    got = await collect(eng, request(seed=4, max_tokens=12, ignore_eos=True, min_p=0.3))
    assert trt.requests[-1]["min_p"] == 0.3
    want = await collect(toy, request(seed=4, max_tokens=12, ignore_eos=True, min_p=0.3))
    assert [t for c in got for t in c.token_ids] == [t for c in want for t in c.token_ids]
    assert [x for c in got for x in c.logprobs] == pytest.approx([x for c in want for x in c.logprobs], abs=1e-12)
    async with bridge_over([eng]) as (_, client):
        with pytest.raises(UnimplementedError, match=r"engine 'trtllm' .* sampling.raw_logprobs .*'raw_logprobs'"):
            await client.start_episode(list(PROMPT), sampling={"raw_logprobs": True})
        ep = (await client.start_episode(list(PROMPT), sampling={"max_tokens": 4})).episode_id
        with pytest.raises(UnimplementedError, match="raw_logprobs"):
            await client.step(ep, sampling={"raw_logprobs": True})
