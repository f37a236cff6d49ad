"""verifiers 0.4.0's ``TrainClient``, unmodified, against the bridge's HTTP front door (issue 19, acceptance 2).

The client runs in its own virtualenv (``scripts/provision_verifiers.sh``, ``make verifiers-env``) as a
subprocess (``tests/integration/verifiers_driver.py``): 16 concurrent 3-turn rollouts on the embedded SmolLM2,
each with the ``X-Session-ID`` verifiers sets (its trace id). For every rollout the bridge's exported trajectory
(``GET /v1/sessions/{id}/trajectory``) must equal, token for token, the prompt ids the client sent and the
completion ids and logprobs it received; sessions must not leak into each other.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import subprocess
import time
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
    failed = [r for r in rollouts if r["error"]]
    assert proc.returncode == 0 and not failed, (
        f"verifiers driver exited {proc.returncode}; {len(failed)} rollouts failed: "
        f"{[r['error'] for r in failed[:3]]}\n{failed[0].get('traceback', '') if failed else ''}"
        f"\n{stderr.decode()[-2000:]}"
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


def extends(prev: dict[str, Any], turn: dict[str, Any]) -> bool:
    full = prev["prompt_ids"] + prev["completion_ids"]
    return bool(turn["prompt_ids"][: len(full)] == full)


def runs_of(turns: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The rollout's turns grouped into the episodes the bridge must have made: a turn whose prompt extends the
    previous prompt + completion continues the episode, any other starts a new branch (a counted fork)."""
    runs = [[turns[0]]]
    for turn in turns[1:]:
        if extends(runs[-1][-1], turn):
            runs[-1].append(turn)
        else:
            runs.append([turn])
    return runs


def assert_wire(sid: str, turns: list[dict[str, Any]]) -> None:
    """What went over the wire is what verifiers recorded: the session header is the rollout's trace id on every
    turn, and the bridge echoes ``prompt_token_ids`` exactly or not at all (verifiers would adopt it)."""
    for k, turn in enumerate(turns):
        sent = turn["sent"]
        assert sent["x_session_id"] == sid
        assert sent["body"]["token_ids"] == turn["prompt_ids"], f"{sid} turn {k}: prompt_ids replaced"
        echoed = turn["received_prompt_token_ids"]
        assert echoed is None or echoed == turn["prompt_ids"], f"{sid} turn {k}: prompt_token_ids not an echo"
        assert turn["completion_ids"] and len(turn["completion_logprobs"]) == len(turn["completion_ids"])


def assert_episode_matches(sid: str, run: list[dict[str, Any]], ep: dict[str, Any]) -> None:
    """One episode of the session is exactly the turns of ``run``: the prompts they sent, the ids and logprobs they
    received at the positions they were sampled, nothing sampled anywhere else."""
    ids, logprobs, mask, origins = ep["token_ids"], ep["logprobs"], ep["loss_mask"], ep["origins"]
    assert len(logprobs) == len(ids) == len(mask) == len(origins), sid
    last = run[-1]
    assert ids == last["prompt_ids"] + last["completion_ids"], f"{sid}: trajectory has extra or missing tokens"
    sampled: set[int] = set()
    for turn in run:
        prompt, completion, lps = turn["prompt_ids"], turn["completion_ids"], turn["completion_logprobs"]
        end = len(prompt) + len(completion)
        assert ids[: len(prompt)] == prompt and ids[len(prompt) : end] == completion, sid
        for i, lp in enumerate(lps):
            got = logprobs[len(prompt) + i]
            assert got is not None and math.isclose(got, lp, rel_tol=0, abs_tol=1e-6), (sid, i, got, lp)
        sampled.update(range(len(prompt), end))
    for i in range(len(ids)):
        if i in sampled:
            assert mask[i] == 1 and origins[i] == "sampled", (sid, i, mask[i], origins[i])
        else:
            assert mask[i] == 0 and logprobs[i] is None and origins[i] in ("prompt", "env"), (sid, i, origins[i])


def assert_session_matches(rollout: dict[str, Any], traj: dict[str, Any]) -> None:
    """The bridge's trajectory for the rollout's X-Session-ID is exactly what the client sent and received: the
    current branch holds the last run of extending turns, earlier branches the runs before each fork."""
    sid, turns = rollout["session_id"], rollout["turns"]
    assert_wire(sid, turns)
    runs = runs_of(turns)
    assert traj["session_id"] == sid
    assert traj["forks"] == len(runs) - 1, f"{sid}: {traj['forks']} forks counted, {len(runs) - 1} happened"
    episodes = [*traj["branches"], traj]
    assert len(episodes) == len(runs), f"{sid}: {len(episodes)} episodes for {len(runs)} runs of turns"
    for run, ep in zip(runs, episodes, strict=True):
        assert_episode_matches(sid, run, ep)


@pytest.mark.slow
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

        forks = 0
        for r in rollouts:
            assert len(r["turns"]) == TURNS
            resp = await http.get(f"/v1/sessions/{r['session_id']}/trajectory")
            assert resp.status_code == 200, resp.text
            assert_session_matches(r, resp.json())
            forks += resp.json()["forks"]
        # SmolLM2's DefaultRenderer re-renders the whole chat each turn: it extends the previous prompt +
        # completion unless a sampled token sequence re-tokenises differently (rare: the bridge counts a fork).
        assert forks <= SESSIONS * (TURNS - 1) // 4, f"{forks} forks in {SESSIONS * (TURNS - 1)} turn transitions"


async def test_keep_alive_calls_are_not_held_by_nagle(start_bridge: StartBridge) -> None:
    """verifiers (and the OpenAI SDK) keep one connection per client: a call on it must not wait for a delayed
    ACK. Without TCP_NODELAY on the front door's sockets every such call takes ~40 ms (uvicorn writes headers and
    body separately), whatever the engine does; with it, a toy turn takes ~1 ms."""
    port = free_port()
    server, _ = await start_bridge(http={"port": port})
    base = f"http://127.0.0.1:{getattr(server, 'http_port', None) or port}"
    async with httpx.AsyncClient(base_url=base, timeout=30.0, trust_env=False) as http:
        model = await served_model(http)
        body = {"model": model, "token_ids": [1, 4, 30, 31, 32, 2, 5], "sampling_params": {"max_tokens": 4}}
        took = []
        for i in range(21):
            start = time.perf_counter()
            r = await http.post("/inference/v1/generate", json=body, headers={"X-Session-ID": f"nagle-{i}"})
            took.append(time.perf_counter() - start)
            assert r.status_code == 200, r.text
    assert statistics.median(took) < 0.02, f"median keep-alive call {statistics.median(took) * 1e3:.1f} ms"
