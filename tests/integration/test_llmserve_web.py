"""LLMServeEnv's web interface (openenv-core's Gradio app at ``/web``) in real headless Chromium.

The server runs as a separate uvicorn process with ``ENABLE_WEB_INTERFACE=true`` (as the Space's Dockerfile
sets it); Playwright drives Debian's ``/usr/bin/chromium`` (the Env Hub browser connector's setup). A reset
then a step through the page must change the observation the page shows. The screenshot of the stepped
page goes to ``PRIMERL_LLMSERVE_SCREENSHOT`` when set (``bench/plots/llmserve_web.png`` in the repo was
made that way), else to the test's tmp dir.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.async_api import Page, async_playwright

from engines.launch import free_port
from envhub.config import BrowserConfig

OBSERVATION = re.compile(r'\{\s*"observation":.*?"done":\s*(?:true|false)\s*\}', re.S)


@pytest.fixture(scope="module")
def web_url() -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "ENABLE_WEB_INTERFACE": "true"}
    cmd = [sys.executable, "-m", "uvicorn", "llmserve.app:app", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180  # gradio's import is slow on a loaded 2-core machine
        while True:
            assert proc.poll() is None, "the LLMServeEnv server exited"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the LLMServeEnv server did not become healthy"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


async def _shown_observation(page: Page, step_index: int) -> dict:
    """The JSON the page shows, once it is the observation of ``step_index`` (Gradio updates asynchronously)."""
    deadline = time.monotonic() + 60
    while True:
        match = OBSERVATION.search(await page.locator("body").inner_text())
        if match:
            shown = json.loads(match.group(0))
            if shown["observation"]["step_index"] == step_index:
                return dict(shown)
        assert time.monotonic() < deadline, f"the page never showed step {step_index}"
        await page.wait_for_timeout(250)


async def _reset_and_step(url: str, screenshot: Path) -> tuple[dict, dict]:
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=BrowserConfig().executable, args=["--no-sandbox"])
        try:
            page = await browser.new_page()
            await page.goto(f"{url}/demo", wait_until="networkidle")  # /demo redirects to /web/
            assert page.url.rstrip("/").endswith("/web")
            await page.get_by_role("button", name="Reset").click()
            first = await _shown_observation(page, 0)
            for label, value in (("Batch Cap", "64"), ("Kv Budget Fraction", "0.9"), ("Speculation Depth", "2")):
                await page.get_by_label(label).fill(value)
            await page.get_by_label("Quantization Tier").fill("FP16")
            await page.get_by_role("button", name="Step").click()
            second = await _shown_observation(page, 1)
            await page.screenshot(path=str(screenshot), full_page=True)
            return first, second
        finally:
            await browser.close()


def test_web_interface_reset_and_step_change_the_shown_observation(web_url: str, tmp_path: Path) -> None:
    screenshot = Path(os.environ.get("PRIMERL_LLMSERVE_SCREENSHOT") or tmp_path / "llmserve_web.png")
    first, second = asyncio.run(_reset_and_step(web_url, screenshot))
    assert first["observation"]["task_id"] == "static_workload" and first["done"] is False
    assert first["observation"]["throughput_tps"] == 0.0
    assert second["observation"]["throughput_tps"] > 0.0  # a served window, from the action typed into the page
    assert second["observation"]["request_arrival_rate"] > 0.0
    assert screenshot.stat().st_size > 10_000


def test_demo_is_off_with_a_clear_message_without_the_web_interface() -> None:
    from fastapi.testclient import TestClient

    from llmserve.app import build_app

    assert os.environ.get("ENABLE_WEB_INTERFACE", "false") == "false"
    resp = TestClient(build_app()).get("/demo", follow_redirects=False)
    assert resp.status_code == 404 and "ENABLE_WEB_INTERFACE=true" in resp.json()["detail"]
