"""Running an episode's calls where the episode lives: the interceptor bridge workers and fleet bridges share.

``OwnerInterceptorBase`` wraps the calls a subclass selects (``wraps``) whose request names an episode that
another process owns (``owner``): the call is forwarded there (``server.fleet.forward``: status, metadata and stream
passed back unchanged) with ``hop`` metadata marking it, so a call is never forwarded twice. When the owner
cannot be reached at all, ``persistence.enabled`` lets this process take the episode over from Redis (the
subclass's ``take_over``); without it the call fails UNAVAILABLE saying the episode was lost with its owner.
Calls served here may be tagged (``served_here``) and unary ones run through ``run_here`` (a subclass may add
work around them, e.g. the workers' weight broadcast).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import grpc

from server.fleet.forward import Metadata, OwnerUnreachable, Route, default_forwarder, passthrough
from server.handlers import HandlerInterceptor

log = logging.getLogger("primerl.ownership")


@dataclass(frozen=True, slots=True)
class Owner:
    """Where an episode's calls go: ``target`` to dial, ``label`` for messages, ``token`` of its lease."""

    target: str
    label: str
    token: str = ""


class OwnerInterceptorBase(HandlerInterceptor):
    """Forwards episode calls to their owner (see module docstring); subclasses say who owns what."""

    hop_key: ClassVar[str]  # metadata key a forwarded call carries
    owner_kind: ClassVar[str]  # "bridge worker", "bridge": how messages name an owner

    def __init__(self, persistence: bool) -> None:
        self.persistence = persistence
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    # -- what a subclass says ------------------------------------------------------------------------

    def wraps(self, method: str) -> bool:
        raise NotImplementedError

    async def owner(self, request: Any, context: grpc.aio.ServicerContext) -> Owner | None:
        """The other process to run this call in, or None to run it here."""
        raise NotImplementedError

    def hop(self) -> Metadata:
        raise NotImplementedError

    async def take_over(self, owner: Owner, episode: str) -> None:
        """After an unreachable owner, with persistence on: make this process the episode's owner."""

    def served_here(self, context: grpc.aio.ServicerContext) -> None:
        """Tag a call this process runs (trailers)."""

    async def run_here(self, method: str, behavior: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await behavior(request, context)

    # -- the shared part ----------------------------------------------------------------------------------

    def forwarded(self, context: grpc.aio.ServicerContext) -> bool:
        return any(key == self.hop_key for key, _ in context.invocation_metadata() or ())

    def wrap(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = details.method
        if handler.request_streaming or not self.wraps(method):
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

    async def _owner_of(self, request: Any, context: grpc.aio.ServicerContext) -> Owner | None:
        if not getattr(request, "episode_id", "") or self.forwarded(context):
            return None  # not an episode call, or forwarded to us already: never a second hop
        return await self.owner(request, context)

    async def _unreachable(self, owner: Owner, request: Any, context: grpc.aio.ServicerContext, exc: Exception) -> None:
        episode = getattr(request, "episode_id", "")
        whose = f"episode {episode}: its {self.owner_kind} {owner.label} is unreachable ({exc})"
        if not self.persistence:
            log.warning("%s", whose)
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"episode {episode!r} belongs to {self.owner_kind} {owner.label}, which is unreachable; without "
                "persistence.enabled its open episodes are lost with it",
            )
        log.warning(
            "episode %s: its %s %s is unreachable (%s); taking it over", episode, self.owner_kind, owner.label, exc
        )
        await self.take_over(owner, episode)

    def _route(self, owner: Owner, method: str) -> Route:
        """The call to ``owner``, marked as forwarded; an unreachable owner is raised, to be taken over."""
        return Route(owner.target, method, metadata=self.hop(), unreachable_raises=True)

    def _unary(self, method: str, behavior: Any) -> Callable[..., Any]:
        forwarder = default_forwarder()

        async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
            owner = await self._owner_of(request, context)
            if owner is not None:
                try:
                    return await forwarder.unary(self._route(owner, method), request, context)
                except OwnerUnreachable as exc:
                    await self._unreachable(owner, request, context, exc)
            self.served_here(context)
            return await self.run_here(method, behavior, request, context)

        return handle

    def _stream(self, method: str, behavior: Any) -> Callable[..., AsyncIterator[Any]]:
        forwarder = default_forwarder()

        async def handle(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            owner = await self._owner_of(request, context)
            if owner is not None:
                try:
                    async for item in forwarder.stream(self._route(owner, method), request, context):
                        yield item
                    return
                except OwnerUnreachable as exc:
                    await self._unreachable(owner, request, context, exc)
            self.served_here(context)
            async for item in behavior(request, context):
                yield item

        return handle
