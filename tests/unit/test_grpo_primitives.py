"""The RL primitives that need no model: environments on envhub's protocol, the AIPO loss, off-policy masking,
REINFORCE's baseline, advantage normalisation, the rl config (issue 23)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from core.errors import FailedPrecondition
from envhub import EnvHubConfig, Environment, FinalAnswer, ToolCall, ToolLoop
from grpo import ConversationEnvironment, SimpleTextEnvironment, SVRLEnvironment
from grpo.backprop import normalize
from grpo.masks import version_mask

torch = pytest.importorskip("torch")


async def test_simple_text_environment_is_an_envhub_environment() -> None:
    env = SimpleTextEnvironment(["2+2?", "3+3?"], reward_fn=lambda p, a: float(a.strip() == str(eval(p[:-1]))))
    as_protocol: Environment = env  # mypy checks the protocol statically, isinstance at run time
    assert isinstance(as_protocol, Environment)
    opening = await env.reset(seed=1)
    assert [m.content for m in opening.messages] == ["3+3?"] and not env.is_terminal()
    result = await env.step(FinalAnswer("6"))
    assert result.done and result.reward == 1.0 and env.is_terminal() and env.state().reward == 1.0
    with pytest.raises(FailedPrecondition):
        await env.step(FinalAnswer("6"))


async def test_conversation_environment_runs_turns_until_the_user_stops() -> None:
    env = ConversationEnvironment(
        ["hi"],
        respond_fn=lambda st, text: None if "bye" in text else "go on",
        reward_fn=lambda st: float(len(st.turns)),
        max_turns=5,
    )
    await env.reset()
    assert [m.content for m in (await env.step(FinalAnswer("hello"))).observation] == ["go on"]
    assert not env.is_terminal()
    last = await env.step(FinalAnswer("bye"))
    assert last.done and last.reward == 2.0
    fork = env.fork()
    with pytest.raises(FailedPrecondition):
        fork.state()  # a fork is a fresh episode: reset first


async def test_svrl_environment_through_the_envhub_tool_loop() -> None:
    env = SVRLEnvironment(["7*6"], answer_fn=lambda p, a: float(a.strip() == "42"), tool_budget=1, tool_cost=0.1)
    await env.reset()
    loop = ToolLoop(env, EnvHubConfig().loop)
    call = '<tool_call>{"name": "verify", "arguments": {"answer": "41"}}</tool_call>'
    first = await loop.on_turn(call)
    assert first.should_continue and first.observation[0].content == "incorrect"
    again = await env.call_tool(ToolCall("verify", {"answer": "42"}))
    assert again.is_error and "budget" in again.content  # the budget of one is used up
    final = await loop.on_turn("42")
    assert final.done and final.reward == pytest.approx(1.0 - 0.1)


def test_aipo_token_is_loss_caps_the_weight_and_masks() -> None:
    from grpo.losses import token_is_loss

    lp = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -3.0, float("nan")]])  # ratio 1, ratio e^2 (capped at 2), masked garbage
    adv = torch.tensor([[1.0, 1.0, 1.0]])
    mask = torch.tensor([[True, True, False]])
    loss, stats = token_is_loss(lp, old, adv, mask, cap=2.0, mode="token_mean")
    loss.backward()
    assert lp.grad is not None
    assert lp.grad[0].tolist() == pytest.approx([-0.5, -1.0, 0.0])  # -w * A / n_tokens, w = 1 and 2
    assert stats["clip_frac"] == 0.5 and torch.isfinite(loss)


def test_version_mask_drops_tokens_older_than_the_async_level() -> None:
    traj = SimpleNamespace(policy_versions=np.array([3, 4, 5, 5]))
    assert version_mask(traj, trainer_version=5, max_async_level=1).tolist() == [False, True, True, True]
    assert version_mask(traj, trainer_version=5, max_async_level=0).tolist() == [False, False, True, True]


def test_normalize_uses_trained_tokens_only() -> None:
    advs = [np.array([1.0, 1.0, 99.0]), np.array([3.0])]
    masks = [np.array([True, True, False]), np.array([True])]
    out = normalize(advs, masks)
    flat = np.concatenate([out[0][:2], out[1]])
    assert flat.mean() == pytest.approx(0.0) and flat.std() == pytest.approx(1.0, rel=1e-6) and out[0][2] == 0.0


@dataclass
class _Traj:
    reward: float
    group: int
    tokens: Any


def test_reinforce_baseline_is_a_moving_average() -> None:
    from grpo.algorithms import AlgorithmConfig, REINFORCEAlgorithm

    algo = object.__new__(REINFORCEAlgorithm)
    algo.config = AlgorithmConfig(baseline_decay=0.5)
    algo.extra_state = {}
    tokens = type("Tokens", (), {"prompt_length": 1, "__len__": lambda self: 3})()  # 2 completion tokens
    batch: Any = [_Traj(r, 0, tokens) for r in (1.0, 0.0)]
    first, _ = algo.advantages(batch, np.array([1.0, 0.0]))
    assert [a.tolist() for a in first] == [[0.5, 0.5], [-0.5, -0.5]]  # first batch: b = its mean
    second, _ = algo.advantages(batch, np.array([1.0, 1.0]))
    assert [a[0] for a in second] == [0.5, 0.5] and algo.extra_state["baseline"] == 0.75


def test_rl_config_layers_and_names_unknown_keys(tmp_path: Any) -> None:
    from core.layered_config import ConfigError, load_config
    from grpo.cli import RLConfig

    cfg = load_config(RLConfig, ["@", "examples/grpo.toml", "--max-steps", "6", "--ckpt", "--ckpt.interval", "3"])
    assert cfg.max_steps == 6 and cfg.ckpt is not None and cfg.ckpt.interval == 3 and cfg.rollout.group_size == 8
    env = {"PRIMERL_MAX_STEPS": "10", "PRIMERL_CKPT__KEEP_LAST": "2"}  # the file's max_steps beats the environment
    resumed = load_config(RLConfig, ["@", "examples/grpo.toml", "--ckpt.resume-step", "6"], env=env)
    assert resumed.max_steps == 30 and resumed.ckpt is not None and resumed.ckpt.resume_step == 6
    assert resumed.ckpt.keep_last == 2
    with pytest.raises(ConfigError, match="group_siz"):
        load_config(RLConfig, ["--rollout.group-siz", "3"])


@pytest.mark.parametrize("layers", [["grpo.toml"], ["grpo.toml", "ppo.toml"]])
def test_shipped_rl_configs_load(layers: list[str]) -> None:
    from core.layered_config import load_config
    from grpo.cli import RLConfig

    argv = [token for name in layers for token in ("@", f"examples/{name}")]
    cfg = load_config(RLConfig, argv, env={})
    assert cfg.trainer.temperature == cfg.rollout.temperature  # the on-policy ratio is 1 only when they match
