"""engines.scoring.validate: every bad ScoreTokens request names its field; engines without the capability are
UNIMPLEMENTED naming themselves (issue 23)."""

from __future__ import annotations

import pytest

from core.errors import InvalidArgument, Unimplemented
from core.types import Capability, EngineInfo
from engines.scoring import MAX_LOGIT_VALUES, ScoreRequest, validate

INFO = EngineInfo(
    "embedded", "m", vocab_size=100, max_model_len=16, eos_token_ids=(0,), capabilities=frozenset(Capability)
)


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (ScoreRequest((1,), 1), "token_ids"),
        (ScoreRequest((1, 2, 3), 0), "start"),
        (ScoreRequest((1, 2, 3), 3), "start"),
        (ScoreRequest((1, 2, 300), 1), "token_ids"),
        (ScoreRequest(tuple(range(1, 18)), 1), "context window"),
        (ScoreRequest((1, 2, 3), 1, temperature=0.0), "temperature"),
        (ScoreRequest((1, 2, 3), 1, temperature=float("nan")), "temperature"),
    ],
)
def test_bad_requests_name_the_field(request_: ScoreRequest, field: str) -> None:
    with pytest.raises(InvalidArgument, match=field):
        validate(request_, INFO)


def test_logits_are_bounded_per_request() -> None:
    wide = EngineInfo("embedded", "m", MAX_LOGIT_VALUES, 16, (0,), capabilities=frozenset(Capability))
    with pytest.raises(InvalidArgument, match="return_logits"):
        validate(ScoreRequest((1, 2, 3), 1, return_logits=True), wide)
    validate(ScoreRequest((1, 2, 3), 2, return_logits=True), wide)  # one scored token fits


def test_engines_without_the_capability_are_unimplemented() -> None:
    toy = EngineInfo("toy", "m", 100, 16, (0,), replica="toy-0", capabilities=frozenset({Capability.MIN_P}))
    with pytest.raises(Unimplemented, match="'toy' \\(replica toy-0\\) cannot score"):
        validate(ScoreRequest((1, 2, 3), 1), toy)
    validate(ScoreRequest((1, 2, 3), 1, temperature=0.5), INFO)
