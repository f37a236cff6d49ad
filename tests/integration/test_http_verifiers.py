"""verifiers 0.4.0's ``TrainClient``, unmodified, against the bridge's HTTP front door (issue 19, acceptance 2).

The client runs in its own virtualenv (``scripts/provision_verifiers.sh``, ``make verifiers-env``) as a
subprocess (``tests/integration/verifiers_driver.py``): 16 concurrent 3-turn rollouts on the embedded SmolLM2,
each with the ``X-Session-ID`` verifiers sets (its trace id). For every rollout the bridge's exported trajectory
(``GET /v1/sessions/{id}/trajectory``) must equal, token for token, the prompt ids the client sent and the
completion ids and logprobs it received; sessions must not leak into each other.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from engines.launch import free_port
from engines.model_store import ensure_converted
from tests.conftest import StartBridge

REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("verifiers_driver.py")
SESSIONS = 16
TURNS = 3
MAX_TOKENS = 8

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="session")
def verifiers_python() -> Path:
    """The verifiers venv's interpreter (provisioned on first use; ~0.2 s when current)."""
    out = subprocess.run(
        [str(REPO / "scripts" / "provision_verifiers.sh")], capture_output=True, text=True, timeout=900, check=False
    )
    assert out.returncode == 0, f"provision_verifiers.sh failed:\n{out.stderr[-3000:]}"
    return Path(out.stdout.strip().splitlines()[-1]) / "bin" / "python"


async def run_driver(python: Path, base_url: str, model: str, sessions: int, seed: int) -> list[dict[str, Any]]:
    args = [
        str(DRIVER),
        "--base-url",
        base_url,
        "--model",
        model,
        "--renderer-model",
        str(ensure_converted()),
        "--sessions",
        str(sessions),
        "--turns",
        str(TURNS),
        "--max-tokens",
        str(MAX_TOKENS),
        "--seed",
        str(seed),
        "--timeout",
        "240",
    ]
    proc = await asyncio.create_subprocess_exec(
        str(python), *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO
    )
    try:
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 270)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    rollouts = [json.loads(line) for line in stdout.decode().splitlines() if line.startswith("{")]
    failed = [(r["session_id"], r["error"], r.get("traceback", "")) for r in rollouts if r["error"]]
    assert proc.returncode == 0 and not failed, (
        f"verifiers driver exited {proc.returncode}; failed rollouts: {failed[:3]}\n{stderr.decode()[-3000:]}"
    )
    assert len(rollouts) == sessions
    return rollouts


async def start_front_door(start_bridge: StartBridge) -> str:
    """An embedded-SmolLM2 bridge with its HTTP front door on a free port; returns the base URL."""
    port = free_port()
    server, _ = await start_bridge(engine={"type": "embedded"}, http={"port": port})
    port = getattr(server, "http_port", None) or port
    return f"http://127.0.0.1:{port}"


async def served_model(http: httpx.AsyncClient) -> str:
    r = await http.get("/v1/models")
    assert r.status_code == 200, r.text
    return str(r.json()["data"][0]["id"])


def assert_trajectory_matches(rollout: dict[str, Any], traj: dict[str, Any]) -> None:
    """The bridge's trajectory is exactly what the client sent and received, turn by turn."""
    sid, turns = rollout["session_id"], rollout["turns"]
    ids, logprobs, mask = traj["token_ids"], traj["logprobs"], traj["loss_mask"]
    assert len(logprobs) == len(ids) == len(mask), sid
    sampled: set[int] = set()
    for k, turn in enumerate(turns):
        sent = turn["sent"]
        # What went over the wire is what verifiers recorded (the bridge echoes prompt_token_ids exactly or not
        # at all), and the session header is the rollout's trace id on every turn.
        assert sent["x_session_id"] == sid
        assert sent["body"]["token_ids"] == turn["prompt_ids"], f"{sid} turn {k}: prompt_ids replaced"
        echoed = turn["received_prompt_token_ids"]
        assert echoed is None or echoed == turn["prompt_ids"], f"{sid} turn {k}: prompt_token_ids not an echo"
        prompt, completion, lps = turn["prompt_ids"], turn["completion_ids"], turn["completion_logprobs"]
        assert completion and len(lps) == len(completion)
        # The session's history is the prompt this turn sent, then what it sampled.
        end = len(prompt) + len(completion)
        assert ids[: len(prompt)] == prompt, f"{sid} turn {k}: trajectory does not start with the sent prompt"
        assert ids[len(prompt) : end] == completion, f"{sid} turn {k}: completion ids differ"
        for i, lp in enumerate(lps):
            got = logprobs[len(prompt) + i]
            assert got is not None and math.isclose(got, lp, rel_tol=0, abs_tol=1e-6), (sid, k, i, got, lp)
        sampled.update(range(len(prompt), end))
    last = turns[-1]
    assert ids == last["prompt_ids"] + last["completion_ids"], f"{sid}: trajectory has extra or missing tokens"
    for i in range(len(ids)):
        assert mask[i] == (1 if i in sampled else 0), (sid, i)
        if i not in sampled:
            assert logprobs[i] is None, (sid, i, logprobs[i])


async def test_verifiers_train_client_rollouts_match_bridge_trajectories(
    start_bridge: StartBridge, verifiers_python: Path
) -> None:
    base = await start_front_door(start_bridge)
    async with httpx.AsyncClient(base_url=base, timeout=60.0, trust_env=False) as http:
        model = await served_model(http)
        rollouts = await run_driver(verifiers_python, base, model, SESSIONS, seed=100)

        # Sessions stay apart: one per rollout, each with its own prompts.
        assert len({r["session_id"] for r in rollouts}) == SESSIONS
        for r in rollouts:
            first_prompts = {tuple(t["prompt_ids"]) for t in r["turns"]}
            others = [o for o in rollouts if o["session_id"] != r["session_id"]]
            assert not first_prompts & {tuple(t["prompt_ids"]) for o in others for t in o["turns"]}

        for r in rollouts:
            turns = r["turns"]
            assert len(turns) == TURNS
            # SmolLM2's template re-renders append-only: each turn extends the previous prompt + completion,
            # so the session is one episode and its trajectory is the last turn's prompt + completion.
            for a, b in itertools.pairwise(turns):
                full = a["prompt_ids"] + a["completion_ids"]
                assert b["prompt_ids"][: len(full)] == full, f"{r['session_id']}: turn does not extend the last"
            resp = await http.get(f"/v1/sessions/{r['session_id']}/trajectory")
            assert resp.status_code == 200, resp.text
            assert_trajectory_matches(r, resp.json())
