"""``web-lookup``: answer questions by reading pages of a website over SSRF-safe HTTP.

Tool: ``fetch_page(url)`` fetches a page (relative URLs resolve against the site URL) with
``SafeHttpClient`` and returns its text with links as ``[text](href)``. The site is the
local test shop in ``envhub/data/site`` (package data) by default; a loopback site is reachable only
when the config exempts it explicitly (``http.allowed_private_networks``).
"""

from __future__ import annotations

from collections.abc import Mapping
from html.parser import HTMLParser
from urllib.parse import urljoin

from core.toolcall import format_call
from envhub.base import Task, ToolEnvironment
from envhub.config import EnvHubConfig
from envhub.connectors.http import SafeHttpClient
from envhub.envs._data import load_tasks
from envhub.rewards import Shaping
from envhub.types import JSON, ToolResult, string_tool

FETCH_TOOL = string_tool(
    "fetch_page",
    "Fetch a web page of the shop site and return its text; links are shown as [text](url).",
    url="Absolute URL or a path relative to the site.",
)


class _TextExtractor(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._href: str | None = None
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("script", "style"):
            self._skip += 1
        elif tag == "a":
            self._href = dict(attrs).get("href")
            self.parts.append("[")
        elif tag in ("p", "li", "h1", "h2", "h3", "br", "div", "tr"):
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style"):
            self._skip = max(0, self._skip - 1)
        elif tag == "a":
            self.parts.append(f"]({self._href or ''})")
            self._href = None

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.parts.append(data)


def html_to_text(html: str) -> str:
    parser = _TextExtractor()
    parser.feed(html)
    lines = (" ".join(line.split()) for line in "".join(parser.parts).splitlines())
    return "\n".join(line for line in lines if line)


class ShopSiteEnv(ToolEnvironment):
    """Questions about the shop whose website is ``site_url`` (the web-lookup tasks), answered with the tools a
    subclass adds. The system prompt says how to use them (``how``), then shows a call of ``tool`` on the site."""

    sandbox_policy = "default"  # its tools run in process (no code is sandboxed); declared for the hub's audit

    def __init__(self, site_url: str, tasks: tuple[Task, ...], rubric: Shaping | None, *, how: str, tool: str) -> None:
        super().__init__(tasks, rubric)
        self.site_url = site_url if site_url.endswith("/") else site_url + "/"
        self.system_prompt = (
            f"Answer questions about the shop whose website is {self.site_url}{how}"
            f"{format_call(tool, {'url': self.site_url})}. "
            "Give the final answer as <answer>...</answer>."
        )


class WebLookupEnv(ShopSiteEnv):
    name = "web-lookup"

    def __init__(
        self, client: SafeHttpClient, site_url: str, tasks: tuple[Task, ...], rubric: Shaping | None = None
    ) -> None:
        super().__init__(site_url, tasks, rubric, how=". Read pages with the fetch_page tool: ", tool="fetch_page")
        self.client = client
        self.add_tool(FETCH_TOOL, self._fetch)

    async def _fetch(self, args: Mapping[str, JSON]) -> ToolResult:
        url = urljoin(self.site_url, str(args["url"]))
        result = await self.client.fetch(url)
        body = result.text()
        text = html_to_text(body) if "html" in result.content_type or "<html" in body[:200].lower() else body
        cap = self.client.config.max_text_chars
        if len(text) > cap:
            text = text[:cap] + f"\n... (truncated at {cap} characters)"
        ok = 200 <= result.status < 400
        return ToolResult("fetch_page", f"HTTP {result.status} {result.url}\n{text}", not ok, "" if ok else "http")

    async def close(self) -> None:
        await self.client.aclose()


def make(config: EnvHubConfig) -> WebLookupEnv:
    return WebLookupEnv(SafeHttpClient(config.http), config.web_site_url, load_tasks("web_lookup", config.tasks_dir))
