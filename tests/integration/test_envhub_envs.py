"""The three ready environments end to end through the tool loop, with their graders."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from envhub import EnvHubConfig, make_env
from envhub.config import HttpConfig
from envhub.envs.web_lookup import html_to_text
from envhub.loop import ToolLoop
from tests.integration.testsite import serve_test_site


def tool_call(name: str, **arguments: str) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


SQL_SOLUTIONS = {
    "sql-1": (
        "SELECT count(*) FROM employees e JOIN departments d ON d.id = e.department_id WHERE d.name = 'Research'",
        "3",
    ),
    "sql-3": (
        "SELECT d.city FROM employees e JOIN departments d ON d.id = e.department_id "
        "GROUP BY d.city ORDER BY count(*) DESC LIMIT 1",
        "Lisbon",
    ),
    "sql-6": ("SELECT round(avg(salary)) FROM employees WHERE department_id = 2", "6733"),
}


@pytest.mark.parametrize("task_id", sorted(SQL_SOLUTIONS))
async def test_sql_qa_episode(task_id: str) -> None:
    query, answer = SQL_SOLUTIONS[task_id]
    rewards = []
    for final in (f"<answer>{answer}</answer>", "<answer>no idea</answer>", f"<answer>{answer}</answer>"):
        env = make_env("sql-qa")
        await env.reset(task_id=task_id)
        loop = ToolLoop(env)
        d = await loop.on_turn(tool_call("sql_query", query=query))
        assert d.should_continue and d.observation[0].role == "tool"
        assert d.observation[0].content.splitlines()[1] in (answer, answer + ".0")
        d = await loop.on_turn(final)
        assert d.done and d.reward is not None and 0.0 <= d.reward <= 1.0
        rewards.append(d.reward)
        await env.close()
    assert rewards == [1.0, 0.0, 1.0]  # deterministic grader


async def test_sql_qa_refuses_writes_as_observations() -> None:
    env = make_env("sql-qa")
    await env.reset(task_id="sql-1")
    d = await ToolLoop(env).on_turn(tool_call("sql_query", query="DELETE FROM employees"))
    assert d.should_continue and d.observation[0].content.startswith("error (refused): query refused")
    assert env.state().trace[0].ok is False
    await env.close()


@pytest.fixture(scope="module")
def site() -> Iterator[str]:
    with serve_test_site() as url:
        yield url


def web_config(site: str) -> EnvHubConfig:
    # The local test site is on loopback: allowed only because this config says so.
    http = HttpConfig(allowed_ports=(), allowed_private_networks=("127.0.0.1/32",))
    return EnvHubConfig(http=http, web_site_url=site)


async def test_web_lookup_episode(site: str) -> None:
    env = make_env("web-lookup", web_config(site))
    opening = await env.reset(task_id="web-3")
    assert site in opening.messages[0].content
    loop = ToolLoop(env)
    d = await loop.on_turn(tool_call("fetch_page", url=site))
    page = d.observation[0].content
    assert page.startswith("HTTP 200") and "[Green Gizmo](products/green-gizmo.html)" in page
    d = await loop.on_turn(tool_call("fetch_page", url="products/green-gizmo.html"))
    assert "SKU: GG-3003" in d.observation[0].content
    d = await loop.on_turn("The SKU is <answer>GG-3003</answer>.")
    assert d.done and d.reward == 1.0
    await env.close()


async def test_web_lookup_blocks_other_addresses(site: str) -> None:
    env = make_env("web-lookup", web_config(site))
    await env.reset(task_id="web-1")
    loop = ToolLoop(env)
    d = await loop.on_turn(tool_call("fetch_page", url="http://169.254.169.254/latest/meta-data/"))
    assert d.observation[0].content.startswith("error (blocked)")
    await env.close()
    default = make_env("web-lookup", EnvHubConfig(web_site_url=site))  # no exemption: loopback is blocked
    await default.reset(task_id="web-1")
    d = await ToolLoop(default).on_turn(tool_call("fetch_page", url=site))
    assert d.observation[0].content.startswith("error (blocked)")
    await default.close()


def test_html_to_text() -> None:
    html = "<html><head><style>p{}</style><script>var x=1</script></head><body><h1>T</h1><p>a <a href='/b'>B</a></p>"
    assert html_to_text(html) == "T\na [B](/b)"


async def test_code_math_from_registry() -> None:
    env = make_env("code-math")
    await env.reset(task_id="math-5")
    loop = ToolLoop(env)
    code = "import math\ns = str(math.factorial(1000))\nprint(len(s) - len(s.rstrip('0')))"
    d = await loop.on_turn(tool_call("run_python", code=code))
    assert d.observation[0].content.endswith("249\n")
    d = await loop.on_turn("<answer>249</answer>")
    assert d.reward == 1.0
