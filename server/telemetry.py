"""gRPC server interceptor: per-RPC metrics (latency, status codes) and OpenTelemetry spans.

Invariants:
- every RPC is counted exactly once with its final status code: OK, the code a handler
  aborted with, CANCELLED when the client went away, UNKNOWN for anything else;
- with tracing off no span code runs; the RPC span continues the trace in the client's
  metadata and is the current span while the handler runs, so engine spans are its children;
- span attributes are ids and counts read from the messages (episode id, turn, replica,
  token usage), never text;
- every call runs with its request id set (``server.requestid``): the client's ``x-request-id``
  or a fresh one; logs, the RPC span and the engine request ids carry it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from observability.metrics import BridgeMetrics
from observability.tracing import Tracing
from server.handlers import HandlerInterceptor, same_kind
from server.requestid import HEADER, current_request_id, new_request_id

UNTRACED = ("grpc.health.", "grpc.reflection.")


def _method_label(full: str) -> str:
    """``/primerl.v1.PrimeRL/Step`` -> ``primerl.v1.PrimeRL/Step`` (bounded by the services served)."""
    return full.lstrip("/")


def _code(context: grpc.aio.ServicerContext, exc: BaseException | None) -> grpc.StatusCode:
    if isinstance(exc, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    return grpc.StatusCode.OK if exc is None else grpc.StatusCode.UNKNOWN


def _set_request_id(context: grpc.aio.ServicerContext) -> None:
    """The call's request id (the client's ``x-request-id`` or a fresh one) for logs, spans and engines."""
    sent = ""
    for key, value in context.invocation_metadata() or ():
        if key == HEADER and isinstance(value, str):
            sent = value
            break
    current_request_id.set(new_request_id(sent))


def _request_attrs(request: Any) -> dict[str, Any]:
    attrs: dict[str, Any] = {"primerl.request_id": current_request_id.get()}
    if episode_id := getattr(request, "episode_id", ""):
        attrs["primerl.episode_id"] = episode_id
    if group_size := getattr(request, "group_size", 0):
        attrs["primerl.group_size"] = group_size
    return attrs


def _response_attrs(response: Any) -> dict[str, Any]:
    """Attributes from a StartEpisode response or a Step's last chunk."""
    attrs: dict[str, Any] = {}
    if ids := getattr(response, "episode_ids", None):
        attrs["primerl.episode_ids"] = list(ids)
        attrs["primerl.replica"] = response.placement.replica
        attrs["primerl.prompt_tokens"] = response.prompt_tokens
    done = getattr(response, "done", None)
    if done is not None and response.HasField("done"):
        attrs["primerl.turn"] = done.turn_index
        attrs["primerl.finish_reason"] = done.finish_reason
        attrs["primerl.prompt_tokens"] = done.usage.prompt_tokens
        attrs["primerl.cached_tokens"] = done.usage.cached_tokens
        attrs["primerl.generated_tokens"] = done.usage.generated_tokens
        attrs["primerl.policy_version"] = done.policy_version
    return attrs


class TelemetryInterceptor(HandlerInterceptor):
    def __init__(self, metrics: BridgeMetrics, tracing: Tracing) -> None:
        self.metrics = metrics
        self.tracing = tracing
        # method -> (the handler served, its wrapped version): without per-call wrappers inside (auth off),
        # the server hands back the same handler for a method each call, so it is wrapped once, not per call.
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def wrap(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        if handler.request_streaming:  # no client-streaming RPCs are served (reflection's passes as is)
            return handler
        full = details.method
        cached = self._wrapped.get(full)
        if cached is not None and cached[0] is handler:
            return cached[1]
        method = _method_label(full)
        if handler.response_streaming:
            behavior = self._wrap_stream(method, handler.unary_stream, self._traced(method))
        else:
            behavior = self._wrap_unary(method, handler.unary_unary, self._traced(method))
        wrapped = same_kind(handler, behavior)
        self._wrapped[full] = (handler, wrapped)  # one entry per method served (bounded)
        return wrapped

    def _traced(self, method: str) -> bool:
        # Health probes (every few seconds from Kubernetes) and reflection would drown the traces.
        return self.tracing.enabled and not method.startswith(UNTRACED)

    def _start_span(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> Any:
        from opentelemetry import propagate
        from opentelemetry.trace import SpanKind

        assert self.tracing.tracer is not None
        carrier = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        return self.tracing.tracer.start_span(
            method,
            context=propagate.extract(carrier),
            kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.method": method, **_request_attrs(request)},
        )

    def _call(self, method: str, request: Any, context: grpc.aio.ServicerContext, traced: bool) -> _Call:
        """A call being served: its request id set, its start time and (when traced) its span."""
        _set_request_id(context)
        started = time.perf_counter()
        return _Call(self, method, context, started, self._start_span(method, request, context) if traced else None)

    def _finish(
        self, method: str, started: float, span: Any, context: grpc.aio.ServicerContext, exc: BaseException | None
    ) -> None:
        """Count the call once with its final status, and end its span."""
        code = _code(context, exc)
        self.metrics.observe_rpc(method, code.name, time.perf_counter() - started)
        if span is not None:
            self._end_span(span, code, context)

    def _end_span(self, span: Any, code: grpc.StatusCode, context: grpc.aio.ServicerContext) -> None:
        from opentelemetry.trace import Status, StatusCode

        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code != grpc.StatusCode.OK:
            span.set_status(Status(StatusCode.ERROR, f"{code.name}: {context.details() or ''}"))
        span.end()

    def _wrap_unary(self, method: str, behavior: Any, traced: bool) -> Any:
        async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with self._call(method, request, context, traced) as call:
                if (span := call.span) is None:
                    return await behavior(request, context)
                from opentelemetry.trace import use_span

                with use_span(span, end_on_exit=False):
                    response = await behavior(request, context)
                span.set_attributes(_response_attrs(response))
                return response

        return handle

    def _wrap_stream(self, method: str, behavior: Any, traced: bool) -> Any:
        async def handle(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            with self._call(method, request, context, traced) as call:
                if (span := call.span) is None:
                    async for response in behavior(request, context):
                        yield response
                    return
                from opentelemetry import context as otel_context
                from opentelemetry.trace import set_span_in_context

                first = True
                token = otel_context.attach(set_span_in_context(span))
                try:
                    async for response in behavior(request, context):
                        if first and getattr(response, "token_ids", None):
                            first = False
                            span.add_event("first_token")
                            span.set_attribute("primerl.ttft_ms", (time.perf_counter() - call.started) * 1e3)
                        span.set_attributes(_response_attrs(response))
                        yield response
                finally:
                    otel_context.detach(token)

        return handle


@dataclass(slots=True)
class _Call:
    """One call being served; leaving it counts the call once with its final status and ends its span."""

    interceptor: TelemetryInterceptor
    method: str
    context: grpc.aio.ServicerContext
    started: float
    span: Any

    def __enter__(self) -> _Call:
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        self.interceptor._finish(self.method, self.started, self.span, self.context, exc)
