"""The bridge's gRPC map: the error tree of ``core.errors`` and ``status_code``, re-exported for the server.

The tree (the lowest layer, so that every library package can raise it without importing ``server``) names
each class's gRPC code and HTTP status; ``core.errors_grpc`` is the one place that turns it into a
``grpc.StatusCode``, shared by every gRPC app (the bridge, the verifier, the control plane). Anything that
is not a ``PrimeRLError`` is a bug and maps to INTERNAL. Library packages import the classes from
``core.errors``.
"""

from __future__ import annotations

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
from core.errors_grpc import grpc_status as status_code

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
