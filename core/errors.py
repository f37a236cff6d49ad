"""The bridge's one error hierarchy: every error a user can cause or observe.

Every library package raises these (engines, cache, placement, speculation, grpo, envhub), so
they live in the lowest layer, ``engines``, which imports nothing above it. Each class names its
gRPC status code once as a string (``code``); ``server.errors`` is the one place that turns the
string into a ``grpc.StatusCode``, so this module stays pure Python (no grpc import) and no
library package depends on the RPC layer.

::

    PrimeRLError                      INTERNAL (a bug; never raised for bad input)
    ├── InvalidArgument               INVALID_ARGUMENT  bad field values, unknown model
    │   └── TokenOutOfVocabulary      INVALID_ARGUMENT  id < 0 or >= vocab size
    ├── NotFound                      NOT_FOUND         unknown / already-ended episode
    ├── FailedPrecondition            FAILED_PRECONDITION
    │   ├── EpisodeBusy               FAILED_PRECONDITION  a Step is already running
    │   └── ToolError                 FAILED_PRECONDITION  an env tool refused or failed (envhub)
    ├── ResourceExhausted             RESOURCE_EXHAUSTED  admission limits
    ├── PermissionDenied              PERMISSION_DENIED   another tenant's episode
    ├── Unauthenticated               UNAUTHENTICATED
    ├── Unimplemented                 UNIMPLEMENTED     e.g. engine cannot reload weights
    ├── DeadlineExceeded              DEADLINE_EXCEEDED
    ├── Aborted                       ABORTED           turn cancelled / engine aborted it
    └── EngineError                   UNAVAILABLE       engine unreachable or failing
        ├── EngineUnavailable         UNAVAILABLE
        └── EngineProtocolError       UNAVAILABLE       malformed engine response
"""

from __future__ import annotations


class PrimeRLError(Exception):
    """Base of every error the bridge raises on purpose."""

    code: str = "INTERNAL"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(PrimeRLError):
    code = "INVALID_ARGUMENT"


class TokenOutOfVocabulary(InvalidArgument):
    pass


class NotFound(PrimeRLError):
    code = "NOT_FOUND"


class FailedPrecondition(PrimeRLError):
    code = "FAILED_PRECONDITION"


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

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s  # sent as `retry-after-ms` trailing metadata when set


class PermissionDenied(PrimeRLError):
    code = "PERMISSION_DENIED"


class Unauthenticated(PrimeRLError):
    code = "UNAUTHENTICATED"


class Unimplemented(PrimeRLError):
    code = "UNIMPLEMENTED"


class DeadlineExceeded(PrimeRLError):
    code = "DEADLINE_EXCEEDED"


class Aborted(PrimeRLError):
    code = "ABORTED"


class EngineError(PrimeRLError):
    """The engine failed; the request may succeed on another replica or later."""

    code = "UNAVAILABLE"


class EngineUnavailable(EngineError):
    pass


class EngineProtocolError(EngineError):
    """The engine answered something that does not follow its documented wire format."""
