"""The piece the server's interceptors share: replacing the handler of a call by one of the same kind.

``HandlerInterceptor.wrap`` gets the handler the server would run and returns the one to run instead
(or the same); ``same_kind`` builds a handler of the original's kind (unary or server-streaming) with
its serializers around new behaviour.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc


def same_kind(handler: grpc.RpcMethodHandler, behavior: Any) -> grpc.RpcMethodHandler:
    """A handler like ``handler`` (kind, serializers) that runs ``behavior``."""
    make = grpc.unary_stream_rpc_method_handler if handler.response_streaming else grpc.unary_unary_rpc_method_handler
    return make(
        behavior, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )


class HandlerInterceptor(grpc.aio.ServerInterceptor):
    """An interceptor that may replace the handler of each served method (``wrap``)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:  # an unknown method: the server answers UNIMPLEMENTED itself
            return handler
        return self.wrap(handler, handler_call_details)

    def wrap(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        raise NotImplementedError
