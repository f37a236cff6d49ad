"""Constrained mode on the embedded SmolLM2 engine (issue 9, AC3): sampled tool calls are never grammar-invalid,
forced tokens carry origin forced (logprob NaN, loss mask 0), and the trajectory carries the mask replay handle.

The volume (40 episodes; 200 until the test-loop issue 33, same assertions) drives the engine directly (one batch of
concurrent requests sharing group prompts); a few episodes go through a real bridge to check the wiring. The prompts
are three-shot tool-call chats whose questions mostly elicit a call; an episode whose reply does not start with a
tag is prose (the mask never engages) and is cut after a few tokens to save time. The same episodes without the
constraint must produce some invalid calls, or the test could not fail.

Measured over 200 episodes (T=0.8, seeds 1000+i, deterministic): constrained, 120 of 200 replies open a call,
111 valid calls, 0 invalid, 9 open at max_tokens (valid prefixes), 1999 forced tokens of 3752 masked positions;
the first 40 episodes unconstrained: 6 valid, 9 invalid calls; ~5 min on the 2-core machine under load (~4 min
of it the constrained episodes; the mask costs ~2 ms per masked position). The test now runs the first 40
constrained and the first 24 unconstrained: the same assertions at a fifth of the time.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from bench import spec_workload as workload
from core.types import FinishReason, GenerateRequest, Message, Origin, SamplingParams
from engines.config import EmbeddedConfig
from speculation.config import SpeculationConfig
from speculation.constraint import GrammarConstraint, replay_masks
from speculation.factory import MASKED_POSITIONS_KEY, SpeculationFactory

pytest.importorskip("torch")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.slow

EPISODES = 40
UNCONSTRAINED = 24  # the first episodes again, without the mask
MAX_TOKENS = 64
TEMPERATURE = 0.8
PROSE_AFTER = 3  # generated tokens after which a reply with no tag is cut (prose: the mask never engages)
BEGIN, END = "<tool_call>", "</tool_call>"
DECODER = json.JSONDecoder()


def _call(name: str, arguments: dict[str, str]) -> Message:
    return Message("assistant", f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>")


SHOTS = (
    Message("user", "How many employees work in the sales department?"),
    _call("sql_query", {"query": "SELECT COUNT(*) FROM employees WHERE department = 'sales'"}),
    Message("tool", "[[12]]"),
    Message("assistant", "There are 12 employees in the sales department."),
    Message("user", "Fetch the page /contact and give me the phone number."),
    _call("fetch_page", {"url": "/contact"}),
    Message("tool", "Phone: 555-0100"),
    Message("assistant", "The phone number is 555-0100."),
    Message("user", "Use Python to compute 2 to the power 10."),
    _call("run_python", {"code": "print(2 ** 10)"}),
    Message("tool", "1024"),
    Message("assistant", "2 to the power 10 is 1024."),
)
QUESTIONS = (  # measured P(reply opens a tag) at T=0.7 with these shots: 0.45 to 0.97
    "Fetch the page /products/blue-widget and tell me its price.",
    "Fetch the page /about and summarise it.",
    "Fetch the page /jobs and list the open positions.",
    "Fetch the page /pricing and tell me the cheapest plan.",
    "How many customers work in the marketing department?",
    "How many customers live in Paris?",
)


def _messages(i: int) -> list[Message]:
    return [*SHOTS, Message("user", QUESTIONS[i % len(QUESTIONS)])]


@dataclass
class Outcome:
    ids: list[int]
    logprobs: list[float]
    origins: list[Origin]
    constraint: GrammarConstraint | None
    prose: bool = False
    cut: bool = False  # ended by max_tokens


@dataclass
class Tally:
    episodes: int = 0
    opened: int = 0  # episodes whose reply opened a tool-call block
    complete: int = 0  # blocks that are valid calls
    invalid: int = 0  # blocks that are not: bad JSON, not the tools' schemas, no end tag (and not cut)
    cut: int = 0  # blocks left open by max_tokens
    prose: int = 0
    forced: int = 0
    masked: int = 0
    examples: list[str] | None = None


def _blocks(text: str, cut: bool) -> tuple[list[str], int]:
    """(the tool-call blocks of ``text`` that are not valid calls, blocks read); a last block left open by
    max_tokens (``cut``) is not read. The JSON is read before the end tag: a string value may itself hold
    ``</tool_call>`` (the grammar allows it), so a block does not end at the first end tag."""
    schema = workload.grammar().call_schema()
    bad: list[str] = []
    count, pos = 0, 0
    while (start := text.find(BEGIN, pos)) >= 0:
        i = start + len(BEGIN)
        i += len(text[i:]) - len(text[i:].lstrip())
        try:
            value, end = DECODER.raw_decode(text, i)
            end += len(text[end:]) - len(text[end:].lstrip())
            if not text.startswith(END, end):
                raise ValueError("no end tag after the call")
            for entry in value if isinstance(value, list) else [value]:
                jsonschema.validate(entry, schema)
            pos = end + len(END)
        except (ValueError, jsonschema.ValidationError):  # JSONDecodeError is a ValueError
            if cut and text.find(BEGIN, i) < 0:
                return bad, count  # the last block, open at max_tokens (its text may hold an end tag)
            close = text.find(END, i)
            bad.append(text[start : start + 200])
            pos = len(text) if close < 0 else close + len(END)
        count += 1
    return bad, count


def _tally(outcomes: list[Outcome], decode: Any) -> Tally:
    t = Tally(examples=[])
    for o in outcomes:
        text = decode(o.ids)
        bad, count = _blocks(text, o.cut)
        t.episodes += 1
        t.prose += o.prose
        t.opened += BEGIN in text
        t.forced += o.origins.count(Origin.FORCED)
        t.masked += len(o.constraint.steps) if o.constraint is not None else 0
        t.complete += count - len(bad)
        t.invalid += len(bad)
        t.cut += count < text.count(BEGIN)
        t.examples += bad  # type: ignore[operator]
    return t


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engine() -> AsyncIterator[Any]:
    from engines.embedded.engine import EmbeddedEngine

    eng = await EmbeddedEngine.start(EmbeddedConfig(max_model_len=2048, max_batch_size=32))
    yield eng
    await eng.close()


async def _run(engine: Any, prompt: list[int], i: int, constraint: GrammarConstraint | None, tag: str) -> Outcome:
    # Same group id and salt in both runs: each question's prompt is prefilled once and forked.
    req = GenerateRequest(
        f"{tag}-{i}",
        tuple(prompt),
        SamplingParams(temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=1000 + i),
        episode_id=f"{tag}-{i}",
        group_id=f"q{i % len(QUESTIONS)}",
        cache_salt="constrained-test",
        constraint=constraint,
    )
    out = Outcome([], [], [], constraint)
    stream = engine.generate(req)
    try:
        async for chunk in stream:
            out.ids.extend(chunk.token_ids)
            out.logprobs.extend(chunk.logprobs)
            out.origins.extend(chunk.origins_or_sampled())
            out.cut = chunk.finish_reason == FinishReason.LENGTH
            if len(out.ids) >= PROSE_AFTER and not engine.tokenizer.decode(out.ids).lstrip().startswith("<"):
                out.prose = True
                break
    finally:
        await stream.aclose()  # a prose reply cut early: the engine drops it at the next token boundary
    return out


@pytest.mark.timeout(1800)  # ~2 min on a shared 2-core machine
async def test_constrained_mode_never_emits_an_invalid_tool_call(engine: Any) -> None:
    hf = engine.tokenizer._tok
    factory = SpeculationFactory(SpeculationConfig(enabled=True, mode="constrained"), hf)
    schemas = workload.tool_schemas()
    prompts = [engine.tokenizer.render_prompt(_messages(i), list(schemas)) for i in range(EPISODES)]

    t0 = time.perf_counter()
    constraints = [factory.constraint(schemas) for _ in prompts]
    runs = (_run(engine, p, i, c, "on") for i, (p, c) in enumerate(zip(prompts, constraints, strict=True)))
    done = await asyncio.gather(*runs)
    on_s = time.perf_counter() - t0
    on = _tally(done, engine.tokenizer.decode)

    compiled = factory.compiled(schemas)
    assert compiled is not None
    for i, o in enumerate(done):
        assert o.constraint is not None
        text = engine.tokenizer.decode(o.ids)
        n = len(prompts[i])
        # Origins follow the mask: forced exactly where one token was allowed; NaN logprob and no loss there.
        for k, (origin, lp) in enumerate(zip(o.origins, o.logprobs, strict=True)):
            allowed = o.constraint.steps.get(n + k)
            assert (origin == Origin.FORCED) == (allowed == 1), (i, k, text)
            assert math.isnan(lp) if origin == Origin.FORCED else math.isfinite(lp)
            assert origin in (Origin.SAMPLED, Origin.FORCED) and (origin.policy_sampled != (origin == Origin.FORCED))
        if o.constraint.tracker.in_span:  # open at max_tokens: the span so far is a valid prefix of a call
            tail = o.ids[o.constraint.tracker.span_start - n :]
            assert o.cut and compiled.matcher().validate_tokens(tail) == len(tail), text
        if i < 20:  # the replay handle rebuilds exactly the masks applied while decoding
            masks = replay_masks(compiled, [*prompts[i], *o.ids], n, n + len(o.ids))
            assert {p: len(m) for p, m in masks.items()} == o.constraint.steps
            assert all(o.ids[p - n] in m for p, m in masks.items())

    print(f"\nconstrained: {on} in {on_s:.0f} s")
    assert on.invalid == 0, on.examples
    assert on.complete >= EPISODES // 3 and on.forced > on.complete * 5, on  # keys, names, tags are forced

    t0 = time.perf_counter()
    plain = await asyncio.gather(*(_run(engine, prompts[i], i, None, "off") for i in range(UNCONSTRAINED)))
    off_s = time.perf_counter() - t0
    off = _tally(plain, engine.tokenizer.decode)
    print(f"unconstrained: {off} in {off_s:.0f} s")
    assert off.forced == 0 and off.masked == 0
    assert off.invalid > 0, off  # without the mask the same episodes do write invalid calls: the test can fail


async def test_bridge_constrained_episodes_record_forced_tokens_and_masks(start_bridge: Any) -> None:
    """Through the bridge: forced tokens are origin forced with loss mask 0 and logprob NaN; the trajectory
    metadata holds every masked position, and replaying the grammar over the tokens gives the same masks."""
    server, client = await start_bridge(
        engine={"type": "embedded", "embedded": {"max_model_len": 2048}},
        speculation={"enabled": True, "mode": "constrained"},
    )
    factory = server.bridge.speculation
    assert factory is not None
    compiled = factory.compiled(workload.tool_schemas())
    assert compiled is not None
    calls = 0
    for i in range(4):
        messages = [{"role": m.role, "content": m.content} for m in _messages(i)]
        started = await client.start_episode(
            messages,
            tools=list(workload.tool_schemas()),
            sampling={"temperature": TEMPERATURE, "max_tokens": MAX_TOKENS, "seed": 7 + i},
        )
        await client.step(started.episode_id)
        t = await client.end_episode(started.episode_id)
        names = t.origin_names()
        forced = np.array([n == "forced" for n in names])
        assert not t.loss_mask[forced].any() and np.isnan(t.logprobs[forced]).all()
        turn = t.turns[0]
        steps = {int(p): c for p, c in json.loads(t.metadata.get(MASKED_POSITIONS_KEY, "{}")).items()}
        assert {p for p, c in steps.items() if c == 1} == set(np.flatnonzero(forced).tolist())
        ids = t.token_ids.tolist()
        masks = replay_masks(compiled, ids, turn.generation_start, turn.end)
        assert {p: len(m) for p, m in masks.items()} == steps
        text = server.bridge.tokenizer.decode(ids[turn.generation_start : turn.end])
        bad, count = _blocks(text, turn.finish_reason == "length")
        assert not bad, bad
        calls += count
    print(f"\nbridge: {calls} valid calls in 4 constrained episodes")
    assert calls >= 1  # the questions elicit calls
