"""The live inspector's page (``/ui``) in real headless Chromium against real bridges.

One bridge on the embedded SmolLM2 (auth on: tenants alice, bob and the admin ops) serves a 3-turn chat session
with a tool message through the official ``openai`` SDK, a fork of it (a different history), and a GRPO group of
4 through ``rl_client``. Playwright drives Debian's ``/usr/bin/chromium`` (as test_llmserve_web.py does) and reads
the DOM: the page lists both; its trajectory view shows, token by token, the ids, origins, masks and logprobs of
the JSON route; the fork shows as a branch; a Step started after the page loaded appears within 2 s; each tenant
sees only its own; a wrong token gets a clear message. A toy bridge with auth off shows the banner, is stopped and
restarted on the same port, and the page reconnects by itself. Screenshots (episode list, a trajectory, the fleet)
go to ``PRIMERL_INSPECTOR_SCREENSHOTS`` when set (``bench/plots/`` in the repo was made that way), else tmp.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from playwright.async_api import Browser, Page, async_playwright

from engines.launch import free_port
from envhub.config import BrowserConfig
from rl_client import AsyncBridgeClient
from server.app import BridgeServer, create_server
from server.auth import hash_token
from server.config import load_settings

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
TOKENS = {"alice": "tok-alice", "bob": "tok-bob", "ops": "tok-ops"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
TOKEN_JS = "els => els.map(e => [e.dataset.id, e.dataset.origin, e.dataset.mask, e.dataset.lp, e.textContent])"


def _shots(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("PRIMERL_INSPECTOR_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def served() -> AsyncIterator[BridgeServer]:
    settings = load_settings(
        engine={"type": "embedded", "embedded": {"max_model_len": 1024}},
        server={"port": 0, "grace_period_s": 1.0},
        metrics={"port": 0},
        http={"port": free_port()},
        auth={"token_hashes": [f"{t}:{hash_token(v)}" for t, v in TOKENS.items()], "admin_tenants": ["ops"]},
    )
    server = await create_server(settings)
    await server.start()
    yield server
    await server.stop(0.5)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as pw:
        chromium = await pw.chromium.launch(executable_path=BrowserConfig().executable, args=["--no-sandbox"])
        yield chromium
        await chromium.close()


async def _page(browser: Browser, base: str, token: str | None) -> Page:
    page = await (await browser.new_context(viewport={"width": 1500, "height": 950})).new_page()
    await page.goto(f"{base}/ui")
    if token is not None:
        await page.fill("[data-testid=token-input]", token)
        await page.click("[data-testid=token-submit]")
    return page


async def _rows(page: Page) -> list[str]:
    return await page.eval_on_selector_all("[data-testid=episode-row]", "els => els.map(e => e.dataset.id)")


async def _chat_with_a_tool_and_a_fork(base: str) -> str:
    """alice's 3-turn session (a tool message after turn 1), then a different history: branch 1. Returns its id."""
    sid = "weather-chat"
    sdk = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=TOKENS["alice"], max_retries=0)
    async with sdk:
        call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
        ask = f"Call get_weather for Paris. Answer only: {call}"
        messages: list[dict[str, Any]] = [{"role": "user", "content": ask}]
        for turn in range(3):
            r = await sdk.chat.completions.create(
                model=MODEL, messages=messages, tools=TOOLS, max_tokens=32, temperature=0, logprobs=True,
                extra_headers={"X-Session-ID": sid},
            )  # fmt: skip
            message = r.choices[0].message.model_dump(exclude_none=True)
            messages.append(message)
            if turn == 0:  # the tool's result comes back as the environment's tokens
                call_id = message["tool_calls"][0]["id"] if message.get("tool_calls") else "call_0"
                messages.append({"role": "tool", "tool_call_id": call_id, "content": '{"temp_c": 18}'})
            messages.append({"role": "user", "content": f"Thanks. And tomorrow ({turn})?"})
        fork = [{"role": "user", "content": "Tell me a joke instead."}]
        await sdk.chat.completions.create(
            model=MODEL, messages=fork, max_tokens=8, temperature=0, extra_headers={"X-Session-ID": sid}
        )
    return sid


async def test_the_page_shows_episodes_token_by_token_live_and_per_tenant(
    served: BridgeServer, browser: Browser, tmp_path: Path
) -> None:
    base = f"http://127.0.0.1:{served.http_port}"
    shots = _shots(tmp_path)
    grpc = {t: AsyncBridgeClient(f"127.0.0.1:{served.port}", token=v, timeout=120) for t, v in TOKENS.items()}
    http = httpx.AsyncClient(base_url=base, timeout=60, headers={"Authorization": f"Bearer {TOKENS['alice']}"})
    try:
        sid = await _chat_with_a_tool_and_a_fork(base)
        prompt = [{"role": "user", "content": "Name a prime number."}]
        group = await grpc["alice"].start_episode(prompt, group_size=4, sampling={"max_tokens": 10, "seed": 7})
        for i, ep in enumerate(group.episode_ids):
            await grpc["alice"].step(ep)
            await grpc["alice"].end_episode(ep, float(i))
        bobs = (await grpc["bob"].start_episode([1, 2, 3], sampling={"max_tokens": 4})).episode_ids[0]
        await grpc["bob"].step(bobs)

        # A wrong token: a clear message, the token form still there (not a blank page).
        page = await _page(browser, base, "not-a-token")
        await page.wait_for_selector("[data-testid=message]:has-text('401')")
        assert "not accepted" in await page.inner_text("[data-testid=message]")
        assert await page.is_visible("[data-testid=token-form]")

        # alice: her chat session (2 branches) and her group of 4, never bob's.
        page = await _page(browser, base, TOKENS["alice"])
        await page.wait_for_selector("[data-testid=conn][data-state=live]")
        listed = (await http.get("/v1/inspect/episodes", params={"session_id": sid})).json()["episodes"]
        branch = {r["branch"]: r["id"] for r in listed}
        assert sorted(branch) == [0, 1]
        rows = await _rows(page)
        assert set(group.episode_ids) | set(branch.values()) <= set(rows) and bobs not in rows
        assert await page.inner_text("[data-testid=whoami]") == "tenant alice"
        await page.screenshot(path=str(shots / "inspector_episodes.png"), full_page=True)

        # The trajectory view equals the JSON route token by token; turns and the branch are shown.
        await page.click(f"[data-testid=episode-row][data-id='{branch[0]}']")
        view = f"[data-testid=detail][data-id='{branch[0]}'] > [data-testid=tokens]"
        await page.wait_for_selector(view)
        shown = await page.eval_on_selector_all(f"{view} [data-testid=token]", TOKEN_JS)
        detail = (await http.get(f"/v1/inspect/episodes/{branch[0]}")).json()
        assert len(detail["turns"]) == 3 and "env" in detail["origins"]
        assert len(shown) == len(detail["token_ids"]) > 0
        for i, (tid, origin, mask, lp, text) in enumerate(shown):
            want = detail["logprobs"][i]
            assert int(tid) == detail["token_ids"][i] and origin == detail["origins"][i], i
            assert int(mask) == detail["loss_mask"][i] and text == detail["token_text"][i], i
            assert (lp == "" and want is None) or float(lp) == want, i
        assert await page.locator(f"{view} [data-testid=turn-boundary]").count() == 2
        assert await page.locator("[data-testid=branch]").count() == 2
        await page.screenshot(path=str(shots / "inspector_trajectory.png"), full_page=True)
        await page.click("[data-testid=branch][data-branch='1']")
        await page.wait_for_selector(f"[data-testid=detail][data-id='{branch[1]}'] [data-testid=fork-point]")

        # A group member: its 4 members side by side.
        await page.click(f"[data-testid=episode-row][data-id='{group.episode_ids[2]}']")
        await page.wait_for_selector(f"[data-testid=detail][data-id='{group.episode_ids[2]}'] [data-testid=group]")
        members = await page.eval_on_selector_all("[data-testid=group-member]", "els => els.map(e => e.dataset.id)")
        assert members == group.episode_ids

        # Live: a Step started now shows without a reload within 2 s of its end (the bound; the Step's own
        # time on a loaded machine is not the page's).
        fresh = (await grpc["alice"].start_episode([5, 6, 7], sampling={"max_tokens": 4})).episode_ids[0]
        await grpc["alice"].step(fresh)
        await page.wait_for_selector(f"[data-testid=episode-row][data-id='{fresh}']", timeout=2000)

        # The fleet: alice is not an admin; ops sees the replica, its version and hit rate.
        await page.click("[data-testid=tab-fleet]")
        await page.wait_for_selector("[data-testid=fleet-message]:has-text('admin tenant')")
        bob = await _page(browser, base, TOKENS["bob"])
        await bob.wait_for_selector(f"[data-testid=episode-row][data-id='{bobs}']")
        assert await _rows(bob) == [bobs]
        ops = await _page(browser, base, TOKENS["ops"])
        await ops.wait_for_selector(f"[data-testid=episode-row][data-id='{bobs}']")
        await ops.click("[data-testid=tab-fleet]")
        await ops.wait_for_selector("[data-testid=replica-row][data-healthy=true]")
        assert await ops.inner_text("[data-testid=fleet-version]") == "v0\npolicy version"
        await ops.screenshot(path=str(shots / "inspector_fleet.png"), full_page=True)
    finally:
        await http.aclose()
        for c in grpc.values():
            await c.close()


async def test_the_page_says_auth_is_off_and_reconnects_after_a_restart(browser: Browser) -> None:
    port = free_port()

    async def bridge() -> BridgeServer:
        settings = load_settings(
            engine={"type": "toy"}, server={"port": 0, "grace_period_s": 0.5}, metrics={"port": 0}, http={"port": port}
        )
        server = await create_server(settings)
        await server.start()
        return server

    server = await bridge()
    page = await _page(browser, f"http://127.0.0.1:{port}", None)
    await page.wait_for_selector("[data-testid=conn][data-state=live]")
    assert await page.is_visible("[data-testid=auth-off-banner]")
    await server.stop(0.2)
    await page.wait_for_selector("[data-testid=conn][data-state=reconnecting]", timeout=5000)
    await asyncio.sleep(0.5)  # a retry or two against a closed port
    server = await bridge()
    try:
        await page.wait_for_selector("[data-testid=conn][data-state=live]", timeout=10_000)
        async with AsyncBridgeClient(f"127.0.0.1:{server.port}", timeout=30) as client:
            ep = (await client.start_episode([1, 2, 3], sampling={"max_tokens": 3})).episode_ids[0]
            await client.step(ep)
        await page.wait_for_selector(f"[data-testid=episode-row][data-id='{ep}']", timeout=2000)
    finally:
        await server.stop(0.2)
