"""Headless Chromium (Debian's ``chromium``) driven by Playwright's Python API.

Invariants:
- Playwright never downloads a browser: ``executable`` (``/usr/bin/chromium``) is launched.
- Only allowlisted origins load: every request the page makes (documents, subresources)
  goes through a route handler that aborts other origins and fetches allowed ones itself
  without following redirects, so each redirect hop is checked too; the page's final URL
  is checked after each navigation. No allowlist means nothing loads.
- Every action has a timeout (launch a longer one of its own: a cold first start builds caches);
  page text returned to the model is capped.
- Chromium's own sandbox cannot run as root; the flag ``--no-sandbox`` is passed only then.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urljoin, urlsplit

from core.errors import ToolError
from envhub.config import BrowserConfig


def origin_of(url: str) -> str:
    parts = urlsplit(url)
    if not parts.scheme or not parts.hostname:
        return ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.scheme}://{parts.hostname.lower()}:{port}"


class BrowserSession:
    """One browser page (one per episode); call ``start`` first and ``close`` at the end."""

    def __init__(self, config: BrowserConfig | None = None) -> None:
        self.config = config or BrowserConfig()
        self._allowed = {origin_of(o) for o in self.config.allowed_origins}
        self._pw: Any = None
        self._browser: Any = None
        self._page: Any = None
        self.blocked: list[str] = []  # URLs the route handler aborted (for tests and logs)

    def allowed(self, url: str) -> bool:
        if url.startswith(("about:blank", "data:")):
            return url.startswith("about:blank")
        return origin_of(url) in self._allowed

    async def start(self) -> None:
        from playwright.async_api import Error as PlaywrightError
        from playwright.async_api import async_playwright

        if not os.access(self.config.executable, os.X_OK):
            raise ToolError(f"browser {self.config.executable} is not installed", kind="unavailable")
        self._pw = await async_playwright().start()
        args = ["--no-sandbox"] if os.geteuid() == 0 else []
        try:
            self._browser = await self._pw.chromium.launch(
                executable_path=self.config.executable,
                headless=True,
                args=[*args, "--disable-gpu", "--disable-dev-shm-usage"],
                timeout=self.config.launch_timeout_s * 1000,
            )
            context = await self._browser.new_context(service_workers="block", accept_downloads=False)
            await context.route("**/*", self._route)
            self._page = await context.new_page()
            self._page.set_default_timeout(self.config.timeout_s * 1000)
        except PlaywrightError as e:
            await self.close()
            raise ToolError(f"cannot start the browser: {e.message}", kind="unavailable") from e

    async def _route(self, route: Any) -> None:
        """Fetch allowed requests ourselves without following redirects, so every hop is checked.

        Chromium follows a redirect internally without routing the new hop, so a plain
        ``continue_`` would let an allowlisted page redirect the browser anywhere.
        """
        from playwright.async_api import Error as PlaywrightError

        url = route.request.url
        if not self.allowed(url):
            self.blocked.append(url)
            await route.abort("blockedbyclient")
            return
        try:
            response = await route.fetch(max_redirects=0, timeout=self.config.timeout_s * 1000)
        except PlaywrightError:
            await route.abort("failed")
            return
        location = response.headers.get("location")
        if 300 <= response.status < 400 and location:
            target = urljoin(url, location)
            if not self.allowed(target):
                self.blocked.append(target)
                await route.abort("blockedbyclient")
                return
        await route.fulfill(response=response)

    def _require_page(self) -> Any:
        if self._page is None:
            raise ToolError("the browser is not started", kind="unavailable")
        return self._page

    async def navigate(self, url: str) -> str:
        """Open ``url``; returns the page title and final URL."""
        from playwright.async_api import Error as PlaywrightError

        page = self._require_page()
        if not self.allowed(url):
            raise ToolError(f"blocked: {origin_of(url) or url!r} is not an allowlisted origin", kind="blocked")
        try:
            resp = await page.goto(url, wait_until="load")
        except PlaywrightError as e:
            raise ToolError(f"navigation to {url} failed: {e.message.splitlines()[0]}", kind="unavailable") from e
        if not self.allowed(page.url):
            await page.goto("about:blank")
            raise ToolError(f"blocked: navigation ended on {page.url!r}, not an allowlisted origin", kind="blocked")
        status = resp.status if resp is not None else 0
        return f"status {status}; title {await page.title()!r}; url {page.url}"

    async def click(self, selector: str) -> str:
        """Click the element matching ``selector`` (CSS, or Playwright's ``text=...``)."""
        from playwright.async_api import Error as PlaywrightError

        page = self._require_page()
        try:
            await page.click(selector)
            await page.wait_for_load_state("load")
        except PlaywrightError as e:
            raise ToolError(f"click on {selector!r} failed: {e.message.splitlines()[0]}", kind="invalid") from e
        if not self.allowed(page.url):
            await page.goto("about:blank")
            raise ToolError("blocked: the click navigated to a non-allowlisted origin", kind="blocked")
        return f"clicked {selector!r}; url {page.url}"

    async def extract_text(self, selector: str = "body") -> str:
        """The visible text of the first element matching ``selector`` (capped)."""
        from playwright.async_api import Error as PlaywrightError

        page = self._require_page()
        try:
            if await page.query_selector(selector) is None:  # fail now instead of waiting for it to appear
                raise ToolError(f"extract from {selector!r} failed: no element matches", kind="invalid")
            text: str = await page.inner_text(selector)
        except PlaywrightError as e:
            raise ToolError(f"extract from {selector!r} failed: {e.message.splitlines()[0]}", kind="invalid") from e
        cap = self.config.max_text_chars
        return text if len(text) <= cap else text[:cap] + f"\n... (truncated at {cap} characters)"

    async def screenshot(self) -> bytes:
        """A PNG of the viewport."""
        page = self._require_page()
        png: bytes = await page.screenshot(type="png")
        return png

    @property
    def url(self) -> str:
        return str(self._page.url) if self._page is not None else ""

    async def close(self) -> None:
        if self._browser is not None:
            await self._browser.close()
            self._browser = None
        if self._pw is not None:
            await self._pw.stop()
            self._pw = None
        self._page = None
