"""Episode persistence through real bridges and a private Redis: two bridges share episodes, a killed bridge's
episodes resume in a new process, a Step holds its episode across bridges, Redis failures fail open or closed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rl_client import AsyncBridgeClient
from rl_client.errors import BridgeError, FailedPreconditionError, NotFoundError, UnavailableError
from tests.integration.redis_proc import PrivateRedis, free_port

PROMPT = [1, 4, 30, 31, 32, 2, 5]
SAMPLING = {"max_tokens": 6, "ignore_eos": True, "seed": 5}


# A 5 s grace: a stop that hangs exits the process after 35 s (serve()'s watchdog), with the phase in its log.
QUICK_STOP = {"PRIMERL_SERVER__GRACE_PERIOD_S": "5"}


def _persist(redis: PrivateRedis, **extra: Any) -> dict[str, Any]:
    return {"redis": {"url": redis.url}, "persistence": {"enabled": True, "timeout_s": 0.5, **extra}}


async def test_two_bridges_share_episodes_turn_by_turn(start_bridge: Any, redis_server: PrivateRedis) -> None:
    a_server, a = await start_bridge(**_persist(redis_server))
    _, b = await start_bridge(**_persist(redis_server))
    _, solo = await start_bridge()  # the same toy model without persistence: the reference
    ep = (await a.start_episode(PROMPT, sampling=SAMPLING)).episode_id
    ref = (await solo.start_episode(PROMPT, sampling=SAMPLING)).episode_id
    turns = [await b.step(ep), await a.step(ep, [9]), await b.step(ep, [10, 11])]
    expected = [await solo.step(ref), await solo.step(ref, [9]), await solo.step(ref, [10, 11])]
    assert [t.token_ids.tolist() for t in turns] == [t.token_ids.tolist() for t in expected]
    traj = await a.end_episode(ep)  # a had a stale copy: it reads the newest record first
    assert traj.token_ids.tolist() == (await solo.end_episode(ref)).token_ids.tolist()
    assert len(traj.turns) == 3
    with pytest.raises(NotFoundError):
        await b.step(ep)  # ended through the other bridge
    assert a_server.bridge.store.peek(ep) is None


async def test_a_step_holds_its_episode_across_bridges(start_bridge: Any, redis_server: PrivateRedis) -> None:
    slow = {"toy": {"token_delay_s": 0.02}}
    _, a = await start_bridge(engine=slow, **_persist(redis_server))
    _, b = await start_bridge(engine=slow, **_persist(redis_server))
    ep = (await a.start_episode(PROMPT, sampling={"max_tokens": 40, "ignore_eos": True})).episode_id
    running = asyncio.create_task(a.step(ep))
    await asyncio.sleep(0.3)
    with pytest.raises(FailedPreconditionError, match="another bridge"):
        await b.step(ep)
    with pytest.raises(FailedPreconditionError):
        await b.end_episode(ep)
    assert len((await running).token_ids) == 40
    assert len((await b.end_episode(ep)).turns) == 1


async def test_redis_down_fails_open_or_closed_as_configured(start_bridge: Any, redis_server: PrivateRedis) -> None:
    open_server, relaxed = await start_bridge(**_persist(redis_server))
    _, strict = await start_bridge(**_persist(redis_server, required=True))
    ep = (await relaxed.start_episode(PROMPT, sampling=SAMPLING)).episode_id
    redis_server.kill()
    assert len((await relaxed.step(ep)).token_ids) == 6  # served from memory
    assert len(await relaxed.end_episode(ep)) > len(PROMPT)
    assert open_server.metrics.fail_open.labels("persistence")._value.get() >= 2
    with pytest.raises(UnavailableError, match=r"cannot .* in Redis"):
        await strict.start_episode(PROMPT)
    assert not open_server.bridge.store.peek(ep)


class _Bridge:
    """A bridge in its own process (toy engine, persistence on); its log is kept for failure messages."""

    def __init__(self, redis: PrivateRedis, port: int, log: Path, extra_env: dict[str, str] | None = None) -> None:
        env = dict(
            os.environ,
            PRIMERL_PERSISTENCE__ENABLED="true",
            PRIMERL_REDIS__URL=redis.url,
            **(extra_env or {}),
        )
        cmd = [sys.executable, "-m", "server", "serve", "--engine", "toy", "--port", str(port), "--metrics-port", "0"]
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=out)

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        """The exit code; a process still running after ``timeout`` is killed and the test fails with its log."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"bridge still running {timeout:.0f} s after the signal; its log:\n{self.log_tail()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


async def test_killed_bridge_episodes_resume_in_a_new_process(redis_server: PrivateRedis, tmp_path: Path) -> None:
    port = free_port()
    first = _Bridge(redis_server, port, tmp_path / "first.log")
    client = AsyncBridgeClient(f"127.0.0.1:{port}", timeout=30)
    try:
        await client.wait_until_ready(60)
        ep = (await client.start_episode(PROMPT, sampling=SAMPLING)).episode_id
        turn1 = await client.step(ep)
        first.signal(signal.SIGKILL)  # no drain, no goodbye
        first.wait(30)
        second = _Bridge(redis_server, port, tmp_path / "second.log", QUICK_STOP)
        try:
            await client.wait_until_ready(60)
            turn2 = await client.step(ep, [9])
            traj = await client.end_episode(ep)
            assert traj.token_ids.tolist() == PROMPT + turn1.token_ids.tolist() + [9] + turn2.token_ids.tolist()
            assert [t.finish_reason for t in traj.turns] == ["length", "length"]
            assert traj.loss_mask.sum() == 12
            second.signal(signal.SIGTERM)
            assert second.wait(60) == 0, second.log_tail()
        finally:
            second.kill()
    finally:
        await client.close()
        first.kill()


async def test_sigterm_under_load_drains_steps_and_loses_no_trajectory(
    redis_server: PrivateRedis, tmp_path: Path
) -> None:
    port = free_port()
    env_slow = {"PRIMERL_ENGINE__TOY__TOKEN_DELAY_S": "0.01", "PRIMERL_SERVER__GRACE_PERIOD_S": "10"}
    first = _Bridge(redis_server, port, tmp_path / "first.log", env_slow)
    client = AsyncBridgeClient(f"127.0.0.1:{port}", timeout=60)
    try:
        await client.wait_until_ready(60)
        sampling = {"max_tokens": 40, "ignore_eos": True}
        eps = [(await client.start_episode(PROMPT, sampling=sampling)).episode_id for _ in range(20)]
        steps = [asyncio.create_task(client.step(ep)) for ep in eps]
        await asyncio.sleep(0.15)  # all 20 Steps are running
        first.signal(signal.SIGTERM)
        turns = await asyncio.gather(*steps)  # every in-flight Step finishes within the grace period
        assert all(len(t.token_ids) == 40 and t.finish_reason == "length" for t in turns)
        assert first.wait(60) == 0, (
            first.log_tail()
        )  # drained well within the 10 s grace; generous for a loaded CI machine
        second = _Bridge(redis_server, port, tmp_path / "second.log", QUICK_STOP)
        try:
            await client.wait_until_ready(60)
            for ep, turn in zip(eps, turns, strict=True):  # ended through the new process: nothing lost
                traj = await client.end_episode(ep)
                assert traj.token_ids.tolist() == PROMPT + turn.token_ids.tolist()
            second.signal(signal.SIGTERM)
            assert second.wait(60) == 0, second.log_tail()
        finally:
            second.kill()
    finally:
        await client.close()
        first.kill()


async def test_a_second_sigterm_stops_the_drain_at_once(redis_server: PrivateRedis, tmp_path: Path) -> None:
    port = free_port()
    env_slow = {"PRIMERL_ENGINE__TOY__TOKEN_DELAY_S": "0.05", "PRIMERL_SERVER__GRACE_PERIOD_S": "600"}
    bridge = _Bridge(redis_server, port, tmp_path / "bridge.log", env_slow)
    client = AsyncBridgeClient(f"127.0.0.1:{port}", timeout=60)
    try:
        await client.wait_until_ready(60)
        ep = (await client.start_episode(PROMPT, sampling={"max_tokens": 4000, "ignore_eos": True})).episode_id
        step = asyncio.create_task(client.step(ep))  # 200 s of tokens: would hold a 600 s drain
        await asyncio.sleep(0.5)
        bridge.signal(signal.SIGTERM)
        await asyncio.sleep(0.5)
        bridge.signal(signal.SIGTERM)  # the operator insists
        assert bridge.wait(60) == 0, bridge.log_tail()
        with pytest.raises(BridgeError):
            await step
        assert "second signal" in bridge.log_tail()
        again = _Bridge(redis_server, port, tmp_path / "again.log")
        try:
            await client.wait_until_ready(60)
            traj = await client.end_episode(ep)  # the cut turn was kept: partial tokens, finish reason abort
            assert [t.finish_reason for t in traj.turns] == ["abort"]
            assert 0 < len(traj.token_ids) - len(PROMPT) < 4000
        finally:
            again.kill()
    finally:
        await client.close()
        bridge.kill()
