"""The map from the bridge's errors to gRPC status codes; the one place where it lives.

The error tree itself is ``core.errors`` (the lowest layer, so that every library package
can raise it without importing ``server``). Each class there names its status as a string;
``status_code`` turns that string into a ``grpc.StatusCode``. Anything that is not a
``PrimeRLError`` is a bug and maps to INTERNAL. The classes are re-exported here for the
server's own modules; library packages import them from ``core.errors``.
"""

from __future__ import annotations

import grpc

from core.errors import (
    Aborted,
    DeadlineExceeded,
    EngineError,
    EngineProtocolError,
    EngineUnavailable,
    EpisodeBusy,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    PrimeRLError,
    ResourceExhausted,
    TokenOutOfVocabulary,
    ToolError,
    Unauthenticated,
    Unimplemented,
)

__all__ = [
    "Aborted",
    "DeadlineExceeded",
    "EngineError",
    "EngineProtocolError",
    "EngineUnavailable",
    "EpisodeBusy",
    "FailedPrecondition",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "PrimeRLError",
    "ResourceExhausted",
    "TokenOutOfVocabulary",
    "ToolError",
    "Unauthenticated",
    "Unimplemented",
    "status_code",
]


def status_code(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status for ``exc``: its class's code for a ``PrimeRLError``, INTERNAL for anything else."""
    if isinstance(exc, PrimeRLError):
        return grpc.StatusCode[exc.code]
    return grpc.StatusCode.INTERNAL
