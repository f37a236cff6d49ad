"""SSRF-safe HTTP fetches (OWASP SSRF cheat sheet; reference spec C4).

Every hop (the first request and each redirect) goes through the same checks:
1. scheme, host and port allowlists;
2. the host is resolved **once** (IP literals, including integer forms such as
   ``2130706433``, are parsed by the same resolver);
3. every resolved address must be allowed: IPv4-mapped / 6to4 / Teredo IPv6 are unwrapped
   first; NAT64 ``64:ff9b::/96`` and ``64:ff9b:1::/48`` are blocked explicitly (Python
   reports them global); anything not ``is_global`` is blocked (loopback, RFC 1918, CGNAT
   100.64/10, link-local and the 169.254.169.254 metadata address, ...), unless it falls in
   a CIDR the config exempts explicitly; one bad address blocks the hop;
4. the connection goes to the validated address (the URL host is replaced by the IP, the
   ``Host`` header and TLS SNI keep the name), so a second DNS answer (rebinding) is never
   used;
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

from envhub.config import HttpConfig
from server.errors import ToolError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Awaitable[list[str]]]

_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_METADATA = ipaddress.ip_address("169.254.169.254")


async def system_resolver(host: str, port: int) -> list[str]:
    """All addresses of ``host`` from the system resolver (handles every IPv4 literal form)."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ToolError(f"cannot resolve {host!r}: {e.strerror}", kind="unavailable") from e
    return sorted({str(info[4][0]) for info in infos})


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
        self._client = httpx.AsyncClient(
            follow_redirects=False, trust_env=False, timeout=self.config.timeout_s, verify=True
        )

    async def validate(self, url: httpx.URL) -> str:
        """Check one hop's URL and return the single address to connect to."""
        c = self.config
        if url.scheme not in c.allowed_schemes:
            raise ToolError(f"blocked: scheme {url.scheme!r} is not allowed", kind="blocked")
        host = url.host
        if not host:
            raise ToolError(f"blocked: {url} has no host", kind="blocked")
        if url.userinfo:
            raise ToolError("blocked: credentials in URLs are not allowed", kind="blocked")
        port = url.port or (443 if url.scheme == "https" else 80)
        if c.allowed_ports and port not in c.allowed_ports:
            raise ToolError(f"blocked: port {port} is not allowed", kind="blocked")
        if not host_allowed(host, c.allowed_hosts):
            raise ToolError(f"blocked: host {host!r} is not in the allowlist", kind="blocked")
        addresses = await self.resolver(host, port)
        if not addresses:
            raise ToolError(f"cannot resolve {host!r}", kind="unavailable")
        for addr in addresses:
            why = address_block_reason(addr, self._allowed_nets)
            if why:
                raise ToolError(f"blocked: {host!r} -> {why}", kind="blocked")
        return addresses[0]

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
            address = await self.validate(current)
            hops.append(str(current))
            addresses.append(address)
            resp_status, headers, body, truncated = await self._request(method, current, address)
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

    async def _request(self, method: str, url: httpx.URL, address: str) -> tuple[int, httpx.Headers, bytes, bool]:
        ip_host = f"[{address}]" if ":" in address else address
        target = url.copy_with(host=ip_host.strip("[]"))
        host_header = url.netloc.decode("ascii").rsplit("@", 1)[-1]
        extensions = {"sni_hostname": url.host} if url.scheme == "https" else {}
        request = self._client.build_request(method, target, headers={"Host": host_header}, extensions=extensions)
        cap = self.config.max_bytes
        try:
            resp = await self._client.send(request, stream=True)
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
