"""SSRF-safe HTTP fetches (OWASP SSRF cheat sheet; reference spec C4).

Every hop (the first request and each redirect) goes through the same checks:
1. scheme, host and port allowlists;
2. the host is resolved **once** (IP literals, including integer forms such as
   ``2130706433``, are parsed by the same resolver);
3. every resolved address must be allowed: IPv4-mapped / 6to4 / Teredo IPv6 are unwrapped
   first; NAT64 ``64:ff9b::/96`` and ``64:ff9b:1::/48``, IPv4-compatible ``::/96`` and SIIT
   ``::ffff:0:0:0/96`` are blocked explicitly (Python 3.11 reports them global); anything not
   ``is_global`` is blocked (loopback, RFC 1918, CGNAT 100.64/10, link-local and the
   169.254.169.254 metadata address, ...), unless it falls in a CIDR the config exempts
   explicitly; one bad address blocks the hop. A name that cannot be encoded for DNS (label
   over 63 octets, invalid A-label) is ``ToolError(kind="invalid")``;
4. the connection goes to a validated address (the URL host is replaced by the IP, the
   ``Host`` header and TLS SNI keep the name), so a second DNS answer (rebinding) is never
   used; IPv4 addresses are tried first, then IPv6, each in turn while connecting fails;
   connections are never kept alive, so a pooled connection (keyed by IP) whose certificate
   was verified for one name is never reused for another name on the same address;
5. redirects are not followed by httpx; each ``Location`` is re-validated from step 1;
6. the body is read up to ``max_bytes`` and the whole fetch is bounded by ``timeout_s``;
   proxies from the environment are ignored (``trust_env=False``).
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from core.errors import ToolError
from envhub.config import HttpConfig

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Awaitable[list[str]]]

_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
# Deprecated IPv4-embedding forms Python does not unwrap and (3.11) calls global.
_EMBEDDED_V4 = {
    ipaddress.ip_network("::/96"): "an IPv4-compatible address (::/96)",
    ipaddress.ip_network("::ffff:0:0:0/96"): "an SIIT IPv4-translated address (::ffff:0:0:0/96)",
}
_METADATA = ipaddress.ip_address("169.254.169.254")


async def system_resolver(host: str, port: int) -> list[str]:
    """All addresses of ``host`` from the system resolver (handles every IPv4 literal form)."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ToolError(f"cannot resolve {host!r}: {e.strerror}", kind="unavailable") from e
    except ValueError as e:  # UnicodeError / idna.IDNAError: the name cannot be encoded for DNS
        raise ToolError(f"invalid host name {host[:80]!r}: {e}", kind="invalid") from e
    return sorted({str(info[4][0]) for info in infos})


def connect_order(addresses: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """``addresses`` without duplicates, IPv4 first (many hosts have no IPv6 route)."""
    unique = dict.fromkeys(addresses)
    return tuple(a for a in unique if ":" not in a) + tuple(a for a in unique if ":" in a)


def unwrap(ip: IPAddress) -> IPAddress:
    """The IPv4 address an IPv6 address embeds (mapped, 6to4, Teredo), else ``ip``."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
        if ip.sixtofour is not None:
            return ip.sixtofour
        if ip.teredo is not None:
            return ip.teredo[1]
    return ip


def address_block_reason(address: str, allowed: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()) -> str:
    """Why ``address`` must not be contacted ('' when it may)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    inner = unwrap(ip)
    for net in allowed:
        if ip in net or inner in net:
            return ""
    if isinstance(ip, ipaddress.IPv6Address) and any(ip in net for net in _NAT64):
        return f"{address} is a NAT64 address (64:ff9b::/96) that may reach an internal IPv4 host"
    if isinstance(ip, ipaddress.IPv6Address):
        for net, what in _EMBEDDED_V4.items():
            if ip in net:
                return f"{address} is {what} that may reach an internal IPv4 host"
    if inner == _METADATA:
        return f"{address} is the cloud metadata address"
    # A mapped address is non-global by definition: judge the IPv4 inside; any other IPv6
    # (Teredo included) must be global itself and so must what it embeds.
    if (isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is None and not ip.is_global) or not inner.is_global:
        return f"{address} is not a public address"
    if inner.is_multicast:
        return f"{address} is a multicast address"
    return ""


def host_allowed(host: str, patterns: tuple[str, ...]) -> bool:
    if not patterns:
        return True
    host = host.lower().rstrip(".")
    return any(fnmatch.fnmatchcase(host, p.lower()) for p in patterns)


@dataclass(frozen=True, slots=True)
class FetchResult:
    url: str  # the final URL after redirects
    status: int
    content_type: str
    body: bytes
    truncated: bool
    hops: tuple[str, ...]  # every URL requested, in order
    addresses: tuple[str, ...]  # the validated address connected to, per hop

    def text(self) -> str:
        return self.body.decode(errors="replace")


class SafeHttpClient:
    """Fetches URLs under the SSRF guards above."""

    def __init__(self, config: HttpConfig | None = None, resolver: Resolver | None = None) -> None:
        self.config = config or HttpConfig()
        self.resolver = resolver or system_resolver
        self._allowed_nets = tuple(ipaddress.ip_network(n, strict=False) for n in self.config.allowed_private_networks)
        # No keep-alive: httpx pools by (scheme, IP, port), so a kept TLS connection verified
        # for one name would be reused for another name that resolves to the same IP.
        self._client = httpx.AsyncClient(
            follow_redirects=False,
            trust_env=False,
            timeout=self.config.timeout_s,
            verify=True,
            limits=httpx.Limits(max_keepalive_connections=0),
        )

    async def validate(self, url: httpx.URL) -> str:
        """Check one hop's URL and return the address to connect to first (IPv4 preferred)."""
        return (await self.validate_all(url))[0]

    async def validate_all(self, url: httpx.URL) -> tuple[str, ...]:
        """Check one hop's URL; every resolved address (all allowed), in connect order."""
        c = self.config
        if url.scheme not in c.allowed_schemes:
            raise ToolError(f"blocked: scheme {url.scheme!r} is not allowed", kind="blocked")
        try:
            host = url.host  # decodes A-labels: an invalid one (xn--zz) raises IDNAError
            wire_host = url.raw_host.decode("ascii")  # the name as sent in Host and SNI
        except ValueError as e:
            raise ToolError(f"invalid host name in {str(url)[:120]!r}: {e}", kind="invalid") from e
        if not host:
            raise ToolError(f"blocked: {url} has no host", kind="blocked")
        if url.userinfo:
            raise ToolError("blocked: credentials in URLs are not allowed", kind="blocked")
        port = url.port or (443 if url.scheme == "https" else 80)
        if c.allowed_ports and port not in c.allowed_ports:
            raise ToolError(f"blocked: port {port} is not allowed", kind="blocked")
        if not host_allowed(host, c.allowed_hosts):
            raise ToolError(f"blocked: host {host!r} is not in the allowlist", kind="blocked")
        # Resolve the ASCII form that goes on the wire: Python's own IDNA codec (2003) could
        # map a Unicode name to a different host than httpx's IDNA 2008 encoding.
        addresses = await self.resolver(wire_host, port)
        if not addresses:
            raise ToolError(f"cannot resolve {host!r}", kind="unavailable")
        for addr in addresses:
            why = address_block_reason(addr, self._allowed_nets)
            if why:
                raise ToolError(f"blocked: {host!r} -> {why}", kind="blocked")
        return connect_order(addresses)

    async def fetch(self, url: str, method: str = "GET") -> FetchResult:
        """Fetch ``url`` (following re-validated redirects); ``ToolError`` when a guard refuses."""
        try:
            async with asyncio.timeout(self.config.timeout_s):
                return await self._fetch(url, method)
        except TimeoutError as e:
            raise ToolError(f"fetch of {url} exceeded {self.config.timeout_s:g} s", kind="timeout") from e

    async def _fetch(self, url: str, method: str) -> FetchResult:
        try:
            current = httpx.URL(url)
        except (httpx.InvalidURL, ValueError) as e:
            raise ToolError(f"invalid URL {url!r}: {e}", kind="invalid") from e
        hops: list[str] = []
        addresses: list[str] = []
        for _ in range(self.config.max_redirects + 1):
            candidates = await self.validate_all(current)
            hops.append(str(current))
            address, (resp_status, headers, body, truncated) = await self._request_any(method, current, candidates)
            addresses.append(address)
            location = headers.get("location")
            if resp_status in (301, 302, 303, 307, 308) and location:
                try:
                    current = current.join(location)
                except (httpx.InvalidURL, ValueError) as e:
                    raise ToolError(f"blocked: invalid redirect target {location!r}", kind="blocked") from e
                if resp_status == 303:
                    method = "GET"
                continue
            return FetchResult(
                url=str(current),
                status=resp_status,
                content_type=headers.get("content-type", ""),
                body=body,
                truncated=truncated,
                hops=tuple(hops),
                addresses=tuple(addresses),
            )
        raise ToolError(f"blocked: more than {self.config.max_redirects} redirects", kind="blocked")

    async def _request_any(
        self, method: str, url: httpx.URL, candidates: tuple[str, ...]
    ) -> tuple[str, tuple[int, httpx.Headers, bytes, bool]]:
        """The first validated address that accepts the connection, and its response."""
        for i, address in enumerate(candidates):
            try:
                return address, await self._request(method, url, address)
            except _ConnectFailed as e:
                if i == len(candidates) - 1:
                    raise ToolError(str(e), kind="unavailable") from e.__cause__
        raise AssertionError("validate_all returns at least one address")

    async def _request(self, method: str, url: httpx.URL, address: str) -> tuple[int, httpx.Headers, bytes, bool]:
        target = url.copy_with(host=address)
        host_header = url.netloc.decode("ascii").rsplit("@", 1)[-1]
        extensions = {"sni_hostname": url.raw_host.decode("ascii")} if url.scheme == "https" else {}
        request = self._client.build_request(method, target, headers={"Host": host_header}, extensions=extensions)
        cap = self.config.max_bytes
        try:
            resp = await self._client.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # nothing sent yet: the next address may work
            raise _ConnectFailed(f"fetch of {url} failed: {type(e).__name__}: {e} (via {address})") from e
        except httpx.HTTPError as e:
            raise ToolError(f"fetch of {url} failed: {type(e).__name__}: {e}", kind="unavailable") from e
        try:
            body = bytearray()
            truncated = False
            async for chunk in resp.aiter_bytes():  # decoded: the cap bounds decompressed size
                body += chunk
                if len(body) > cap:
                    del body[cap:]
                    truncated = True
                    break
            return resp.status_code, resp.headers, bytes(body), truncated
        except httpx.HTTPError as e:
            raise ToolError(f"fetch of {url} failed: {type(e).__name__}: {e}", kind="unavailable") from e
        finally:
            with contextlib.suppress(httpx.HTTPError):
                await resp.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()


class _ConnectFailed(Exception):
    """Connecting to one validated address failed before anything was sent."""
