"""Browser connector in real headless Chromium against the local test site (acceptance point 5)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator

import pytest

from core.errors import ToolError
from envhub import EnvHubConfig, make_env
from envhub.config import BrowserConfig
from envhub.connectors.browser import BrowserSession, origin_of
from envhub.loop import ToolLoop
from tests.integration.testsite import serve_test_site


@pytest.fixture(scope="module")
def site() -> Iterator[str]:
    with serve_test_site() as url:
        yield url


@pytest.fixture
async def browser(site: str) -> AsyncIterator[BrowserSession]:
    session = BrowserSession(BrowserConfig(allowed_origins=(site.rstrip("/"),), timeout_s=10))
    await session.start()
    try:
        yield session
    finally:
        await session.close()


def test_origin_of() -> None:
    assert origin_of("http://127.0.0.1:8000/a?b") == "http://127.0.0.1:8000"
    assert origin_of("https://Example.org/x") == "https://example.org:443"
    assert origin_of("not a url") == ""


async def test_navigate_click_extract(browser: BrowserSession, site: str) -> None:
    info = await browser.navigate(site)
    assert "status 200" in info and "Envhub Test Shop" in info
    assert await browser.extract_text("#hours") == "Hours hidden"
    await browser.click("#reveal")  # runs the page's JavaScript
    assert await browser.extract_text("#hours") == "Open 09:00-17:00, Monday to Friday"
    await browser.click("text=Blue Widget")  # follows a link
    assert browser.url == site + "products/blue-widget.html"
    assert await browser.extract_text(".price") == "Price: 42.50 EUR"
    assert "In stock: 17 units" in await browser.extract_text()
    png = await browser.screenshot()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000


async def test_non_allowlisted_origins_are_blocked(browser: BrowserSession, site: str) -> None:
    with pytest.raises(ToolError) as err:
        await browser.navigate("http://169.254.169.254/latest/meta-data/")
    assert err.value.kind == "blocked"
    # A subresource on another origin is aborted by the route handler, the page itself loads.
    await browser.navigate(site + "about.html")
    assert "founded in 2011" in await browser.extract_text()
    assert browser.blocked == ["http://169.254.169.254/latest/meta-data/logo.png"]
    # A redirect to a non-allowlisted origin never loads.
    with pytest.raises(ToolError) as err:
        await browser.navigate(site + "redirect?to=http%3A%2F%2F10.0.0.1%2F")
    assert err.value.kind in ("blocked", "unavailable")
    assert "http://10.0.0.1/" in browser.blocked


async def test_bad_selector_is_a_tool_error(browser: BrowserSession, site: str) -> None:
    await browser.navigate(site)
    with pytest.raises(ToolError) as err:
        await browser.extract_text("#does-not-exist")
    assert err.value.kind == "invalid"


async def test_missing_browser_is_reported() -> None:
    with pytest.raises(ToolError, match="not installed"):
        await BrowserSession(BrowserConfig(executable="/nonexistent/chromium")).start()


async def test_web_browse_env_episode(site: str) -> None:
    env = make_env("web-browse", EnvHubConfig(web_site_url=site))
    await env.reset(task_id="web-2")
    loop = ToolLoop(env)

    def call(name: str, **args: str) -> str:
        return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"

    d = await loop.on_turn(call("navigate", url="products/red-gadget.html"))
    assert "title 'Red Gadget'" in d.observation[0].content
    d = await loop.on_turn(call("extract_text", selector=".stock") + call("screenshot"))
    assert d.observation[0].content == "In stock: 4 units"
    assert d.observation[1].content.startswith("screenshot taken: PNG")
    d = await loop.on_turn(call("navigate", url="http://10.0.0.1/"))
    assert d.observation[0].content.startswith("error (blocked)")
    d = await loop.on_turn("<answer>4</answer>")
    assert d.done and d.reward == 1.0
    await env.close()
