"""The LLM-policy agent: each window's observation goes to an OpenAI chat endpoint, a JSON action comes back.

``LLMAgent`` sends the observation (its numbers, compact) and the action schema with its ranges to
``POST {OPENAI_BASE_URL}/chat/completions`` through the official ``openai`` client (temperature 0, a
``max_tokens`` bound, a timeout, no retries) and parses the first JSON object of the reply as a
``ServeAction``. The endpoint may be any OpenAI-compatible server, this bridge's own front door included
(``server/http/routes_openai.py``, ``http://HOST:8000/v1``).

Invariants:

* every window yields a valid action: a reply that does not parse (no JSON object with exactly the six
  action fields, or one with a value out of range) is a parse failure, and the window takes ``HeuristicAgent``'s
  action for the same observation (the documented fallback); ``stats.parsed + stats.fell_back ==
  stats.windows`` always;
* an endpoint that cannot be used (``OPENAI_BASE_URL`` unset, ``openai`` not installed, unreachable, an
  error status, a timeout) is ``LLMEndpointError`` naming the variable and the URL, never a fallback: a
  table of heuristic actions must not pass for an LLM's;
* ``openai`` is imported only when an agent is built, so the environment runs without it.

Settings come from the environment (``LLMConfig.from_env``): ``OPENAI_BASE_URL`` (required),
``OPENAI_API_KEY`` (default ``EMPTY``: local servers need none), ``OPENAI_MODEL`` (default: the first
model ``GET /models`` lists).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from llmserve.baselines import HeuristicAgent
from llmserve.models import ServeAction, ServeObservation

if TYPE_CHECKING:
    import openai

BASE_URL_VAR = "OPENAI_BASE_URL"
MAX_TOKENS = 160
TIMEOUT_S = 60.0
_OBS_SKIP = {"metadata", "reward", "done", "task_id"}
ACTION_FIELDS = tuple(f for f in ServeAction.model_fields if f != "metadata")


class LLMEndpointError(RuntimeError):
    """The chat endpoint cannot be used: not configured, ``openai`` missing, unreachable or failing."""


class LLMNotConfiguredError(LLMEndpointError):
    """This process is not set up for the llm agent (no ``OPENAI_BASE_URL``, no ``openai``, no model to use)."""


@dataclass(frozen=True, kw_only=True)
class LLMConfig:
    base_url: str
    """An OpenAI-compatible API root, e.g. ``http://127.0.0.1:8000/v1`` (``$OPENAI_BASE_URL``)."""
    api_key: str = "EMPTY"
    """``$OPENAI_API_KEY``; local servers accept any."""
    model: str | None = None
    """``$OPENAI_MODEL``; ``None``: the first model ``GET /models`` lists."""
    max_tokens: int = MAX_TOKENS
    """Reply bound: a JSON action is ~60 tokens, so a rambling small model is cut off, not waited for."""
    timeout_s: float = TIMEOUT_S
    """Per request (connect, read, write); a CPU-embedded model answers in seconds."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LLMConfig:
        env = os.environ if environ is None else environ
        base_url = env.get(BASE_URL_VAR, "").strip()
        if not base_url:
            raise LLMNotConfiguredError(
                f"the llm agent needs {BASE_URL_VAR}: the API root of an OpenAI-compatible server, "
                "e.g. a bridge's front door http://127.0.0.1:8000/v1 (OPENAI_API_KEY and OPENAI_MODEL are optional)"
            )
        return cls(base_url=base_url, api_key=env.get("OPENAI_API_KEY") or "EMPTY", model=env.get("OPENAI_MODEL"))


@dataclass
class LLMStats:
    """Windows acted, replies parsed into an action, windows that fell back to the heuristic."""

    windows: int = 0
    parsed: int = 0
    fell_back: int = 0
    model: str = field(default="", compare=False)

    def __add__(self, other: LLMStats) -> LLMStats:
        return LLMStats(
            self.windows + other.windows, self.parsed + other.parsed, self.fell_back + other.fell_back, self.model
        )

    def summary(self) -> str:
        return f"llm: {self.windows} windows, {self.parsed} parsed, {self.fell_back} fell back to the heuristic"


def _objects(text: str) -> Iterator[Any]:
    """Every JSON value that starts at a ``{`` of ``text``, outer before inner, left to right."""
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start != -1:
        try:
            value, _ = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            pass
        else:
            yield value
        start = text.find("{", start + 1)


def parse_action(text: str) -> ServeAction | None:
    """The reply's first JSON object with exactly the six action fields (in prose, a code fence, or nested in
    another object), or ``None`` when there is none or its values are out of range."""
    for obj in _objects(text):
        if isinstance(obj, dict) and set(obj) == set(ACTION_FIELDS):
            try:
                return ServeAction.model_validate(obj)
            except ValidationError:
                return None
    return None


def _schema() -> dict[str, str]:
    fields = ServeAction.model_fields
    kinds = {int: "integer", float: "number", bool: "boolean"}
    return {f: f"{kinds.get(fields[f].annotation, 'string')}: {fields[f].description}" for f in ACTION_FIELDS}


SYSTEM_PROMPT = (
    "You configure an LLM inference server for the next one-second window: maximise throughput of requests "
    "that meet their latency SLOs, keep KV memory below 85% occupancy and cost low. Reply with one JSON object "
    "and nothing else, with exactly these fields:\n"
    + json.dumps(_schema(), indent=0)
    + "\nExample reply: "
    + json.dumps(ServeAction().model_dump(mode="json", exclude={"metadata"}))
)


def observation_prompt(obs: ServeObservation) -> str:
    """The observation's numbers, compact (3 decimals), as the user turn."""
    nums = {k: round(v, 3) if isinstance(v, float) else v for k, v in obs.model_dump(exclude=_OBS_SKIP).items()}
    return f"task {obs.task_id or '?'}, window {obs.step_index}. Observation: {json.dumps(nums)}\nYour JSON action:"


class LLMAgent:
    """``make_agent("llm")``: a chat model picks each window's action; unparsable replies take the heuristic's."""

    name = "llm"

    def __init__(self, config: LLMConfig) -> None:
        try:
            import openai  # the environment runs without it; only this agent needs it
        except ImportError as exc:
            raise LLMNotConfiguredError("the llm agent needs the openai package: pip install openai==3.57.0") from exc
        self._openai = openai
        self.config = config
        self.fallback = HeuristicAgent()
        self.client = openai.OpenAI(
            base_url=config.base_url, api_key=config.api_key, timeout=config.timeout_s, max_retries=0
        )
        self.model = config.model or self._first_model()
        self.stats = LLMStats(model=self.model)

    def _failed(self, exc: openai.APIError) -> LLMEndpointError:
        what = f"HTTP {exc.status_code}" if isinstance(exc, self._openai.APIStatusError) else type(exc).__name__
        return LLMEndpointError(f"{BASE_URL_VAR}={self.config.base_url}: the endpoint failed ({what}: {exc.message})")

    def _first_model(self) -> str:
        try:
            models = self.client.models.list().data
        except self._openai.APIError as exc:
            raise self._failed(exc) from exc
        if not models:
            raise LLMNotConfiguredError(f"{BASE_URL_VAR}={self.config.base_url} lists no models: set OPENAI_MODEL")
        return models[0].id

    def ask(self, obs: ServeObservation) -> str:
        """The model's reply to one observation (empty when it has no text)."""
        try:
            resp = self.client.chat.completions.create(
                model=self.model,
                messages=[
                    {"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": observation_prompt(obs)},
                ],
                temperature=0.0,
                max_tokens=self.config.max_tokens,
            )
        except self._openai.APIError as exc:
            raise self._failed(exc) from exc
        return (resp.choices[0].message.content or "") if resp.choices else ""

    def act(self, obs: ServeObservation) -> ServeAction:
        action = parse_action(self.ask(obs))
        self.stats.windows += 1
        if action is None:
            self.stats.fell_back += 1
            return self.fallback.act(obs)
        self.stats.parsed += 1
        return action
