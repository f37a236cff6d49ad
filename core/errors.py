"""The one error hierarchy: every error a user can cause or observe, with its gRPC code and HTTP status.

Every package raises these, so they live in the bottom layer, ``core``, which imports no other package of
ours. Each class names its gRPC status code once as a string (``code``) and its HTTP status next to it
(``http_status``): the tree below is the one table. ``grpc_code_name`` and ``http_status`` read it for any
exception (anything that is not a ``PrimeRLError`` is a bug: INTERNAL, 500, never its detail); the edges
turn it into what a server sends: ``core.errors_grpc`` a ``grpc.StatusCode``, ``core.errors_http`` a
Starlette JSON response (each app keeps its own body). This module imports neither grpc nor starlette, so
the trainer's client stays light.

::

    class                             gRPC code            HTTP
    PrimeRLError                      INTERNAL             500  a bug; never raised for bad input
    ├── InvalidArgument               INVALID_ARGUMENT     400  bad field values, unknown model
    │   └── TokenOutOfVocabulary      INVALID_ARGUMENT     400  id < 0 or >= vocab size
    ├── NotFound                      NOT_FOUND            404  unknown / already-ended episode
    ├── FailedPrecondition            FAILED_PRECONDITION  409
    │   ├── EpisodeBusy               FAILED_PRECONDITION  409  a Step is already running
    │   └── ToolError                 FAILED_PRECONDITION  409  an env tool refused or failed (envhub)
    ├── ResourceExhausted             RESOURCE_EXHAUSTED   429  admission limits (``retry_after_s``)
    ├── PermissionDenied              PERMISSION_DENIED    403  another tenant's episode
    ├── Unauthenticated               UNAUTHENTICATED      401
    ├── Unimplemented                 UNIMPLEMENTED        501  e.g. engine cannot reload weights
    ├── DeadlineExceeded              DEADLINE_EXCEEDED    504
    ├── Aborted                       ABORTED              409  turn cancelled / engine aborted it
    └── EngineError                   UNAVAILABLE          503  engine unreachable or failing
        ├── EngineUnavailable         UNAVAILABLE          503
        └── EngineProtocolError       UNAVAILABLE          503  malformed engine response

Subclasses elsewhere inherit both columns or override them in their class body: the front door's
``BodyTooLarge`` is 413 and the verifier's ``GraderFailed`` and ``SandboxedGraderFailed`` are 422.
``verifier.bridge.BridgeRefused`` relays another service's code with the status of that code's class here
(``error_class``). tests/integration/test_error_maps.py checks every class in every app.
"""

from __future__ import annotations


class PrimeRLError(Exception):
    """Base of every error the bridge raises on purpose."""

    code: str = "INTERNAL"
    http_status: int = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(PrimeRLError):
    code = "INVALID_ARGUMENT"
    http_status = 400


class TokenOutOfVocabulary(InvalidArgument):
    pass


class NotFound(PrimeRLError):
    code = "NOT_FOUND"
    http_status = 404


class FailedPrecondition(PrimeRLError):
    code = "FAILED_PRECONDITION"
    http_status = 409


class EpisodeBusy(FailedPrecondition):
    pass


class ToolError(FailedPrecondition):
    """An environment tool refused or failed (blocked address, read-only violation, sandbox limit).

    The env hub turns it into an error observation for the model; ``kind`` names the guard
    (``refused``, ``blocked``, ``timeout``, ``limit``, ``unavailable``, ``invalid``).
    """

    def __init__(self, message: str, kind: str = "refused") -> None:
        super().__init__(message)
        self.kind = kind


class ResourceExhausted(PrimeRLError):
    code = "RESOURCE_EXHAUSTED"
    http_status = 429

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s  # gRPC: `retry-after-ms` trailing metadata; HTTP: `Retry-After`


class PermissionDenied(PrimeRLError):
    code = "PERMISSION_DENIED"
    http_status = 403


class Unauthenticated(PrimeRLError):
    code = "UNAUTHENTICATED"
    http_status = 401


class Unimplemented(PrimeRLError):
    code = "UNIMPLEMENTED"
    http_status = 501


class DeadlineExceeded(PrimeRLError):
    code = "DEADLINE_EXCEEDED"
    http_status = 504


class Aborted(PrimeRLError):
    code = "ABORTED"
    http_status = 409


class EngineError(PrimeRLError):
    """The engine failed; the request may succeed on another replica or later."""

    code = "UNAVAILABLE"
    http_status = 503


class EngineUnavailable(EngineError):
    pass


class EngineProtocolError(EngineError):
    """The engine answered something that does not follow its documented wire format."""


# The class of the tree that stands for each gRPC code (the first one to declare it).
_BY_CODE: dict[str, type[PrimeRLError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        FailedPrecondition,
        ResourceExhausted,
        PermissionDenied,
        Unauthenticated,
        Unimplemented,
        DeadlineExceeded,
        Aborted,
        EngineError,
    )
}


def error_class(code: str) -> type[PrimeRLError]:
    """The class of the tree for a gRPC code name (``PrimeRLError`` for INTERNAL or a code it has no class for):
    the HTTP status of an error relayed from another service with its code."""
    return _BY_CODE.get(code, PrimeRLError)


def grpc_code_name(exc: BaseException) -> str:
    """The gRPC status code name of ``exc``: its ``code`` for a ``PrimeRLError``, INTERNAL for anything else."""
    return exc.code if isinstance(exc, PrimeRLError) else "INTERNAL"


def http_status(exc: BaseException) -> int:
    """The HTTP status of ``exc``: its ``http_status`` for a ``PrimeRLError``, 500 for anything else."""
    return exc.http_status if isinstance(exc, PrimeRLError) else 500
