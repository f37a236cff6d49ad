"""``web-browse``: the web-lookup tasks, answered by driving headless Chromium.

Tools: ``navigate(url)``, ``click(selector)``, ``extract_text(selector)`` and
``screenshot()`` over one ``BrowserSession`` per episode, started on the first tool call
and closed with the environment. Only the site's origin is allowlisted. The grader is the
web-lookup one.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urljoin

from envhub.base import Task
from envhub.config import BrowserConfig, EnvHubConfig
from envhub.connectors.browser import BrowserSession, origin_of
from envhub.envs._data import load_tasks
from envhub.envs.web_lookup import ShopSiteEnv
from envhub.rewards import Shaping
from envhub.types import JSON, ToolResult, string_tool

BROWSER_TOOLS = (
    string_tool(
        "navigate", "Open a page of the site in the browser.", url="Absolute URL or a path relative to the site."
    ),
    string_tool("click", "Click an element (CSS selector, or text=Label).", selector="CSS selector or text=..."),
    string_tool(
        "extract_text", "Visible text of an element of the current page.", selector="CSS selector; body for all."
    ),
    string_tool("screenshot", "Take a PNG screenshot of the current page."),
)


class WebBrowseEnv(ShopSiteEnv):
    name = "web-browse"

    def __init__(
        self, config: BrowserConfig, site_url: str, tasks: tuple[Task, ...], rubric: Shaping | None = None
    ) -> None:
        super().__init__(site_url, tasks, rubric, how=" by using the browser tools, e.g. ", tool="navigate")
        origins = (*config.allowed_origins, origin_of(self.site_url))
        self.browser = BrowserSession(config.model_copy(update={"allowed_origins": origins}))
        self._started = False
        self.add_tool(BROWSER_TOOLS[0], self._navigate)
        self.add_tool(BROWSER_TOOLS[1], self._click)
        self.add_tool(BROWSER_TOOLS[2], self._extract)
        self.add_tool(BROWSER_TOOLS[3], self._screenshot)

    async def _session(self) -> BrowserSession:
        if not self._started:
            await self.browser.start()
            self._started = True
        return self.browser

    async def _navigate(self, args: Mapping[str, JSON]) -> ToolResult:
        url = urljoin(self.site_url, str(args["url"]))
        return ToolResult("navigate", await (await self._session()).navigate(url))

    async def _click(self, args: Mapping[str, JSON]) -> ToolResult:
        return ToolResult("click", await (await self._session()).click(str(args["selector"])))

    async def _extract(self, args: Mapping[str, JSON]) -> ToolResult:
        return ToolResult("extract_text", await (await self._session()).extract_text(str(args["selector"])))

    async def _screenshot(self, _args: Mapping[str, JSON]) -> ToolResult:
        png = await (await self._session()).screenshot()
        return ToolResult("screenshot", f"screenshot taken: PNG, {len(png)} bytes", images=(png,))

    async def close(self) -> None:
        await self.browser.close()
        self._started = False


def make(config: EnvHubConfig) -> WebBrowseEnv:
    return WebBrowseEnv(config.browser, config.web_site_url, load_tasks("web_lookup", config.tasks_dir))
