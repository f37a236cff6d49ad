"""Record real SmolLM2-135M-Instruct tool-call turns from the embedded engine into grpo_tool_outputs.json.

Run once (``.venv/bin/python tests/data/record_grpo_tool_outputs.py``); the test
``tests/unit/test_grpo_rater.py`` scores the recorded texts. It samples the first turn of the arithmetic
task (``grpo.tasks``) through a real bridge at temperature 0.8 with fixed seeds, keeps the raw text of every
turn, and stores up to ``KEEP`` turns per category as the parser sees them at record time
(``valid``: parses and fits the calculator schema; ``wrong_schema``: parses but does not fit;
``malformed``: a ``<tool_call>`` block that is not a well-formed call; ``no_call``). The categories were
then checked by hand against the texts; the test asserts the scorer's verdicts on them.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from grpo.rater import parse_tool_calls, schema_errors  # noqa: E402
from grpo.tasks import SCHEMAS, TOOLS, make_problems  # noqa: E402
from rl_client import AsyncBridgeClient  # noqa: E402
from server.app import create_server  # noqa: E402
from server.config import load_settings  # noqa: E402

KEEP = 3  # per category; recording stops once every category has MIN
MIN = 2
TEMPERATURE = 0.8  # the demo's sampling temperature
OUT = Path(__file__).with_name("grpo_tool_outputs.json")


def category(text: str) -> str:
    parsed = parse_tool_calls(text)
    if not parsed.has_block:
        return "no_call"
    if parsed.errors or not parsed.calls:
        return "malformed"
    return "valid" if all(not schema_errors(c, SCHEMAS) for c in parsed.calls) else "wrong_schema"


async def main() -> None:
    settings = load_settings(
        engine={"type": "embedded", "embedded": {"max_model_len": 1024}}, server={"port": 0}, metrics={"port": 0}
    )
    server = await create_server(settings)
    await server.start()
    kept: dict[str, list[dict[str, object]]] = {"valid": [], "wrong_schema": [], "malformed": [], "no_call": []}
    try:
        async with AsyncBridgeClient(f"127.0.0.1:{server.port}", timeout=600) as client:
            info = (await client.server_info()).models[0]
            for seed, problem in enumerate(make_problems(16, seed=123)):
                if all(len(v) >= MIN for v in kept.values()):
                    break
                started = await client.start_episode(
                    problem.messages(),
                    sampling={"temperature": TEMPERATURE, "max_tokens": 40, "seed": seed},
                    group_size=8,
                    tools=TOOLS,
                )
                turns = await asyncio.gather(*(client.step(e) for e in started.episode_ids))
                for e in started.episode_ids:
                    await client.discard_episode(e)
                for i, t in enumerate(turns):
                    cat = category(t.text)
                    if len(kept[cat]) < KEEP:
                        kept[cat].append(
                            {"question": problem.question, "seed": seed, "member": i, "text": t.text, "category": cat}
                        )
                print(seed, {k: len(v) for k, v in kept.items()}, flush=True)
    finally:
        await server.stop(0.5)
    payload = {
        "model": info.name,
        "engine": info.engine,
        "sampling": {"temperature": TEMPERATURE, "max_tokens": 40},
        "recorded_by": "tests/data/record_grpo_tool_outputs.py",
        "samples": [s for v in kept.values() for s in v],
    }
    OUT.write_text(json.dumps(payload, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    asyncio.run(main())
