"""OpenTelemetry tracing: one span per RPC (server interceptor) and one per engine call.

Invariants:
- off by default at zero cost: unless an OTLP endpoint is configured through the standard
  variables (``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; and
  neither ``OTEL_SDK_DISABLED=true`` nor ``OTEL_TRACES_EXPORTER=none``), no tracer provider,
  exporter or interceptor is created and engines are not wrapped;
- when on, everything else about the exporter comes from the standard ``OTEL_*`` variables
  (headers, timeout, compression, ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
  ``OTEL_PROPAGATORS``); the protocol is OTLP/gRPC;
- the RPC span continues the trace in the client's gRPC metadata (W3C ``traceparent``), and
  engine spans are its children (the engine call runs in the RPC's task, whose context holds
  the RPC span);
- span attributes are ids and counts, never prompt or completion text.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncGenerator, Mapping
from typing import TYPE_CHECKING, Any

from core.types import EngineCounters, EngineHealth, EngineInfo, GenerateRequest, TokenChunk, WeightUpdate
from engines.base import Engine, Tokenizer

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Tracer

log = logging.getLogger("primerl.tracing")

TRACER_NAME = "primerl"


def tracing_requested(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the standard OTEL_* variables ask for traces to be exported."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = {x.strip().lower() for x in environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")}
    if "otlp" not in exporters:
        return False
    return bool(environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


class Tracing:
    """The bridge's tracer; ``Tracing(None)`` is the disabled one (every hook is skipped)."""

    def __init__(self, provider: TracerProvider | None, *, owned: bool = False) -> None:
        self.provider = provider
        self.tracer: Tracer | None = provider.get_tracer(TRACER_NAME) if provider is not None else None
        self._owned = owned

    @property
    def enabled(self) -> bool:
        return self.tracer is not None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Tracing:
        """The OTLP exporter configured by ``OTEL_*`` variables, or the disabled tracer."""
        if not tracing_requested(environ):
            return cls(None)
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        resource = Resource.create({"service.name": environ.get("OTEL_SERVICE_NAME", "primerl-bridge")})
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))  # endpoint etc. from OTEL_* variables
        log.info("OpenTelemetry tracing on: OTLP/gRPC exporter")
        return cls(provider, owned=True)

    def wrap(self, engine: Engine) -> Engine:
        """``engine`` with a span around each call (unchanged when tracing is off)."""
        if self.tracer is None:
            return engine
        return TracedEngine(engine, self.tracer)

    def shutdown(self) -> None:
        """Flush and stop the exporter this object created (a provider passed in is the caller's)."""
        if self._owned and self.provider is not None:
            self.provider.shutdown()


class TracedEngine:
    """An ``Engine`` proxy that opens a child span per engine call."""

    def __init__(self, inner: Engine, tracer: Tracer) -> None:
        self.inner = inner
        self._tracer = tracer

    def __getattr__(self, name: str) -> Any:
        # Anything beyond the Engine protocol (engine-specific extras) goes to the engine untraced.
        return getattr(self.inner, name)

    @property
    def info(self) -> EngineInfo:
        return self.inner.info

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.inner.tokenizer

    @property
    def counters(self) -> EngineCounters:
        return self.inner.counters

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    def _attrs(self, **extra: Any) -> dict[str, Any]:
        return {"primerl.engine": self.inner.info.engine, "primerl.replica": self.inner.info.replica, **extra}

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        from opentelemetry.trace import Status, StatusCode

        # The span is not made current: its context would leak into the consumer between chunks.

        span = self._tracer.start_span(
            "engine.generate",
            attributes=self._attrs(
                **{
                    "primerl.episode_id": request.episode_id,
                    "primerl.group_id": request.group_id,
                    "primerl.request_id": request.request_id,
                    "primerl.prompt_tokens": len(request.token_ids),
                    "primerl.max_tokens": request.params.max_tokens,
                }
            ),
        )
        started = time.perf_counter()
        first = True
        stream = self.inner.generate(request)
        try:
            async for chunk in stream:
                if first and chunk.token_ids:
                    first = False
                    span.add_event("first_token")
                    span.set_attribute("primerl.ttft_ms", (time.perf_counter() - started) * 1e3)
                if chunk.finish_reason is not None:
                    span.set_attribute("primerl.finish_reason", chunk.finish_reason.name.lower())
                    if chunk.usage is not None:
                        span.set_attribute("primerl.cached_tokens", chunk.usage.cached_tokens)
                        span.set_attribute("primerl.generated_tokens", chunk.usage.generated_tokens)
                yield chunk
        except GeneratorExit:
            span.set_attribute("primerl.finish_reason", "abort")
            raise
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            await stream.aclose()
            span.end()

    async def _call(self, name: str, coro: Any, **attrs: Any) -> Any:
        with self._tracer.start_as_current_span(name, attributes=self._attrs(**attrs)):
            return await coro

    async def abort(self, request_id: str) -> None:
        await self._call("engine.abort", self.inner.abort(request_id), **{"primerl.request_id": request_id})

    async def health(self) -> EngineHealth:
        return await self.inner.health()  # polled: not worth a span each time

    async def update_weights(self, update: WeightUpdate) -> None:
        await self._call(
            "engine.update_weights",
            self.inner.update_weights(update),
            **{"primerl.policy_version": update.policy_version},
        )

    async def release(self, episode_id: str) -> None:
        await self._call("engine.release", self.inner.release(episode_id), **{"primerl.episode_id": episode_id})

    async def close(self) -> None:
        await self.inner.close()
