"""Shared machinery of the HTTP engine adapters (``vllm``, ``sglang``, ``trtllm``).

One ``RemoteEngine`` is one engine replica behind one base URL. Subclasses only say how a request is written and how
one stream event is read; this module owns the connection pool, timeouts, admission around weight updates and the
assembly of ``TokenChunk``s. Connect retries, URL redaction and the HTTP -> error map are ``engines.http.edge``;
opening and reading a generation stream is ``engines.http.stream`` (a ``StreamReader`` over this replica's client).

Invariants
----------
* Every awaited call has a timeout: connect (``connect_timeout_s``), control calls
  (``control_timeout_s``), weight loads (``weight_update_timeout_s``); a generation stream
  may be silent for at most ``engine.request_timeout_s``, and its waits on the engine end at
  the turn's deadline, the same bound. The RPC deadline, usually shorter, is the bridge's.
* Retries and the error map: ``engines.http.edge``. A dropped stream -> ``EngineUnavailable``, a
  payload that breaks the documented wire format -> ``EngineProtocolError`` naming the field,
  silence beyond the read timeout -> ``DeadlineExceeded``.
* Payloads are read through ``engines.http.wire.Wire``: every engine's -inf encoding becomes
  ``-inf``, and a field that breaks the wire format is named in the error.
* A stream is parsed one SSE event at a time; tokens are yielded as they arrive, and the
  last chunk carries the finish reason and usage (held back until the usage is known).
* The prefix cache is salted with an ``core.salt.CacheSalt`` (the bridge's ``cache_salt``, or
  the model at this replica's own version when none is given) so KV of old weights is never reused.
* No turn straddles a weight update: ``update_weights`` (``exclusive_update``) stops admitting new generations on the
  replica, waits up to ``weight_update_timeout_s`` for the in-flight ones to finish (then aborts the stragglers, which
  end with ``ABORT`` and old-version tokens only), reloads, and reopens. A turn held at the gate runs on the new
  weights, labelled and salted with the new version.
* A whole turn lasts at most ``engine.request_timeout_s`` (``asyncio.timeout`` around the
  stream, so keep-alive comments cannot extend it); an ``abort`` that arrives before the
  response headers closes the stream as soon as it opens.
* A turn with a drafter goes to ``generate_speculative`` when the adapter ``speculates`` on it (vLLM,
  greedy turns); it runs inside the same admission, deadline, abort and error mapping as a plain turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import httpx

from core.errors import (
    DeadlineExceeded,
    EngineProtocolError,
    EngineUnavailable,
    InvalidArgument,
    PrimeRLError,
    Unimplemented,
)
from core.salt import CacheSalt, SaltBook
from core.types import (
    Capability,
    EngineCounters,
    EngineHealth,
    EngineInfo,
    FinishReason,
    GenerateRequest,
    ModelFacts,
    TokenChunk,
    Usage,
    WeightUpdate,
)
from engines.base import Tokenizer
from engines.config import RemoteEngineConfig
from engines.http import edge as http_edge
from engines.http.edge import redact_url, split_engine_url
from engines.http.stream import Delta, StreamContext, StreamReader, StreamState
from engines.http.wire import Wire, counter_values, parse_prometheus

log = logging.getLogger("primerl.engines")
# ---------------------------------------------------------------------------------------------
# The remote engine
# ---------------------------------------------------------------------------------------------


class RemoteEngine:
    """Base of the HTTP adapters (see module docstring). Implements ``engines.base.Engine``."""

    engine_name: ClassVar[str] = "remote"
    generate_path: ClassVar[str] = "/v1/completions"
    models_path: ClassVar[str] = "/v1/models"
    # What the adapter can do (EngineInfo.capabilities). No remote engine reports raw (temperature-1)
    # logprobs next to the processed ones (the logprobs mode is server-wide), so none declares RAW_LOGPROBS:
    # such requests are refused, not served without them.
    capabilities: ClassVar[frozenset[Capability]] = frozenset({Capability.MIN_P})

    def __init__(
        self,
        url: str,
        config: RemoteEngineConfig,
        facts: ModelFacts,
        *,
        model: str = "",
        tokenizer: Tokenizer | None = None,
        request_timeout_s: float = 600.0,
        replica: str = "",
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url, kv_events, kv_replay = split_engine_url(url)
        self.config = config
        # The salts sent, by the form the engine sees (``wire_salt``): KV events name them (cache/event_index.py).
        self.salts = SaltBook(self.wire_salt)
        self.facts = facts
        shown = redact_url(self.url)
        self.label = f"{self.engine_name} replica {replica or shown} ({shown})"
        self.wire = Wire(self.label)
        self._tokenizer = tokenizer
        self._served_name = config.served_model_name
        self._version = 0
        self._live: dict[str, StreamState] = {}
        self._admitting = asyncio.Event()  # cleared while weights are being replaced
        self._admitting.set()
        self._in_flight = 0
        self._idle = asyncio.Event()  # set while no generation is in flight
        self._idle.set()
        self._update_lock = asyncio.Lock()
        self._start_problem = ""
        self._explicit_model = bool(model or config.served_model_name)
        self.counters = EngineCounters()
        self._request_timeout_s = request_timeout_s
        self._client = http_edge.make_client(self.url, config, transport)  # closed by close()
        self._streams = StreamReader(
            self._client,
            config,
            path=self.generate_path,
            timeout=http_edge.stream_timeout(config, request_timeout_s),
            label=self.label,
            wire=self.wire,
            http_error=self.http_error,
        )
        self._info = EngineInfo(
            engine=self.engine_name,
            model=model or config.served_model_name or Path(facts.model_dir).name,
            vocab_size=facts.vocab_size,
            max_model_len=config.max_model_len or facts.max_position_embeddings,
            eos_token_ids=facts.eos_token_ids,
            capabilities=self.declared_capabilities(),
            replica=replica or shown,
            base_weights=facts.model_dir,  # the served checkpoint (the same path on the engine's host)
            kv_events=kv_events,
            kv_events_replay=kv_replay,
        )

    # -- Engine protocol: properties -------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._tokenizer

    @property
    def policy_version(self) -> int:
        return self._version

    def adopt_version(self, version: int) -> None:  # a fleet peer reloaded this shared replica (server.fleet.member)
        self._version = version

    @property
    def served_model_name(self) -> str:
        return self._served_name or self._info.model

    # -- subclass hooks -----------------------------------------------------------------------

    def wire_salt(self, salt: str) -> str:
        """The form of ``salt`` the engine receives (and names in its KV events)."""
        return salt

    def declared_capabilities(self) -> frozenset[Capability]:
        """``capabilities``, less what this replica's configuration turns off."""
        return self.capabilities

    def build_payload(self, request: GenerateRequest, salt: str) -> dict[str, Any]:
        raise NotImplementedError

    def parse_event(self, data: Any, state: StreamState) -> Delta | None:
        """Read one decoded stream event; ``None`` for events that carry nothing of interest."""
        raise NotImplementedError

    def read_models(self, data: Any) -> tuple[str, int]:
        """(served model name, max model len or 0) from the engine's model listing."""
        body = self.wire.obj(data, "models")
        entries = self.wire.list_(body.get("data"), "data")
        if not entries:
            raise self.wire.fail("data", "is empty: the engine serves no model")
        first = self.wire.obj(entries[0], "data[0]")
        name = first.get("id")
        if not isinstance(name, str) or not name:
            raise self.wire.fail("data[0].id", f"is {name!r}, expected the served model name")
        max_len = first.get("max_model_len")
        return name, max_len if isinstance(max_len, int) and max_len > 0 else 0

    def speculates(self, request: GenerateRequest) -> bool:
        """Whether ``generate_speculative`` serves this turn (``request.drafter`` is set); default: never."""
        return False

    def generate_speculative(
        self, request: GenerateRequest, state: StreamState, version: int, deadline: float
    ) -> AsyncGenerator[TokenChunk, None]:
        """Exact draft/verify decoding of one admitted turn (adapters that return True from ``speculates``)."""
        raise NotImplementedError

    async def read_deltas(
        self, response: httpx.Response, deadline: float, state: StreamState, produced: Callable[[], int]
    ) -> AsyncGenerator[Delta, None]:
        """The parsed events of one token stream up to ``[DONE]``; engine errors and dropped or silent streams
        raise (``produced()``: tokens so far, for the message), except after an abort we asked for
        (``StreamReader.events``)."""
        async with contextlib.aclosing(self._streams.events(response, deadline, state, produced)) as events:
            async for data in events:
                delta = self.parse_event(data, state)
                if delta is not None:
                    yield delta

    async def send_abort(self, state: StreamState) -> None:
        """Engine-specific abort; the default is to drop the connection (vLLM, TRT-LLM)."""
        if state.response is not None:
            await state.response.aclose()

    # -- HTTP -----------------------------------------------------------------------------------

    async def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        timeout: float | None = None,
        params: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        """One control call with bounded connect retries; raises a mapped error unless 2xx."""
        try:
            response = await self.connect(
                lambda: self._client.request(
                    method,
                    path,
                    json=json_body,
                    params=params,
                    timeout=httpx.USE_CLIENT_DEFAULT if timeout is None else timeout,
                )
            )
        except httpx.TimeoutException:
            raise DeadlineExceeded(f"{self.label} did not answer {method} {path} in time") from None
        except httpx.HTTPError as exc:
            raise EngineUnavailable(f"{self.label} failed on {method} {path}: {exc!r}") from None
        if response.status_code >= 300:
            raise self.http_error(response.status_code, response.text, f"{method} {path}")
        return response

    async def connect(self, send: Callable[[], Awaitable[httpx.Response]]) -> httpx.Response:
        return await http_edge.connect(send, self.config, self.label)

    def http_error(self, status: int, body: str, what: str) -> PrimeRLError:
        return http_edge.http_error(self.label, self._info, status, body, what)

    async def get_json(self, path: str) -> Any:
        response = await self.request("GET", path)
        return self.wire.loads(response.text, path)

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Learn the served name and context window; an unreachable engine is not fatal here.

        The bridge then reports NOT_SERVING with the reason (``health``), and retries on
        every health check, so an engine that comes up later is picked up.
        """
        try:
            await self.refresh_models()
        except PrimeRLError as exc:
            self._start_problem = exc.message
            log.warning("%s", exc.message)

    async def refresh_models(self) -> None:
        name, max_len = self.read_models(await self.get_json(self.models_path))
        if self.config.served_model_name and name != self.config.served_model_name:
            raise InvalidArgument(
                f"{self.label} serves model {name!r}, not the configured {self.config.served_model_name!r}"
            )
        self._served_name = name
        changes: dict[str, Any] = {}
        if not self._explicit_model:
            changes["model"] = name
        if not self.config.max_model_len and max_len:
            changes["max_model_len"] = max_len
        if changes:
            self._info = replace(self._info, **changes)
        self._start_problem = ""

    async def health(self) -> EngineHealth:
        try:
            await self.request("GET", "/health")
            if self._start_problem or not self._served_name:
                await self.refresh_models()
        except PrimeRLError as exc:
            return EngineHealth(False, exc.message)
        try:  # engine-side statistics and the served version ride on the periodic health check (never fail it)
            await self.refresh_stats()
            await self.refresh_version()
        except PrimeRLError as exc:
            log.debug("%s: statistics not available: %s", self.label, exc.message)
        return EngineHealth(True, f"{self.label} serves {self.served_model_name!r}")

    # Engine-side Prometheus series copied into ``counters.extra`` at each health check: series name ->
    # counter key; and the series of the KV cache's usage as a fraction (exported as parts per million).
    stat_counters: ClassVar[dict[str, str]] = {}
    kv_usage_series: ClassVar[str] = ""

    async def refresh_version(self) -> None:
        """Read the version the engine serves where it reports one (a restart brings back its base weights)."""
        return None

    async def refresh_stats(self) -> None:
        """Copy the engine's statistics (``stat_counters``, ``kv_usage_series``) into ``counters.extra``."""
        names = (*self.stat_counters, self.kv_usage_series) if self.kv_usage_series else tuple(self.stat_counters)
        if names:
            stats = await self.prometheus(names)
            self.counters.extra.update(counter_values(stats, self.stat_counters, self.kv_usage_series))

    async def close(self) -> None:
        await self._client.aclose()

    async def release(self, episode_id: str) -> None:
        return None  # the engine's prefix cache evicts by itself

    async def update_weights(self, update: WeightUpdate) -> None:
        raise Unimplemented(f"{self.engine_name} cannot load new weights through this adapter")

    @contextlib.asynccontextmanager
    async def exclusive_update(self) -> AsyncIterator[None]:
        """Hold new generations and drain in-flight ones around a weight reload (module docstring).

        The drain is bounded by ``weight_update_timeout_s``; turns still running then are
        aborted (they end with ``ABORT``, every token of the old version) before the reload.
        """
        async with self._update_lock:
            self._admitting.clear()
            try:
                timeout = self.config.weight_update_timeout_s
                try:
                    await asyncio.wait_for(self._idle.wait(), timeout)
                except TimeoutError:
                    log.warning(
                        "%s: %d turns still running after weight_update_timeout_s = %s s; aborting them "
                        "before the weight reload",
                        self.label,
                        self._in_flight,
                        timeout,
                    )
                    for request_id, state in list(self._live.items()):
                        if state.admitted:  # not the turns held at the gate: they run after the reload
                            await self.abort(request_id)
                    try:
                        await asyncio.wait_for(self._idle.wait(), self.config.control_timeout_s)
                    except TimeoutError:
                        raise DeadlineExceeded(
                            f"{self.label} still has {self._in_flight} turns running after aborting them; "
                            "weights not reloaded"
                        ) from None
                yield
            finally:
                self._admitting.set()

    async def prometheus(self, names: tuple[str, ...], path: str = "/metrics") -> dict[str, float]:
        """Scrape the engine's Prometheus endpoint for ``names`` (summed over labels)."""
        response = await self.request("GET", path)
        return parse_prometheus(response.text, names)

    # -- generation -----------------------------------------------------------------------------

    def cache_salt(self, request: GenerateRequest) -> str:
        return self._salt(request, self._version)

    def _salt(self, request: GenerateRequest, version: int) -> str:
        """The request's salt, or the model's at ``version``; a ``CacheSalt`` naming another version than
        the one that will run (the turn was held behind a weight update) is moved to ``version``. Noted in
        ``salts``, so that the replica's KV events map back to the bridge's index keys."""
        if not request.cache_salt:
            salt = str(CacheSalt(self._info.model, version))
        else:
            parsed = CacheSalt.parse(request.cache_salt)
            salt = str(parsed.at(version)) if parsed is not None else request.cache_salt
        self.salts.note(salt)
        return salt

    async def abort(self, request_id: str) -> None:
        state = self._live.get(request_id)
        if state is None or state.aborted:
            return
        state.aborted = True
        if state.response is None:
            return  # nothing opened yet: the stream is closed as soon as its headers arrive
        try:
            await self.send_abort(state)
        except PrimeRLError as exc:  # the stream is dropped below either way
            log.warning("abort of %s on %s failed: %s", request_id, self.label, exc.message)
            if state.response is not None:
                await state.response.aclose()

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        """Stream one turn (see ``engines.base.Engine.generate``)."""
        state = StreamState(request)
        self._live[request.request_id] = state
        finish: FinishReason | None = None
        usage: Usage | None = None
        tail = Delta([], [])  # the finishing tokens wait for the usage that follows them
        produced = 0
        try:
            await self._admitting.wait()  # held while a weight update runs on this replica
        except BaseException:
            self._live.pop(request.request_id, None)
            raise
        # From here to the end no weight update can start (it waits for _idle): one version.
        state.admitted = True
        version = self._version
        self._in_flight += 1
        self._idle.clear()
        try:
            if state.aborted:  # aborted while held at the gate: the engine never saw it
                usage = Usage(prompt_tokens=len(request.token_ids), cached_tokens=0, generated_tokens=0)
                yield TokenChunk((), (), version, finish_reason=FinishReason.ABORT, usage=usage)
                return
            payload = self.build_payload(request, self._salt(request, version))
            # The turn's deadline bounds every wait on the engine (open, each read; keep-alive
            # comments are read inside iter_sse) but not the consumer's time between chunks:
            # an asyncio.timeout held across a yield would cancel the consumer's code instead.
            deadline = asyncio.get_running_loop().time() + self._request_timeout_s
            if request.drafter is not None and self.speculates(request):  # draft/verify (vllm)
                async with contextlib.aclosing(self.generate_speculative(request, state, version, deadline)) as chunks:
                    async for chunk in chunks:
                        yield chunk
                return
            async with self._open_stream(payload, deadline) as response:
                state.response = response
                if state.aborted:  # abort() came before the headers: stop the engine now
                    with contextlib.suppress(PrimeRLError):
                        await self.send_abort(state)
                    await response.aclose()
                async with contextlib.aclosing(self.read_deltas(response, deadline, state, lambda: produced)) as deltas:
                    async for delta in deltas:
                        produced += len(delta.token_ids)
                        usage = delta.usage if delta.usage is not None else usage
                        if finish is None and delta.finish is None:
                            if delta.token_ids:
                                yield TokenChunk(tuple(delta.token_ids), tuple(delta.logprobs), version)
                            continue
                        tail.token_ids += delta.token_ids
                        tail.logprobs += delta.logprobs
                        finish = delta.finish if delta.finish is not None else finish
                        # read on to [DONE]: the usage may follow, and the connection can be reused
            if state.aborted:
                finish = FinishReason.ABORT
            elif finish is None:
                raise EngineProtocolError(f"{self.label} ended the stream without a finish reason")
            if usage is None:
                usage = Usage(prompt_tokens=len(request.token_ids), cached_tokens=0, generated_tokens=produced)
            self._count(usage)
            yield TokenChunk(tuple(tail.token_ids), tuple(tail.logprobs), version, finish_reason=finish, usage=usage)
        except TimeoutError:
            self._count_error("DEADLINE_EXCEEDED")
            if state.response is None:
                raise DeadlineExceeded(
                    f"{self.label} did not start answering within engine.request_timeout_s = "
                    f"{self._request_timeout_s} s"
                ) from None
            raise DeadlineExceeded(
                f"{self.label} took longer than engine.request_timeout_s = "
                f"{self._request_timeout_s} s for one turn ({produced} tokens so far)"
            ) from None
        except PrimeRLError as exc:
            self._count_error(exc.code)
            raise
        finally:
            self._live.pop(request.request_id, None)
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    def _count_error(self, code: str) -> None:
        key = f"errors_{code.lower()}"  # e.g. errors_unavailable, exported as primerl_engine_stat
        self.counters.extra[key] = self.counters.extra.get(key, 0) + 1

    def _open_stream(self, payload: dict[str, Any], deadline: float | None = None) -> StreamContext:
        return self._streams.open(payload, deadline)

    def _count(self, usage: Usage) -> None:
        c = self.counters
        c.requests += 1
        c.cached_tokens += usage.cached_tokens
        c.prefill_tokens += max(usage.prompt_tokens - usage.cached_tokens, 0)
        c.generated_tokens += usage.generated_tokens
