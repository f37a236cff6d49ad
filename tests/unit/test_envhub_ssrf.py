"""SSRF guards without sockets: address classification and per-hop validation.

Host names are resolved by a working in-memory resolver (the DNS layer's fake, like
httpx's MockTransport); IP literals go through the system resolver, which parses them
without any network I/O.
"""

from __future__ import annotations

import httpx
import pytest

from core.errors import ToolError
from envhub.config import HttpConfig
from envhub.connectors.http import SafeHttpClient, address_block_reason, system_resolver

BLOCKED = [
    "127.0.0.1",
    "127.1.2.3",
    "::1",
    "::ffff:127.0.0.1",
    "::ffff:10.0.0.1",
    "64:ff9b::7f00:1",
    "64:ff9b::a9fe:a9fe",
    "64:ff9b:1::a00:1",
    "169.254.169.254",
    "10.0.0.1",
    "172.16.5.4",
    "192.168.1.1",
    "100.64.0.1",
    "100.127.255.254",
    "0.0.0.0",
    "::",
    "fe80::1",
    "fc00::1",
    "2002:7f00:1::",  # 6to4 wrapping 127.0.0.1
    "2001:0:4136:e378:8000:63bf:3fff:fdd2",  # Teredo
    "224.0.0.1",
    "::7f00:1",  # IPv4-compatible (::/96) wrapping 127.0.0.1
    "::808:808",  # IPv4-compatible is deprecated: blocked whatever it wraps
    "::ffff:0:7f00:1",  # SIIT IPv4-translated (::ffff:0:0:0/96) wrapping 127.0.0.1
    "::ffff:0:808:808",
]
ALLOWED = ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8"]


@pytest.mark.parametrize("address", BLOCKED)
def test_non_global_addresses_are_blocked(address: str) -> None:
    assert address_block_reason(address) != ""


@pytest.mark.parametrize("address", ALLOWED)
def test_public_addresses_pass(address: str) -> None:
    assert address_block_reason(address) == ""


def make_resolver(table: dict[str, list[list[str]]], log: list[str]):  # type: ignore[no-untyped-def]
    """Answers names from ``table`` (successive answers per name, like a rebinding server)."""

    async def resolve(host: str, port: int) -> list[str]:
        log.append(host)
        if host in table:
            answers = table[host]
            return answers[min(len([h for h in log if h == host]) - 1, len(answers) - 1)]
        return await system_resolver(host, port)

    return resolve


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/",
        "http://localhost/",
        "http://[::1]/",
        "http://[::ffff:127.0.0.1]/",
        "http://[64:ff9b::7f00:1]/",
        "http://2130706433/",
        "http://0x7f000001/",
        "http://017700000001/",
        "http://169.254.169.254/latest/meta-data/",
        "http://10.1.2.3/",
        "http://100.64.0.1/",
        "http://internal.test/",  # resolves to a private address
        "http://mixed.test/",  # one public, one private answer
    ],
)
async def test_validate_blocks(url: str) -> None:
    log: list[str] = []
    table = {"internal.test": [["10.0.0.7"]], "mixed.test": [["8.8.8.8", "127.0.0.1"]]}
    client = SafeHttpClient(HttpConfig(), resolver=make_resolver(table, log))
    with pytest.raises(ToolError) as err:
        await client.validate(httpx.URL(url))
    assert err.value.kind == "blocked"
    await client.aclose()


async def test_validate_allowlists_and_returns_the_one_validated_address() -> None:
    log: list[str] = []
    table = {"shop.example": [["93.184.216.34"], ["127.0.0.1"]]}  # rebinding: second answer is loopback
    client = SafeHttpClient(
        HttpConfig(allowed_hosts=("shop.example", "*.docs.example")), resolver=make_resolver(table, log)
    )
    assert await client.validate(httpx.URL("https://shop.example/a")) == "93.184.216.34"
    assert log == ["shop.example"]  # resolved exactly once per hop
    with pytest.raises(ToolError, match="allowlist"):
        await client.validate(httpx.URL("https://evil.example/"))
    with pytest.raises(ToolError, match="scheme"):
        await client.validate(httpx.URL("file:///etc/passwd"))
    with pytest.raises(ToolError, match="port"):
        await client.validate(httpx.URL("http://shop.example:6379/"))
    with pytest.raises(ToolError, match="credentials"):
        await client.validate(httpx.URL("http://user:pw@shop.example/"))
    # The next hop asks DNS again and gets the rebinding answer: blocked.
    with pytest.raises(ToolError, match="not a public address"):
        await client.validate(httpx.URL("https://shop.example/b"))
    await client.aclose()


async def test_explicit_private_exemption_is_narrow() -> None:
    client = SafeHttpClient(HttpConfig(allowed_private_networks=("127.0.0.1/32",)))
    assert await client.validate(httpx.URL("http://127.0.0.1/")) == "127.0.0.1"
    for url in ("http://127.0.0.2/", "http://10.0.0.1/", "http://169.254.169.254/"):
        with pytest.raises(ToolError):
            await client.validate(httpx.URL(url))
    await client.aclose()


@pytest.mark.parametrize(
    "url",
    [
        "http://" + "a" * 64 + ".com/",  # a DNS label over 63 octets
        "http://a..b/",  # an empty label
        "http://xn--zz.com/",  # an invalid A-label
    ],
)
async def test_unencodable_host_names_are_invalid_not_a_crash(url: str) -> None:
    client = SafeHttpClient(HttpConfig())
    for call in (client.validate(httpx.URL(url)), client.fetch(url)):
        with pytest.raises(ToolError) as err:
            await call
        assert err.value.kind == "invalid"
    if "xn--" not in url:  # (an ASCII "xn--" name passes the codec: a DNS lookup, not here)
        with pytest.raises(ToolError) as err:  # the resolver maps the codec's errors itself too
            await system_resolver(url.split("/")[2], 80)
        assert err.value.kind == "invalid"
    await client.aclose()


async def test_validate_prefers_ipv4_and_returns_every_address_in_order() -> None:
    log: list[str] = []
    table = {"dual.example": [["2606:4700:4700::1111", "2001:4860:4860::8888", "8.8.8.8", "1.1.1.1"]]}
    client = SafeHttpClient(HttpConfig(), resolver=make_resolver(table, log))
    # hosts without IPv6 connectivity must not be handed an IPv6 address first
    assert await client.validate(httpx.URL("https://dual.example/")) == "8.8.8.8"
    assert await client.validate_all(httpx.URL("https://dual.example/")) == (
        "8.8.8.8",
        "1.1.1.1",
        "2606:4700:4700::1111",
        "2001:4860:4860::8888",
    )
    await client.aclose()
