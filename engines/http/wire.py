"""Reading engines' HTTP payloads: typed field access, SSE framing, error bodies, Prometheus text.

Invariants: a payload that breaks the documented wire format raises ``EngineProtocolError``
naming the engine, replica and field (``Wire``); every engine's -inf encoding (``null``,
``-9999.0``, ``FLT_LOWEST``) reads as ``-inf``, and NaN or a positive logprob is an error; SSE is
read one event at a time.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import httpx

from core.errors import EngineProtocolError
from core.types import FinishReason

NEG_INF_CLAMP = -9999.0
"""vLLM and TRT-LLM send -inf as this value; anything at or below it is -inf."""


# ---------------------------------------------------------------------------------------------
# Wire helpers
# ---------------------------------------------------------------------------------------------


class Wire:
    """Typed reads of an engine's JSON that fail with ``EngineProtocolError`` naming the field."""

    def __init__(self, label: str) -> None:
        self.label = label

    def fail(self, where: str, problem: str) -> EngineProtocolError:
        return EngineProtocolError(f"{self.label} sent a malformed response: `{where}` {problem}")

    def loads(self, text: str, where: str) -> Any:
        try:
            return json.loads(text)
        except ValueError:
            snippet = text if len(text) <= 120 else text[:120] + "..."
            raise self.fail(where, f"is not valid JSON: {snippet!r}") from None

    def obj(self, value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(where, f"is {type(value).__name__}, expected an object")
        return value

    def list_(self, value: Any, where: str) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(where, f"is {type(value).__name__}, expected a list")
        return value

    def int_(self, value: Any, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(where, f"is {value!r}, expected an integer")
        return value

    def ids(self, value: Any, where: str) -> list[int]:
        return [self.int_(v, f"{where}[{i}]") for i, v in enumerate(self.list_(value, where))]

    def logprob(self, value: Any, where: str) -> float:
        """One sampled-token logprob, with every engine's -inf encoding mapped to -inf."""
        if value is None:
            return -math.inf
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(where, f"is {value!r}, expected a number or null")
        x = float(value)
        if math.isnan(x) or x > 1e-4:
            raise self.fail(where, f"is {x}, not a log-probability")
        return -math.inf if x <= NEG_INF_CLAMP else min(x, 0.0)

    def logprobs(self, value: Any, where: str) -> list[float]:
        return [self.logprob(v, f"{where}[{i}]") for i, v in enumerate(self.list_(value, where))]

    def optional_int(self, value: Any, where: str, default: int = 0) -> int:
        return default if value is None else self.int_(value, where)


async def iter_sse(response: httpx.Response) -> AsyncGenerator[str, None]:
    """The ``data`` payload of each server-sent event, read incrementally.

    Multi-line ``data:`` fields are joined with newlines (the SSE rule); comments and other
    fields (``event:``, ``id:``) are skipped. A final event without its blank line is flushed.
    """
    buf: list[str] = []
    async for line in response.aiter_lines():
        if not line:
            if buf:
                yield "\n".join(buf)
                buf = []
        elif line.startswith("data:"):
            buf.append(line[5:].removeprefix(" "))
    if buf:
        yield "\n".join(buf)


def parse_prometheus(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum of all samples (over labels) of each metric in ``names`` found in an exposition text."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            try:
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return out


def error_message(body: str) -> str:
    """The human part of an engine's error body (OpenAI, SGLang, FastAPI and plain shapes)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.strip()[:500]
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            for key in ("message", "detail", "msg"):
                if key in err:
                    value = err[key]
                    return (value if isinstance(value, str) else json.dumps(value))[:500]
        elif isinstance(err, str):
            return err[:500]
    return body.strip()[:500]


def finish_from_openai(value: Any, wire: Wire, where: str) -> FinishReason | None:
    """OpenAI-style finish reasons (vLLM, TRT-LLM): ``stop | length | abort | null``."""
    if value is None:
        return None
    mapping = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}
    if value not in mapping:
        raise wire.fail(where, f"is {value!r}, expected one of stop, length, abort or null")
    return mapping[value]


def counter_values(stats: Mapping[str, float], counters: Mapping[str, str], kv_usage_series: str) -> dict[str, int]:
    """Engine statistics as ``EngineCounters.extra`` entries: each series in ``counters`` under its key, and the KV
    usage fraction as parts per million (``kv_usage_ppm``); series the engine did not report are left out."""
    out = {key: int(stats[name]) for name, key in counters.items() if name in stats}
    if kv_usage_series in stats:
        out["kv_usage_ppm"] = int(stats[kv_usage_series] * 1e6)
    return out
