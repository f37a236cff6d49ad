"""Fleet routing of episode calls: a Step or EndEpisode sent to a bridge that does not hold the episode goes
to the bridge that owns it (issue 21: a trainer may call any bridge; never NOT_FOUND for a live episode).

``FleetOwnerInterceptor`` (innermost, after auth) looks at calls whose request names an ``episode_id``:

* held here (``Bridge.store``): served here, no registry read (the common case costs one dict lookup);
* owned by another bridge (``placement.registry``: episode -> owner address, written at StartEpisode):
  forwarded there with ``server.forward`` (status, metadata and stream passed back unchanged), marked with
  ``primerl-fleet-forwarded-by`` so a call is never forwarded twice;
* owner unreachable (its process died): with ``persistence.enabled`` this bridge takes the episode over from
  Redis (the persistence lease guards against two bridges stepping it; a lease the dead bridge held for a Step
  it was running is broken, compare-and-delete on its token) and records itself as the owner;
  without persistence the call fails UNAVAILABLE saying the episode died with its bridge;
* registry unreachable: served here (fail open, counted by the membership).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from server.bridge import Bridge
from server.errors import PrimeRLError
from server.forward import OwnerUnreachable, default_forwarder, passthrough
from server.handlers import HandlerInterceptor

log = logging.getLogger("primerl.fleet")
FORWARDED_BY = "primerl-fleet-forwarded-by"


class FleetOwnerInterceptor(HandlerInterceptor):
    """Sends episode calls to the bridge that owns the episode (see module docstring)."""

    def __init__(self, bridge: Bridge, persistence: bool) -> None:
        self.bridge = bridge
        self.persistence = persistence
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def wrap(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = details.method
        if handler.request_streaming or not method.endswith(("/Step", "/EndEpisode")):
            return handler
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        serializer = passthrough(handler.response_serializer)
        if handler.response_streaming:
            wrapped = grpc.unary_stream_rpc_method_handler(
                self._stream(method, handler.unary_stream), handler.request_deserializer, serializer
            )
        else:
            wrapped = grpc.unary_unary_rpc_method_handler(
                self._unary(method, handler.unary_unary), handler.request_deserializer, serializer
            )
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    async def _owner(self, request: Any, context: grpc.aio.ServicerContext) -> tuple[str, str]:
        """(address, lease token) of the other bridge to forward this call to; ('', '') to serve it here."""
        fleet, episode = self.bridge.fleet, getattr(request, "episode_id", "")
        if fleet is None or not episode or self.bridge.store.peek(episode) is not None:
            return "", ""
        if any(key == FORWARDED_BY for key, _ in context.invocation_metadata() or ()):
            return "", ""  # forwarded to us already: never a second hop
        try:
            owner, holder = await fleet.store.owner(episode)
        except PrimeRLError as exc:
            fleet.failed_open(exc)
            return "", ""
        return (owner, holder) if owner != fleet.address else ("", "")

    async def _unreachable(
        self, owner: str, holder: str, request: Any, context: grpc.aio.ServicerContext, exc: Exception
    ) -> None:
        episode = getattr(request, "episode_id", "")
        if not self.persistence:
            log.warning("episode %s: its bridge %s is unreachable (%s)", episode, owner, exc)
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"episode {episode!r} belongs to bridge {owner}, which is unreachable; without persistence.enabled "
                "its open episodes are lost with it",
            )
        log.warning("episode %s: its bridge %s is unreachable (%s); taking it over from Redis", episode, owner, exc)
        journal = self.bridge.journal
        if holder and journal is not None:  # a Step the dead bridge was running holds the lease: it never ends
            with contextlib.suppress(PrimeRLError):  # Redis down: the lease expires by itself
                await journal.break_lease(episode, holder)
        if self.bridge.fleet is not None:
            await self.bridge.fleet.own([episode])

    def _hop(self) -> tuple[tuple[str, str], ...]:
        return ((FORWARDED_BY, self.bridge.fleet.address if self.bridge.fleet is not None else ""),)

    def _unary(self, method: str, behavior: Any) -> Callable[..., Any]:
        forwarder = default_forwarder()

        async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
            owner, holder = await self._owner(request, context)
            if owner:
                try:
                    return await forwarder.unary(
                        owner, method, request, context, metadata=self._hop(), unreachable_raises=True
                    )
                except OwnerUnreachable as exc:
                    await self._unreachable(owner, holder, request, context, exc)
            return await behavior(request, context)

        return handle

    def _stream(self, method: str, behavior: Any) -> Callable[..., AsyncIterator[Any]]:
        forwarder = default_forwarder()

        async def handle(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            owner, holder = await self._owner(request, context)
            if owner:
                try:
                    async for item in forwarder.stream(
                        owner, method, request, context, metadata=self._hop(), unreachable_raises=True
                    ):
                        yield item
                    return
                except OwnerUnreachable as exc:
                    await self._unreachable(owner, holder, request, context, exc)
            async for item in behavior(request, context):
                yield item

        return handle
