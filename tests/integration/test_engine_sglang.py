"""The SGLang adapter against the SGLang stand-in (its documented /generate wire format, quirks included).

SGLang cannot run on this CPU-only machine: these tests check the adapter's contract with a
faithful stand-in backed by a real engine (the toy model; see tests/standins/sglang.py).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from core.errors import (
    DeadlineExceeded,
    EngineProtocolError,
    EngineUnavailable,
    InvalidArgument,
    TokenOutOfVocabulary,
)
from core.types import (
    Capability,
    FinishReason,
    GenerateRequest,
    ModelFacts,
    SamplingParams,
    TokenChunk,
    WeightUpdate,
)
from engines.config import SglangConfig, ToyConfig
from engines.http.sglang import SglangEngine
from engines.toy import ToyEngine
from rl_client.errors import AbortedError, DeadlineExceededError, UnavailableError
from tests.integration.engine_script import bridge_over, end_when_idle, run_episode_script
from tests.standins._common import StandinServer
from tests.standins.sglang import SglangStandin

PROMPT = (1, 4, 30, 31, 32, 2, 5)


def adapter(url: str, toy: ToyEngine, replica: str = "sglang-0", **config: object) -> SglangEngine:
    facts = ModelFacts("toy", toy.info.vocab_size, toy.info.eos_token_ids, toy.info.max_model_len)
    return SglangEngine(
        url,
        SglangConfig.model_validate({"connect_retries": 0, **config}),
        facts,
        model="toy",
        tokenizer=toy.tokenizer,
        request_timeout_s=30,
        replica=replica,
    )


@pytest.fixture
async def standin() -> AsyncIterator[tuple[SglangStandin, StandinServer, ToyEngine]]:
    toy = ToyEngine(ToyConfig(yield_every=3))
    sg = SglangStandin(toy, served_model_name="toy")
    server = await sg.serve()
    yield sg, server, toy
    await server.stop()


async def collect(engine: SglangEngine | ToyEngine, request: GenerateRequest) -> list[TokenChunk]:
    return [c async for c in engine.generate(request)]


def request(rid: str = "r1", **params: object) -> GenerateRequest:
    return GenerateRequest(rid, PROMPT, SamplingParams(**params), cache_salt="toy||0")  # type: ignore[arg-type]


async def test_request_uses_sglang_field_names_and_sends_every_knob(standin) -> None:  # type: ignore[no-untyped-def]
    sg, server, toy = standin
    eng = adapter(server.url, toy)
    await collect(eng, request(seed=5, max_tokens=4, stop_token_ids=(9,), top_k=7))
    body = sg.requests[-1]
    assert body["input_ids"] == list(PROMPT) and body["rid"] == "r1" and body["stream"] is True
    assert body["return_logprob"] is True and body["logprob_start_len"] == -1 and body["cache_salt"] == "toy||0"
    sp = body["sampling_params"]
    assert sp["sampling_seed"] == 5 and "seed" not in sp
    assert sp["max_new_tokens"] == 4 and sp["top_k"] == 7 and sp["stop_token_ids"] == [9] and sp["no_stop_trim"]
    for knob in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
        assert knob in sp
    await collect(eng, request(rid="r2", top_k=0, max_tokens=2))
    assert sg.requests[-1]["sampling_params"]["top_k"] == -1  # SGLang's "all", not 0
    await eng.close()


@pytest.mark.parametrize("incremental", [False, True])
async def test_stream_equals_the_backing_engine(standin, incremental: bool) -> None:  # type: ignore[no-untyped-def]
    sg, server, toy = standin
    sg.incremental_streaming = incremental
    eng = adapter(server.url, toy, incremental_streaming=incremental)
    got = await collect(eng, request(seed=3, max_tokens=20, ignore_eos=True))
    want = await collect(toy, request(seed=3, max_tokens=20, ignore_eos=True))
    assert [t for c in got for t in c.token_ids] == [t for c in want for t in c.token_ids]
    assert [x for c in got for x in c.logprobs] == pytest.approx([x for c in want for x in c.logprobs], abs=1e-12)
    assert len(got) > 2  # really streamed, one chunk per cumulative event
    assert got[-1].finish_reason == FinishReason.LENGTH
    assert got[-1].usage is not None and got[-1].usage.generated_tokens == 20 and got[-1].usage.prompt_tokens == 7
    assert all(c.finish_reason is None for c in got[:-1])
    await eng.close()


async def test_stop_token_finish_object_and_greedy(standin) -> None:  # type: ignore[no-untyped-def]
    _, server, toy = standin
    eng = adapter(server.url, toy)
    greedy = await collect(toy, request(temperature=0.0, max_tokens=30, ignore_eos=True))
    ids = [t for c in greedy for t in c.token_ids]
    stop = ids[5]
    got = await collect(eng, request(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=(stop,)))
    out = [t for c in got for t in c.token_ids]
    assert out == ids[: ids.index(stop) + 1]  # the stop token is kept (no_stop_trim)
    assert got[-1].finish_reason == FinishReason.STOP
    await eng.close()


async def test_episode_script_through_the_bridge(standin) -> None:  # type: ignore[no-untyped-def]
    _, server, toy = standin
    async with bridge_over([adapter(server.url, toy)]) as (bridge, client):
        result = await run_episode_script(client)
        assert result["started"].engine == "sglang"
        assert bridge.bridge.engines[0].counters.requests == 3


async def test_a_group_sends_one_member_ahead_until_its_first_token(standin) -> None:  # type: ignore[no-untyped-def]
    """SGLang does not declare GROUP_PREFILL: of a group's members stepping at once, the bridge sends one, and
    the others together once its first token is back (its prompt is then in the engine's prefix cache)."""
    sg, server, toy = standin
    sg.faults.first_byte_delay_s = 0.4  # the leader's prefill
    async with bridge_over([adapter(server.url, toy)]) as (_, client):
        started = await client.start_episode(list(PROMPT), sampling={"max_tokens": 3, "seed": 1}, group_size=4)
        await asyncio.gather(*(client.step(ep) for ep in started.episode_ids))
        second = await client.step(started.episode_ids[0], [7, 8])  # later turns are never held back
    first, *members = sg.arrivals[:4]
    assert all(t - first >= 0.4 for t in members), [round(t - first, 3) for t in sg.arrivals]
    assert max(members) - min(members) < 0.4, [round(t - first, 3) for t in sg.arrivals]  # together, not in turn
    assert len(sg.arrivals) == 5 and second.token_ids.size == 3


async def test_abort_posts_abort_request_and_ends_with_abort(standin) -> None:  # type: ignore[no-untyped-def]
    sg, server, toy = standin
    toy.config = toy.config.model_copy(update={"token_delay_s": 0.01, "yield_every": 1})
    eng = adapter(server.url, toy)
    chunks = []
    async for chunk in eng.generate(request(rid="slow", max_tokens=2000, ignore_eos=True)):
        chunks.append(chunk)
        if len(chunks) == 3:
            await eng.abort("slow")
    assert chunks[-1].finish_reason == FinishReason.ABORT
    assert 3 <= sum(len(c.token_ids) for c in chunks) < 100
    assert sg.running == 0
    await eng.close()


async def test_unrequested_abort_is_an_aborted_error(standin) -> None:  # type: ignore[no-untyped-def]
    sg, server, toy = standin
    toy.config = toy.config.model_copy(update={"token_delay_s": 0.01, "yield_every": 1})
    eng = adapter(server.url, toy)
    async with bridge_over([eng]) as (_, client):
        ep = (await client.start_episode(list(PROMPT), sampling={"max_tokens": 500, "ignore_eos": True})).episode_id
        step = asyncio.create_task(client.step(ep))
        for _ in range(500):  # until the turn is running on the engine
            if sg._rids:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        async with httpx.AsyncClient() as http:  # someone else aborts all requests on the engine
            (await http.post(f"{server.url}/abort_request", json={"rid": "", "abort_all": True})).raise_for_status()
        with pytest.raises(AbortedError) as err:
            await step
        assert "sglang replica sglang-0" in err.value.details and "Abort in waiting queue" in err.value.details
        traj = await end_when_idle(client, ep)
        assert traj.turns[0].finish_reason == "abort" and traj.turns[0].end > traj.turns[0].generation_start


async def test_weight_update_sends_version_and_flush(standin) -> None:  # type: ignore[no-untyped-def]
    """What the stand-in received: the update's version and flush, then the new version's salt."""
    sg, server, toy = standin
    eng = adapter(server.url, toy)
    unsalted = GenerateRequest("u0", PROMPT, SamplingParams(seed=1, max_tokens=8, ignore_eos=True))
    before = await collect(eng, unsalted)
    assert sg.requests[-1]["cache_salt"] == "toy||0" and sg.received[-1].cache_salt == "toy||0"
    await eng.update_weights(WeightUpdate("/", 1))
    assert eng.policy_version == 1 and sg.weight_version == "1" and toy.policy_version == 1
    assert sg.weight_updates[-1]["weight_version"] == "1" and sg.weight_updates[-1]["flush_cache"] is True
    assert sg.flushes == ["update_weights_from_disk"]
    after = await collect(eng, GenerateRequest("u1", PROMPT, SamplingParams(seed=1, max_tokens=8, ignore_eos=True)))
    assert after[-1].policy_version == 1
    # The salt is the adapter's own (no salt in the request), and it reached the backing engine.
    assert sg.requests[-1]["cache_salt"] == "toy||1" and sg.received[-1].cache_salt == "toy||1"
    assert [x for c in before for x in c.logprobs] != [x for c in after for x in c.logprobs]
    await eng.update_weights(WeightUpdate("/", 2, keep_kv=True))
    assert sg.weight_updates[-1]["flush_cache"] is False and sg.flushes == ["update_weights_from_disk"]
    with pytest.raises(InvalidArgument, match=r"could not load|does not exist"):
        await eng.update_weights(WeightUpdate("/no/such/dir", 3))
    assert eng.policy_version == 2 and sg.flushes == ["update_weights_from_disk"]
    await collect(eng, GenerateRequest("b", PROMPT, SamplingParams(max_tokens=2), cache_salt="toy||2"))
    assert sg.requests[-1]["cache_salt"] == "toy||2" and sg.received[-1].cache_salt == "toy||2"  # used as given
    await collect(eng, request(rid="stale"))  # a salt naming an older version is moved to the one running
    assert sg.requests[-1]["cache_salt"] == "toy||2" and sg.received[-1].cache_salt == "toy||2"
    await eng.close()


def slow(toy: ToyEngine) -> None:
    toy.config = toy.config.model_copy(update={"token_delay_s": 0.01, "yield_every": 1})


async def test_update_waits_for_the_turn_in_flight_so_no_turn_straddles_versions(standin) -> None:  # type: ignore[no-untyped-def]
    sg, server, toy = standin
    slow(toy)
    eng = adapter(server.url, toy)
    stream = eng.generate(GenerateRequest("long", PROMPT, SamplingParams(max_tokens=40, ignore_eos=True)))
    chunks = [await anext(stream)]  # the turn is running on the engine
    update = asyncio.create_task(eng.update_weights(WeightUpdate("/", 1)))
    # A turn asked for while the update is pending is held, then runs on the new weights.
    later = asyncio.create_task(collect(eng, request(rid="later", max_tokens=3)))
    await asyncio.sleep(0.1)
    assert not update.done() and not sg.weight_updates and len(sg.requests) == 1  # nothing reached the engine
    chunks += [c async for c in stream]
    await update
    assert [c.policy_version for c in chunks] == [0] * len(chunks) and chunks[-1].finish_reason == FinishReason.LENGTH
    assert sum(len(c.token_ids) for c in chunks) == 40
    assert sg.weight_updates[0]["running"] == 0  # the engine reloaded with nothing in flight
    held = await later
    assert {c.policy_version for c in held} == {1}
    # It carried the bridge's salt for version 0 ("toy||0"); it ran on version 1, so it is salted "toy||1".
    assert sg.requests[-1]["rid"] == "later" and sg.requests[-1]["cache_salt"] == "toy||1"
    assert sg.received[-1].cache_salt == "toy||1"
    await eng.close()


async def test_update_aborts_turns_still_running_at_the_weight_update_timeout(standin) -> None:  # type: ignore[no-untyped-def]
    sg, server, toy = standin
    slow(toy)
    eng = adapter(server.url, toy, weight_update_timeout_s=0.3)
    stream = eng.generate(GenerateRequest("endless", PROMPT, SamplingParams(max_tokens=2000, ignore_eos=True)))
    chunks = [await anext(stream)]
    update = asyncio.create_task(eng.update_weights(WeightUpdate("/", 1)))
    chunks += [c async for c in stream]
    await asyncio.wait_for(update, 5)
    assert chunks[-1].finish_reason == FinishReason.ABORT and {c.policy_version for c in chunks} == {0}
    assert sum(len(c.token_ids) for c in chunks) < 200
    assert sg.weight_updates[0]["running"] == 0 and eng.policy_version == 1
    await eng.close()


async def test_abort_before_the_response_headers_stops_the_stream_once_it_opens(standin) -> None:  # type: ignore[no-untyped-def]
    sg, server, toy = standin
    slow(toy)
    sg.faults.first_byte_delay_s = 0.3
    eng = adapter(server.url, toy)
    turn = asyncio.create_task(collect(eng, request(rid="early", max_tokens=300, ignore_eos=True)))
    for _ in range(200):  # until the engine has the request, but has not answered yet
        if sg.requests:
            break
        await asyncio.sleep(0.01)
    await eng.abort("early")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    chunks = await asyncio.wait_for(turn, 10)
    assert chunks[-1].finish_reason == FinishReason.ABORT
    assert sum(len(c.token_ids) for c in chunks) < 30 and loop.time() - t0 < 1.5  # not 300 tokens x 10 ms
    for _ in range(100):
        if not sg.running:
            break
        await asyncio.sleep(0.01)
    assert sg.running == 0  # the engine-side request is gone too
    await eng.close()


async def test_keep_alive_comments_cannot_extend_a_turn_past_request_timeout(standin) -> None:  # type: ignore[no-untyped-def]
    sg, server, toy = standin
    sg.faults.keepalive_stall_s = 4.0
    eng = SglangEngine(
        server.url,
        SglangConfig(connect_retries=0),
        ModelFacts("toy", toy.info.vocab_size, toy.info.eos_token_ids, toy.info.max_model_len),
        model="toy",
        request_timeout_s=0.5,
        replica="sglang-0",
    )
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(DeadlineExceeded, match=r"request_timeout_s = 0.5 s for one turn"):
        await collect(eng, request(max_tokens=4))
    assert loop.time() - t0 < 1.5  # the 50 ms comments keep the read timeout from firing
    assert eng.counters.extra["errors_deadline_exceeded"] == 1
    await eng.close()


async def test_replica_label_and_errors_never_show_url_credentials_or_query() -> None:
    toy = ToyEngine(ToyConfig())
    facts = ModelFacts("toy", toy.info.vocab_size, toy.info.eos_token_ids, toy.info.max_model_len)
    url = "http://trainer:s3cret@127.0.0.1:9/sglang?api_key=k3y#kv-events=tcp://127.0.0.1:19"
    eng = SglangEngine(url, SglangConfig(connect_retries=0), facts, model="toy")  # no replica name: the URL is it
    for text in (eng.label, eng.info.replica):
        assert "s3cret" not in text and "k3y" not in text and "trainer" not in text and "kv-events" not in text
    assert eng.label == "sglang replica http://127.0.0.1:9/sglang (http://127.0.0.1:9/sglang)"
    with pytest.raises(EngineUnavailable) as err:
        await collect(eng, request())
    assert "s3cret" not in err.value.message and "k3y" not in err.value.message
    assert "127.0.0.1:9/sglang" in err.value.message
    await eng.close()


async def test_errors_are_mapped(standin) -> None:  # type: ignore[no-untyped-def]
    sg, server, toy = standin
    eng = adapter(server.url, toy)
    with pytest.raises(TokenOutOfVocabulary, match="out of vocabulary"):
        await collect(eng, GenerateRequest("oov", (1, 99999), SamplingParams(max_tokens=2)))
    with pytest.raises(InvalidArgument, match="context"):
        await collect(eng, GenerateRequest("long", (1,) * 5000, SamplingParams(max_tokens=2)))
    sg.faults.malformed = "field"
    with pytest.raises(EngineProtocolError, match=r"sglang replica sglang-0 .*`output_ids\[0\]`"):
        await collect(eng, request(max_tokens=4))
    sg.faults.malformed = "json"
    with pytest.raises(EngineProtocolError, match="not valid JSON"):
        await collect(eng, request(max_tokens=4))
    sg.faults.malformed = ""
    async with httpx.AsyncClient() as http:  # the stand-in is strict about sampling_params keys
        r = await http.post(f"{server.url}/generate", json={"input_ids": [1], "sampling_params": {"seed": 1}})
        assert r.status_code == 400 and "seed" in r.json()["error"]["message"]
    stats = await eng.cache_stats()
    assert stats["sglang:prompt_tokens_total"] >= 0 and "sglang:cached_tokens_total" in stats
    assert (await eng.health()).healthy and eng.counters.extra["engine_prompt_tokens"] > 0
    assert eng.counters.extra["errors_invalid_argument"] == 2 and eng.counters.extra["errors_unavailable"] == 2
    await eng.close()


async def test_engine_dies_mid_turn_keeps_partial_tokens(standin) -> None:  # type: ignore[no-untyped-def]
    sg, server, toy = standin
    sg.faults.drop_after_tokens = 6
    async with bridge_over([adapter(server.url, toy)]) as (_, client):
        ep = (await client.start_episode(list(PROMPT), sampling={"max_tokens": 50, "ignore_eos": True})).episode_id
        with pytest.raises(UnavailableError) as err:
            await client.step(ep)
        assert "dropped the stream" in err.value.details
        traj = await end_when_idle(client, ep)
        (turn,) = traj.turns
        assert turn.finish_reason == "abort" and 0 < turn.end - turn.generation_start < 50
        assert traj.loss_mask[turn.generation_start : turn.end].all()


async def test_slow_engine_deadline_is_honoured(standin) -> None:  # type: ignore[no-untyped-def]
    sg, server, toy = standin
    sg.faults.first_byte_delay_s = 2.0
    async with bridge_over([adapter(server.url, toy)]) as (_, client):
        ep = (await client.start_episode(list(PROMPT), sampling={"max_tokens": 5})).episode_id
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(DeadlineExceededError):
            await client.step(ep, timeout=0.3)
        assert loop.time() - t0 < 1.5


async def test_unreachable_engine_is_not_serving_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    toy = ToyEngine(ToyConfig())
    eng = adapter("http://127.0.0.1:9", toy)  # nothing listens on the discard port
    await eng.start()
    health = await eng.health()
    assert not health.healthy and "sglang replica sglang-0" in health.detail and "not reachable" in health.detail
    with pytest.raises(EngineUnavailable, match="not reachable"):
        await collect(eng, request())
    async with bridge_over([eng]) as (bridge, _):
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{bridge.port}")
        resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        await channel.close()
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert any("not reachable" in r.getMessage() for r in caplog.records)


def test_logprob_encodings_are_normalised() -> None:
    toy = ToyEngine(ToyConfig())
    w = adapter("http://127.0.0.1:9", toy).wire
    assert w.logprob(None, "x") == -math.inf  # orjson's NaN/inf
    assert w.logprob(-9999.0, "x") == -math.inf  # vLLM / TRT-LLM clamp
    assert w.logprob(-3.4028234663852886e38, "x") == -math.inf  # llama.cpp FLT_LOWEST
    assert w.logprob(-0.5, "x") == -0.5
    with pytest.raises(EngineProtocolError, match="not a log-probability"):
        w.logprob(0.7, "meta_info.output_token_logprobs[0][0]")


@pytest.fixture(scope="module")
async def smollm2() -> AsyncIterator[object]:
    from engines.config import EmbeddedConfig
    from engines.embedded.engine import EmbeddedEngine

    engine = await EmbeddedEngine.start(EmbeddedConfig(max_model_len=2048), model="smollm2")
    yield engine
    await engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["embedded", "sglang", "trtllm"])
async def test_same_script_on_smollm2_embedded_and_both_standins(smollm2, kind: str) -> None:  # type: ignore[no-untyped-def]
    """The episode script, unchanged, on the real model: in process, and behind each stand-in.

    Behind a stand-in the adapter is built from settings the way `primerl serve` builds it
    (`make_engines`: tokenizer and model facts from the model store, served name from /v1/models).
    """
    from engines import make_engines
    from engines.config import EngineConfig
    from tests.standins.trtllm import TrtllmStandin

    if kind == "embedded":  # its own instance: the bridge closes its engines when it stops
        from engines.config import EmbeddedConfig
        from engines.embedded.engine import EmbeddedEngine

        embedded = await EmbeddedEngine.start(EmbeddedConfig(max_model_len=2048), model="smollm2")
        async with bridge_over([embedded]) as (_, client):
            await run_episode_script(client, max_tokens=4)
        return
    standin = (SglangStandin if kind == "sglang" else TrtllmStandin)(smollm2, served_model_name="smollm2")
    server = await standin.serve()
    try:
        engines = await make_engines(EngineConfig(type=kind, urls=[server.url], model="smollm2"))  # type: ignore[arg-type]
        assert engines[0].info.vocab_size == 49152 and engines[0].tokenizer is not None
        async with bridge_over(engines) as (_, client):
            result = await run_episode_script(client, max_tokens=4)
        assert result["started"].engine == kind
        assert standin.requests  # really went through the stand-in
    finally:
        await server.stop()


async def test_replicas_are_sticky_per_episode() -> None:
    toys = [ToyEngine(ToyConfig()), ToyEngine(ToyConfig())]
    standins = [SglangStandin(t, served_model_name="toy") for t in toys]
    servers = [await s.serve() for s in standins]
    try:
        engines = [adapter(srv.url, toy, f"sglang-{i}") for i, (srv, toy) in enumerate(zip(servers, toys, strict=True))]
        async with bridge_over(engines) as (_, client):
            eps = [await client.start_episode(list(PROMPT), sampling={"max_tokens": 3}) for _ in range(2)]
            assert {e.replica for e in eps} == {"sglang-0", "sglang-1"}  # least loaded: one each
            for e in eps:
                for _ in range(3):
                    await client.step(e.episode_id, [2, 5])
            for i, e in enumerate(eps):
                replica = int(e.replica[-1])
                assert len(standins[replica].requests) == 3 and toys[replica].counters.requests == 3, i
    finally:
        for srv in servers:
            await srv.stop()


async def test_standin_follows_sglang_shapes(standin) -> None:  # type: ignore[no-untyped-def]
    """The stand-in's own fidelity: n>1 arrays with suffixed rids, cumulative events, null -inf, [DONE]."""
    _, server, _ = standin
    body = {
        "input_ids": list(PROMPT),
        "rid": "g",
        "sampling_params": {"n": 2, "max_new_tokens": 4, "sampling_seed": 1, "ignore_eos": True},
        "return_logprob": True,
    }
    async with httpx.AsyncClient(base_url=server.url) as http:
        out = (await http.post("/generate", json=body)).json()
        assert isinstance(out, list) and [o["meta_info"]["id"] for o in out] == ["g_0", "g_1"]
        for o in out:
            assert o["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
            assert [t[1] for t in o["meta_info"]["output_token_logprobs"]] == o["output_ids"]
            assert o["meta_info"]["input_token_logprobs"] == [[None, PROMPT[-1], None]]
        events = []
        single = {**body, "stream": True, "sampling_params": {**body["sampling_params"], "n": 1, "max_new_tokens": 7}}
        async with http.stream("POST", "/generate", json=single) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
    assert events[-1] == "[DONE]"
    ids = [json.loads(e)["output_ids"] for e in events[:-1]]
    assert len(ids) > 1 and all(ids[i] == ids[i + 1][: len(ids[i])] for i in range(len(ids) - 1))  # cumulative
    assert len(ids[-1]) == 7


async def test_min_p_reaches_sampling_params_and_the_engine(standin) -> None:  # type: ignore[no-untyped-def]
    sg, server, toy = standin
    eng = adapter(server.url, toy)
    got = await collect(eng, request(seed=4, max_tokens=12, ignore_eos=True, min_p=0.3))
    assert sg.requests[-1]["sampling_params"]["min_p"] == 0.3
    want = await collect(toy, request(seed=4, max_tokens=12, ignore_eos=True, min_p=0.3))
    assert [t for c in got for t in c.token_ids] == [t for c in want for t in c.token_ids]
    assert [x for c in got for x in c.logprobs] == pytest.approx([x for c in want for x in c.logprobs], abs=1e-12)
    assert not eng.info.capabilities >= {Capability.RAW_LOGPROBS}  # refused by the bridge (check_capabilities)
    await eng.close()
