"""Forwarding one gRPC call to the process that owns its state (another bridge worker, another bridge).

``Forwarder.unary`` / ``Forwarder.stream`` replay the call being served along a ``Route``: its ``method`` on its
``target`` (``host:port`` or ``unix:/path``), over a cached ``grpc.aio`` channel, and hand its outcome back unchanged:

* the request goes as serialized bytes (a message is serialized once; bytes are sent as they are);
* the caller's metadata goes along (bearer token, request id, trace context; transport headers
  excepted), with the route's ``metadata`` added, and the caller's remaining deadline becomes the call's timeout;
* the owner's initial metadata (e.g. Step's ``primerl-accepted``) is sent on before the first response,
  its responses are returned as bytes (or as messages with ``response_deserializer``), its trailing
  metadata is passed on, and its status code and details are the caller's: ``context.abort`` with them;
* a caller that goes away cancels the forwarded call (the owner sees CANCELLED, as if called directly).

``OwnerUnreachable`` is raised instead of aborting, when the owner could not be reached at all (the call
ended UNAVAILABLE before the owner sent anything), so a caller can take the call over or say so clearly;
without the route's ``unreachable_raises`` that case is passed on as UNAVAILABLE like any other status.

A handler that returns forwarded bytes needs a response serializer that passes bytes through:
``passthrough(serializer)``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

Metadata = Sequence[tuple[str, str | bytes]]
# Transport headers that belong to one hop; everything else the client sent is forwarded.
_HOP_HEADERS = frozenset({"user-agent", "content-type", "te", "host", "accept-encoding"})
_UNLIMITED = (("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1))


@dataclass(frozen=True, slots=True)
class Route:
    """Where a forwarded call goes, and how its outcome comes back."""

    target: str  # the owner: host:port or unix:/path
    method: str  # the full method path, /package.Service/Method
    metadata: Metadata = ()  # sent after the caller's own
    response_deserializer: Callable[[bytes], Any] | None = None  # None: responses are returned as bytes
    unreachable_raises: bool = False  # an owner that cannot be reached raises OwnerUnreachable


class OwnerUnreachable(Exception):
    """The owner at ``target`` could not be reached (nothing was sent back): the call did not run there."""

    def __init__(self, target: str, details: str) -> None:
        super().__init__(f"{target}: {details}")
        self.target = target
        self.details = details


def passthrough(serializer: Callable[[Any], bytes] | None) -> Callable[[Any], bytes]:
    """A response serializer for handlers that return forwarded bytes as well as messages."""

    def serialize(message: Any) -> bytes:
        if isinstance(message, bytes):
            return message
        return serializer(message) if serializer is not None else message

    return serialize


def _identity(data: bytes) -> bytes:
    return data


def _payload(request: Any) -> bytes:
    return request if isinstance(request, bytes) else request.SerializeToString()


def forwarded_metadata(context: grpc.aio.ServicerContext, extra: Metadata = ()) -> tuple[tuple[str, Any], ...]:
    """The caller's metadata to send on (hop headers and ``grpc-*`` dropped) plus ``extra``."""
    out = [
        (key, value)
        for key, value in context.invocation_metadata() or ()
        if not key.startswith((":", "grpc-")) and key not in _HOP_HEADERS
    ]
    return (*out, *extra)


class Forwarder:
    """Cached channels to owners, by target; ``close`` ends them all.

    ``options`` are extra channel options; message sizes are unlimited here by default because both
    ends enforce their own limits. A channel belongs to the event loop it was made on: a forwarder used
    from a new loop starts a new set.
    """

    def __init__(self, options: Sequence[tuple[str, Any]] = ()) -> None:
        self._options = [*_UNLIMITED, *options]
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def channel(self, target: str) -> grpc.aio.Channel:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._loop, self._channels = loop, {}
        channel = self._channels.get(target)
        if channel is None:
            channel = self._channels[target] = grpc.aio.insecure_channel(target, options=self._options)
        return channel

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(c.close(None) for c in channels), return_exceptions=True)

    async def unary(self, route: Route, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """Run unary ``route.method`` on ``route.target`` for the call ``context`` is serving; return its response."""
        call = _replay(route, request, context, self.channel(route.target).unary_unary)
        try:
            response = await call
        except asyncio.CancelledError:
            call.cancel()
            raise
        except grpc.aio.AioRpcError as exc:
            await _fail(route, context, exc)
            raise  # pragma: no cover - _fail always raises
        await _pass_metadata(context, await call.initial_metadata(), await call.trailing_metadata())
        return response

    async def stream(self, route: Route, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """Run server-streaming ``route.method`` on ``route.target``; yield its responses as they arrive."""
        call = _replay(route, request, context, self.channel(route.target).unary_stream)
        headers: Any = ()
        try:
            headers = await call.initial_metadata()
            if headers:
                await context.send_initial_metadata(tuple(headers))
            async for response in call:
                yield response
            await _pass_metadata(context, (), await call.trailing_metadata())
        except grpc.aio.AioRpcError as exc:
            await _fail(route, context, exc, sent_headers=bool(headers))
        finally:
            if not call.done():  # the caller left (or the consumer stopped early): stop the owner's work
                call.cancel()


def _replay(route: Route, request: Any, context: grpc.aio.ServicerContext, kind: Callable[..., Any]) -> Any:
    """Start the call being served on the owner (``kind``: the channel's ``unary_unary`` or ``unary_stream``): its
    bytes, its remaining deadline, the caller's metadata."""
    start = kind(route.method, _identity, route.response_deserializer or _identity)
    metadata = forwarded_metadata(context, route.metadata)
    return start(_payload(request), timeout=context.time_remaining(), metadata=metadata)


async def _pass_metadata(context: grpc.aio.ServicerContext, initial: Any, trailing: Any) -> None:
    if initial:
        await context.send_initial_metadata(tuple(initial))
    if trailing:
        context.set_trailing_metadata(tuple(trailing))


async def _fail(
    route: Route, context: grpc.aio.ServicerContext, exc: grpc.aio.AioRpcError, *, sent_headers: bool = False
) -> None:
    """End the served call with the owner's status (or raise ``OwnerUnreachable``)."""
    code, initial = exc.code(), exc.initial_metadata()
    if route.unreachable_raises and code == grpc.StatusCode.UNAVAILABLE and not initial and not exc.trailing_metadata():
        raise OwnerUnreachable(route.target, exc.details() or "unavailable") from None
    if code == grpc.StatusCode.CANCELLED:  # our caller left and we cancelled: end as a cancelled call
        raise asyncio.CancelledError
    if initial and not sent_headers:  # e.g. UpdateWeights' "accepted" header before its error
        await context.send_initial_metadata(tuple(initial))
    trailing: Any = tuple(exc.trailing_metadata() or ())
    await context.abort(code, exc.details() or "", trailing)


_default = Forwarder()


def default_forwarder() -> Forwarder:
    """The process-wide forwarder (``close`` it on shutdown)."""
    return _default
