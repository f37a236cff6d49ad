"""Pure parsing helpers of the HTTP engine adapters (no sockets)."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest

from core.errors import EngineProtocolError, InvalidArgument
from core.types import FinishReason
from engines.http.base import redact_url
from engines.http.vllm import check_weight_dir, vllm_salt
from engines.http.wire import Wire, error_message, finish_from_openai, iter_sse, parse_prometheus


async def events(raw: bytes) -> list[str]:
    return [e async for e in iter_sse(httpx.Response(200, content=raw))]


async def test_sse_framing() -> None:
    raw = (
        b'data: {"a":1}\n\ndata: line1\ndata: line2\n\n'
        b": keep-alive comment\nevent: x\nid: 7\ndata:tight\n\ndata: [DONE]\n\n"
    )
    assert await events(raw) == ['{"a":1}', "line1\nline2", "tight", "[DONE]"]
    assert await events(b"data: last-without-blank-line") == ["last-without-blank-line"]
    assert await events(b"data: a\r\n\r\ndata: b\r\n\r\n") == ["a", "b"]  # CRLF framing


def test_prometheus_sums_labelled_samples_and_ignores_look_alikes() -> None:
    text = """# HELP vllm:prefix_cache_hits_total hits
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 96.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 4.0
vllm:prefix_cache_hits_created{engine="0"} 1.7e9
vllm:prefix_cache_queries_total 250
"""
    got = parse_prometheus(text, ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "absent"))
    assert got == {"vllm:prefix_cache_hits_total": 100.0, "vllm:prefix_cache_queries_total": 250.0}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('{"error":{"message":"Token id 5 is out of vocabulary","code":400}}', "Token id 5 is out of vocabulary"),
        ('{"object":"error","message":"bad","type":"BadRequestError","code":400}', "bad"),
        ('{"detail":[{"loc":["body","model"],"msg":"Field required"}]}', '[{"loc": ["body", "model"]'),
        ("Internal Server Error", "Internal Server Error"),
        ('{"error":"plain"}', "plain"),
    ],
)
def test_error_messages_of_every_engine_shape(body: str, message: str) -> None:
    assert error_message(body).startswith(message)


def test_wire_names_the_field() -> None:
    w = Wire("vllm replica r0 (http://x)")
    assert w.ids([1, 2], "choices[0].token_ids") == [1, 2]
    with pytest.raises(EngineProtocolError, match=r"vllm replica r0 .*`choices\[0\]\.token_ids\[1\]` is '2'"):
        w.ids([1, "2"], "choices[0].token_ids")
    with pytest.raises(EngineProtocolError, match="expected an integer"):
        w.ids([True], "ids")
    with pytest.raises(EngineProtocolError, match="expected a list"):
        w.ids(None, "ids")
    with pytest.raises(EngineProtocolError, match="not valid JSON"):
        w.loads("{nope", "stream event")
    assert w.logprobs([None, -9999.0, -1.5, 0.0], "lp") == [-math.inf, -math.inf, -1.5, 0.0]
    with pytest.raises(EngineProtocolError, match="not a log-probability"):
        w.logprob(float("nan"), "lp")
    assert finish_from_openai("length", w, "f") == FinishReason.LENGTH and finish_from_openai(None, w, "f") is None
    with pytest.raises(EngineProtocolError, match="expected one of stop, length, abort"):
        finish_from_openai("content_filter", w, "choices[0].finish_reason")


def test_vllm_salt_is_accepted_by_vllm_and_keeps_salts_apart() -> None:
    assert vllm_salt("plain-salt_1.0") == "plain-salt_1.0"
    a, b = vllm_salt("smollm2@1"), vllm_salt("smollm2@2")
    assert a != b and len(a) <= 128 and not set(a) & set("@/\\\x00")
    assert vllm_salt("") and vllm_salt("x" * 500) != vllm_salt("x" * 499)


def test_weight_dir_is_checked_before_vllm_sees_it(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="is not a directory"):
        check_weight_dir(str(tmp_path / "missing"))
    with pytest.raises(InvalidArgument, match=r"no config\.json"):
        check_weight_dir(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(InvalidArgument, match=r"no \*\.safetensors"):
        check_weight_dir(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"x")
    assert check_weight_dir(str(tmp_path)) == tmp_path


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://trainer:s3cret@engine-0:8000/v1?api_key=k#frag", "http://engine-0:8000/v1"),
        ("https://token@[::1]:8443/", "https://[::1]:8443/"),
        ("http://engine-1", "http://engine-1"),
        ("http://u:p@h:99999", "<invalid url>"),  # an unparsable port: show nothing of it
    ],
)
def test_redact_url_drops_userinfo_query_and_fragment(url: str, shown: str) -> None:
    assert redact_url(url) == shown
