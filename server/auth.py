"""Bearer-token authentication, tenants, TLS credentials and the admin audit log.

Invariants
----------
* Tokens are never stored or logged in clear: the bridge keeps ``sha256(token)`` hex digests
  (``auth.token_hashes`` / ``auth.tokens_file`` lines ``TENANT:SHA256HEX``), compares digests in
  constant time, and logs only tenant names.
* With authentication on, every PrimeRL RPC needs ``authorization: Bearer <token>`` metadata;
  a missing or unknown token is UNAUTHENTICATED before any handler runs. The gRPC health and
  reflection services stay open (probes carry no tokens and reveal nothing).
* The tenant of the caller travels to the handler in a ``ContextVar`` set by the interceptor;
  episodes are owned by the tenant that created them (``server.episodes.EpisodeStore``), so
  another tenant's Step or EndEpisode is PERMISSION_DENIED.
* With TLS configured the bridge binds only a TLS port (plaintext clients cannot connect); with
  ``tls.client_ca_file`` set, clients must present a certificate signed by that CA (mTLS).
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import logging
from pathlib import Path
from typing import Any

import grpc
from pydantic import BaseModel, ConfigDict, Field

from server.errors import InvalidArgument
from server.handlers import HandlerInterceptor, same_kind

audit = logging.getLogger("primerl.audit")

current_tenant: contextvars.ContextVar[str] = contextvars.ContextVar("primerl_tenant", default="")

OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
ADMIN_METHODS = frozenset({"/primerl.v1.PrimeRL/UpdateWeights"})


class AuthConfig(BaseModel):
    """Who may call the bridge. Off when no token hash is configured."""

    model_config = ConfigDict(extra="forbid")

    token_hashes: list[str] = Field(
        default_factory=list,
        description="Entries 'TENANT:SHA256HEX' (sha256 of the bearer token); `primerl hash-token TENANT` makes one.",
    )
    tokens_file: str = Field("", description="File with one 'TENANT:SHA256HEX' per line ('#' comments allowed).")
    admin_tenants: list[str] = Field(
        default_factory=list,
        description="Tenants allowed to call UpdateWeights when authentication is on; empty allows none.",
    )


class TlsConfig(BaseModel):
    """Transport security of the gRPC port. Off when no certificate is configured."""

    model_config = ConfigDict(extra="forbid")

    cert_file: str = Field("", description="PEM server certificate chain; set together with key_file to enable TLS.")
    key_file: str = Field("", description="PEM private key of the server certificate.")
    client_ca_file: str = Field("", description="PEM CA bundle; when set, clients must present a certificate (mTLS).")


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def load_tenants(config: AuthConfig) -> dict[str, str]:
    """Map of sha256 digest -> tenant; raise InvalidArgument naming a malformed entry."""
    entries = [(f"auth.token_hashes[{i}]", e) for i, e in enumerate(config.token_hashes)]
    if config.tokens_file:
        path = Path(config.tokens_file).expanduser()
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise InvalidArgument(f"auth.tokens_file {str(path)!r} cannot be read: {exc.strerror}") from None
        entries += [(f"{path}:{n}", line.strip()) for n, line in enumerate(lines, 1)]
    tenants: dict[str, str] = {}
    for where, entry in entries:
        if not entry or entry.startswith("#"):
            continue
        tenant, _, digest = entry.partition(":")
        digest = digest.strip().lower()
        if not tenant.strip() or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise InvalidArgument(f"{where}: expected 'TENANT:SHA256HEX' (64 hex digits), got {entry[:80]!r}")
        tenants[digest] = tenant.strip()
    if entries and not tenants:  # configured, but nothing usable: never fall back to no authentication
        raise InvalidArgument(
            "authentication is configured (auth.token_hashes / auth.tokens_file) but has no 'TENANT:SHA256HEX' "
            "entry; refusing to start without authentication"
        )
    return tenants


def server_credentials(config: TlsConfig) -> grpc.ServerCredentials | None:
    """TLS credentials for the gRPC port, or None for plaintext."""
    if not config.cert_file and not config.key_file:
        if config.client_ca_file:
            raise InvalidArgument("tls.client_ca_file needs tls.cert_file and tls.key_file")
        return None
    if not (config.cert_file and config.key_file):
        raise InvalidArgument("TLS needs both tls.cert_file and tls.key_file")

    def read(name: str, value: str) -> bytes:
        try:
            return Path(value).expanduser().read_bytes()
        except OSError as exc:
            raise InvalidArgument(f"tls.{name} {value!r} cannot be read: {exc.strerror}") from None

    pair = [(read("key_file", config.key_file), read("cert_file", config.cert_file))]
    if config.client_ca_file:
        ca = read("client_ca_file", config.client_ca_file)
        return grpc.ssl_server_credentials(pair, root_certificates=ca, require_client_auth=True)
    return grpc.ssl_server_credentials(pair)


def tenant_for(tenants: dict[str, str], token: str | None) -> str | None:
    """The tenant whose token this is (``tenants``: digest -> tenant, from ``load_tenants``), or None.

    Shared by the gRPC interceptor and the HTTP front door, so both surfaces accept the same tokens.
    """
    if not token:
        return None
    digest = hash_token(token)
    found = None
    for known, tenant in tenants.items():  # constant-time per entry, and every entry is compared
        if hmac.compare_digest(known, digest):
            found = tenant
    return found


def bearer_token(value: str | None) -> str | None:
    """The token of an ``authorization: Bearer <token>`` value (None for another scheme or none)."""
    if not value:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _bearer(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            return bearer_token(value)
    return None


class AuthInterceptor(HandlerInterceptor):
    """Authenticates each call and runs its handler with ``current_tenant`` set."""

    def __init__(self, tenants: dict[str, str], admin_tenants: list[str] | None = None) -> None:
        self._tenants = tenants
        self._admins = frozenset(admin_tenants or ())

    def _tenant_for(self, token: str | None) -> str | None:
        return tenant_for(self._tenants, token)

    def wrap(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = details.method
        if method.startswith(OPEN_SERVICES):
            return handler
        token = _bearer(details.invocation_metadata)
        tenant = self._tenant_for(token)
        if tenant is None:
            message = "missing bearer token" if not token else "invalid bearer token"
            return _deny(handler, grpc.StatusCode.UNAUTHENTICATED, f"{message}: send 'authorization: Bearer <token>'")
        if method in ADMIN_METHODS:
            allowed = tenant in self._admins
            audit.info("tenant %r called %s: %s", tenant, method, "allowed" if allowed else "denied")
            if not allowed:
                message = f"tenant {tenant!r} may not call {method.rsplit('/', 1)[-1]}; list it in auth.admin_tenants"
                return _deny(handler, grpc.StatusCode.PERMISSION_DENIED, message)
        return _with_tenant(handler, tenant)


def _with_tenant(handler: grpc.RpcMethodHandler, tenant: str) -> grpc.RpcMethodHandler:
    if handler.response_streaming:
        inner_stream: Any = handler.unary_stream

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            token = current_tenant.set(tenant)
            try:
                async for item in inner_stream(request, context):
                    yield item
            finally:
                current_tenant.reset(token)

        return same_kind(handler, stream)
    inner_unary: Any = handler.unary_unary

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        token = current_tenant.set(tenant)
        try:
            return await inner_unary(request, context)
        finally:
            current_tenant.reset(token)

    return same_kind(handler, unary)


def _deny(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    async def abort(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    if handler.response_streaming:

        async def abort_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(code, message)
            yield  # pragma: no cover - abort raises

        return same_kind(handler, abort_stream)
    return same_kind(handler, abort)
