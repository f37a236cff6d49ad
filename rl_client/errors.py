"""Errors the client raises: one class per gRPC status the bridge uses.

::

    BridgeError                 any non-OK status (``.code``, ``.details``)
    ├── InvalidArgumentError    fix the request
    ├── NotFoundError           unknown or ended episode
    ├── FailedPreconditionError e.g. a Step already running on the episode
    ├── ResourceExhaustedError  admission limit; retry later
    ├── PermissionDeniedError / UnauthenticatedError
    ├── UnimplementedError      the engine cannot do this
    ├── DeadlineExceededError / AbortedError / UnavailableError
"""

from __future__ import annotations

from typing import Any

import grpc


class BridgeError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, retry_after_s: float | None = None) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.retry_after_s = retry_after_s  # the bridge's hint (RESOURCE_EXHAUSTED), when it sent one


class InvalidArgumentError(BridgeError): ...


class NotFoundError(BridgeError): ...


class FailedPreconditionError(BridgeError): ...


class ResourceExhaustedError(BridgeError): ...


class PermissionDeniedError(BridgeError): ...


class UnauthenticatedError(BridgeError): ...


class UnimplementedError(BridgeError): ...


class DeadlineExceededError(BridgeError): ...


class AbortedError(BridgeError): ...


class UnavailableError(BridgeError): ...


_BY_CODE: dict[grpc.StatusCode, type[BridgeError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.UNIMPLEMENTED: UnimplementedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.ABORTED: AbortedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
}


def from_rpc_error(err: grpc.aio.AioRpcError) -> BridgeError:
    code = err.code()
    retry = None
    trailers: Any = err.trailing_metadata() or ()
    for key, value in trailers:
        if key == "retry-after-ms" and isinstance(value, str) and value.isdigit():
            retry = int(value) / 1000
    return _BY_CODE.get(code, BridgeError)(code, err.details() or "", retry)
