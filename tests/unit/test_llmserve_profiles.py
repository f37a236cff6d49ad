"""LLMServeEnv's cost model: the DistServe form, plus the fitted set's multi-sequence decode term."""

from __future__ import annotations

import json

import pytest

from llmserve.profiles import COEFFS_FILE, DISTSERVE_A100_OPT13B, CostCoefficients, embedded_smollm2_cpu


def coeffs(**kw: float) -> CostCoefficients:
    base = {"prefill_a": 1.0, "prefill_b": 0.1, "prefill_c": 0.01, "decode_a": 2.0, "decode_b": 0.5, "decode_c": 3.0}
    return CostCoefficients(name="t", source="test", **(base | kw))


def test_decode_form_adds_the_multi_sequence_step_only_above_one_sequence() -> None:
    c = coeffs(decode_multi=40.0)
    assert c.decode_ms(10, 1) == pytest.approx(2.0 + 5.0 + 3.0)
    assert c.decode_ms(20, 2) == pytest.approx(2.0 + 10.0 + 6.0 + 40.0)
    assert c.decode_ms(0, 0) == 0.0
    assert coeffs().decode_ms(20, 2) == pytest.approx(18.0)  # without the term: DistServe's form exactly


def test_prefill_form() -> None:
    assert coeffs().prefill_ms([10, 20]) == pytest.approx(1.0 + 0.1 * 30 + 0.01 * 500)
    assert coeffs().prefill_ms([]) == 0.0


def test_published_set_has_no_multi_sequence_term_and_the_fitted_set_loads_its_own() -> None:
    assert DISTSERVE_A100_OPT13B.decode_multi == 0.0
    raw = json.loads(COEFFS_FILE.read_text())
    fitted = embedded_smollm2_cpu()
    assert fitted.decode_multi == raw.get("decode_multi", 0.0)
    assert fitted.decode_ms(256, 1) < fitted.decode_ms(256, 2)
