"""Drafters and tool-call grammars (llguidance on the SmolLM2 tokenizer): what they propose, not how it's verified."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bench import spec_workload as workload
from core.toolcall import parse_tool_calls
from envhub.grammar import grammar_for
from speculation.config import SpeculationConfig
from speculation.drafters import NgramIndex, SpeculativeDrafter
from speculation.grammar import CompiledToolGrammar, ll_tokenizer

pytestmark = pytest.mark.slow  # loads the SmolLM2 tokenizer (seconds, more on a busy machine)

CALL = '\n<tool_call>\n{"name": "sql_query", "arguments": {"query": "SELECT name FROM customers"}}\n</tool_call>'


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    transformers = pytest.importorskip("transformers")
    from engines.model_store import ensure_converted

    return transformers.AutoTokenizer.from_pretrained(ensure_converted())


@pytest.fixture(scope="module")
def compiled(hf_tokenizer: Any) -> CompiledToolGrammar:
    return CompiledToolGrammar(workload.grammar(), ll_tokenizer(hf_tokenizer))


def test_ngram_index_finds_latest_earlier_occurrence() -> None:
    idx = NgramIndex(1, 3)
    assert idx.lookup([5, 6, 7, 8, 5, 6], 3) == (7, 8, 5)
    assert idx.lookup([5, 6, 7, 8, 5, 6, 9], 2) == ()  # (6, 9) and (9,) never occurred before
    idx2 = NgramIndex(1, 2)
    assert idx2.lookup([1, 2, 1, 3, 1], 2) == (3, 1)  # latest occurrence of (1,) wins
    assert idx2.lookup([1, 2, 1, 3, 1, 2], 5) == (1, 3, 1, 2)  # (1, 2) occurred at the start


def test_grammar_accepts_envhub_calls_and_rejects_unknown_tools(
    compiled: CompiledToolGrammar, hf_tokenizer: Any
) -> None:
    ids = hf_tokenizer.encode(CALL)
    assert compiled.accepts(ids)
    parsed = parse_tool_calls(hf_tokenizer.decode(ids))
    assert parsed is not None and parsed.calls[0].name == "sql_query"
    listed = "<tool_call>\n[" + json.dumps({"name": "fetch_page", "arguments": {"url": "/a"}}) + "]\n</tool_call>"
    assert compiled.accepts(hf_tokenizer.encode(listed))
    assert not compiled.accepts(hf_tokenizer.encode(CALL.replace("sql_query", "drop_table")))
    assert not compiled.accepts(hf_tokenizer.encode(CALL.replace('"query"', '"sql"')))


def test_grammar_drafter_drafts_forced_tokens_of_the_canonical_tokenisation(
    compiled: CompiledToolGrammar, hf_tokenizer: Any
) -> None:
    prompt = hf_tokenizer.encode("Question: list customers.")
    target = hf_tokenizer.encode(CALL)
    drafter = SpeculativeDrafter(SpeculationConfig(drafters=("grammar",), max_draft_tokens=16), compiled)
    history = list(prompt)
    drafted = matched = 0
    i = 0
    while i < len(target):
        draft = drafter.draft(history, 64)
        n = 0
        while n < len(draft) and i + n < len(target) and draft[n] == target[i + n]:
            n += 1
        drafted += len(draft)
        matched += n
        drafter.feedback(len(draft), n)
        history += target[i : i + n + 1]  # accepted prefix, then the "model's" own next token
        i += n + 1
    drafter.draft(history, 0)  # the tracker follows the history it is shown
    assert drafter.tracker is not None and drafter.stats.spans_completed == 1
    assert drafted > 10 and matched == drafted  # every forced token is the one the text uses
    assert drafter.stats.spans_opened == 1 and not drafter.tracker.in_span


def test_span_is_abandoned_when_the_policy_leaves_the_grammar(compiled: CompiledToolGrammar, hf_tokenizer: Any) -> None:
    drafter = SpeculativeDrafter(SpeculationConfig(), compiled)
    history = hf_tokenizer.encode("Hi.")
    drafter.draft(history, 8)
    history += hf_tokenizer.encode("\n<b>bold</b>")
    drafter.draft(history, 8)
    assert drafter.stats.spans_opened == 1 and drafter.stats.spans_abandoned == 1
    assert drafter.tracker is not None and not drafter.tracker.in_span


def test_ngram_drafts_inside_a_span_are_cut_to_the_grammar(compiled: CompiledToolGrammar, hf_tokenizer: Any) -> None:
    # The prompt holds the question; the call's argument copies it, and the n-gram drafter proposes the copy.
    prompt = hf_tokenizer.encode("User: SELECT name FROM customers WHERE city = 'Paris'\n")
    head = hf_tokenizer.encode('\n<tool_call>\n{"name": "sql_query", "arguments": {"query": "SELECT name')
    drafter = SpeculativeDrafter(SpeculationConfig(max_draft_tokens=8), compiled)
    drafter.draft(prompt, 8)
    draft = drafter.draft(prompt + head, 8)
    assert hf_tokenizer.decode(list(draft)).startswith(" FROM customers")
    assert compiled.matcher().validate_tokens(head + list(draft)) == len(head) + len(draft)


def test_gate_closes_outside_spans_and_reopens_at_a_tool_call(compiled: CompiledToolGrammar, hf_tokenizer: Any) -> None:
    cfg = SpeculationConfig(gate_min_samples=4, gate_min_acceptance=0.5)
    drafter = SpeculativeDrafter(cfg, compiled)
    history = hf_tokenizer.encode("a b a b a b a b")
    assert drafter.draft(history, 8)
    drafter.feedback(8, 0)
    assert not drafter.gate_open and drafter.draft(history, 8) == ()
    drafter.draft([*history, *hf_tokenizer.encode("\n<")], 8)
    assert drafter.gate_open


def test_single_tool_grammar_pins_the_name(hf_tokenizer: Any) -> None:
    from envhub.envs.sql_qa import SQL_TOOL

    one = CompiledToolGrammar(grammar_for("sql", [SQL_TOOL]), ll_tokenizer(hf_tokenizer))
    m = one.matcher()
    assert m.consume_tokens(hf_tokenizer.encode("<tool_call>\n{"))
    assert 'name": "sql_query"' in hf_tokenizer.decode(m.compute_ff_tokens())


def test_constrained_mode_never_emits_an_invalid_call_even_for_a_random_policy(
    compiled: CompiledToolGrammar, hf_tokenizer: Any
) -> None:
    """AC3 (mask logic): 200 spans decoded under the mask from random logits (biased towards closing
    punctuation so that strings end) are valid calls; a span cut by the token budget is a valid prefix."""
    jsonschema = pytest.importorskip("jsonschema")
    import numpy as np

    from core.types import SamplingParams
    from engines.sampling import sample
    from speculation.constraint import GrammarConstraint

    rng = np.random.default_rng(0)
    vocab = compiled.tokenizer.vocab_size
    prompt = hf_tokenizer.encode("Question: how many customers?\n")
    opening = hf_tokenizer.encode("<tool_call>\n")
    schemas = dict(workload.grammar().tools)
    closing = np.array([any(c in hf_tokenizer.decode([t]) for c in '"}]>') for t in range(vocab)])
    forced_total = closed = 0
    for _ in range(200):
        constraint = GrammarConstraint(compiled)
        history = list(prompt)
        assert constraint.allowed(history) is None  # no span: unconstrained
        history += opening  # the policy opens the block itself
        generated: list[int] = []
        while len(generated) < 400:
            allowed = constraint.allowed(history)
            if allowed is None:
                break
            assert allowed, "the mask never empties inside a span"
            logits = np.full(vocab, -np.inf)
            logits[list(allowed)] = rng.normal(0.0, 3.0, size=len(allowed)) + 12.0 * closing[list(allowed)]
            token, _ = sample(logits, SamplingParams(temperature=1.0), rng)
            assert token in allowed
            forced_total += len(allowed) == 1
            history.append(token)
            generated.append(token)
        text = hf_tokenizer.decode(opening + generated)
        if constraint.allowed(history) is not None:  # cut by the budget: a valid prefix of a call
            assert compiled.matcher().validate_tokens(opening + generated) == len(opening + generated)
            continue
        closed += 1
        assert compiled.accepts(opening + generated), text
        parsed = parse_tool_calls(text)
        assert parsed is not None and parsed.calls and not parsed.errors, text
        for call in parsed.calls:
            jsonschema.validate(call.arguments, schemas[call.name])
    assert closed >= 180 and forced_total > 200  # keys, names and the closing tag are forced
