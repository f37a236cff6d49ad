"""SSRF-safe HTTP against a real local server (acceptance point 3, network half)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from urllib.parse import quote

import pytest

from core.errors import ToolError
from envhub.config import HttpConfig
from envhub.connectors.http import SafeHttpClient, system_resolver
from tests.integration.testsite import serve_test_site


@pytest.fixture(scope="module")
def site() -> Iterator[str]:
    with serve_test_site() as url:
        yield url


def local_config(**kw: object) -> HttpConfig:
    """The local test site is on 127.0.0.1: exempt exactly that address, any port."""
    return HttpConfig(allowed_ports=(), allowed_private_networks=("127.0.0.1/32",), **kw)


async def test_default_config_blocks_the_local_site(site: str) -> None:
    client = SafeHttpClient(HttpConfig(allowed_ports=()))
    port = site.rsplit(":", 1)[1].strip("/")
    for url in (site, f"http://localhost:{port}/", f"http://[::1]:{port}/", f"http://2130706433:{port}/"):
        with pytest.raises(ToolError) as err:
            await client.fetch(url)
        assert err.value.kind == "blocked", url
    await client.aclose()


async def test_allowlisted_local_site_works(site: str) -> None:
    client = SafeHttpClient(local_config())
    result = await client.fetch(site + "products/blue-widget.html")
    assert result.status == 200 and "Price: 42.50 EUR" in result.text()
    assert result.addresses == ("127.0.0.1",)
    await client.aclose()


@pytest.mark.parametrize("target", ["http://169.254.169.254/latest/meta-data/", "http://10.0.0.1/", "http://[::1]/"])
async def test_redirect_to_blocked_address_is_blocked(site: str, target: str) -> None:
    client = SafeHttpClient(local_config())
    with pytest.raises(ToolError) as err:
        await client.fetch(site + "redirect?to=" + quote(target, safe=""))
    assert err.value.kind == "blocked"
    await client.aclose()


async def test_allowed_redirect_is_followed_and_revalidated(site: str) -> None:
    client = SafeHttpClient(local_config())
    result = await client.fetch(site + "redirect?to=" + quote(site + "about.html", safe=""))
    assert result.status == 200 and "founded in 2011" in result.text()
    assert len(result.hops) == 2 and result.addresses == ("127.0.0.1", "127.0.0.1")
    loop = SafeHttpClient(local_config(max_redirects=1))
    with pytest.raises(ToolError, match="redirects"):
        await loop.fetch(site + "redirect?to=" + quote(site + "redirect?to=" + quote(site, safe=""), safe=""))
    await client.aclose()
    await loop.aclose()


async def test_dns_rebinding_connects_to_the_validated_address(site: str) -> None:
    """The name first resolves to the (allowed) site, then to a metadata address.

    The fetch resolves once and connects to the validated address, so it reaches the site
    with the original Host header; a later hop that re-resolves is blocked.
    """
    port = int(site.rsplit(":", 1)[1].strip("/"))
    answers = [["127.0.0.1"], ["169.254.169.254"]]
    asked: list[str] = []

    async def rebinding(host: str, p: int) -> list[str]:
        if host != "rebind.test":
            return await system_resolver(host, p)
        asked.append(host)
        return answers[min(len(asked), 2) - 1]

    client = SafeHttpClient(local_config(), resolver=rebinding)
    result = await client.fetch(f"http://rebind.test:{port}/index.html")
    assert result.status == 200 and "Envhub Test Shop" in result.text() and asked == ["rebind.test"]
    with pytest.raises(ToolError, match="metadata"):
        await client.fetch(f"http://rebind.test:{port}/index.html")
    await client.aclose()


async def test_size_cap(site: str) -> None:
    client = SafeHttpClient(local_config(max_bytes=10_000))
    result = await client.fetch(site + "big")
    assert result.truncated and len(result.body) == 10_000
    await client.aclose()


async def test_each_host_name_gets_its_own_connection() -> None:
    """Two names on one address must not share a pooled connection (over TLS the reused one
    would carry a certificate verified for the first name only)."""
    connections = 0
    hosts: list[str] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        with contextlib.suppress(ConnectionError):
            while head := await reader.readuntil(b"\r\n\r\n"):
                hosts.append(
                    next(
                        h.split(b":", 1)[1].strip().decode()
                        for h in head.split(b"\r\n")
                        if h.lower().startswith(b"host:")
                    )
                )
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok")
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    async def resolve(host: str, p: int) -> list[str]:
        return ["127.0.0.1"]

    client = SafeHttpClient(local_config(), resolver=resolve)
    for name in ("one.test", "two.test", "one.test"):
        assert (await client.fetch(f"http://{name}:{port}/")).body == b"ok"
    await client.aclose()
    server.close()
    await server.wait_closed()
    assert hosts == [f"one.test:{port}", f"two.test:{port}", f"one.test:{port}"]
    assert connections == 3


async def test_each_validated_address_is_tried_in_turn(site: str) -> None:
    """127.0.0.2 refuses (the site binds 127.0.0.1 only); the fetch goes on to the next address."""
    port = int(site.rsplit(":", 1)[1].strip("/"))

    async def resolve(host: str, p: int) -> list[str]:
        return ["127.0.0.2", "127.0.0.1"] if host == "two.test" else await system_resolver(host, p)

    client = SafeHttpClient(HttpConfig(allowed_ports=(), allowed_private_networks=("127.0.0.0/8",)), resolver=resolve)
    result = await client.fetch(f"http://two.test:{port}/index.html")
    assert result.status == 200 and "Envhub Test Shop" in result.text()
    assert result.addresses == ("127.0.0.1",)
    await client.aclose()
