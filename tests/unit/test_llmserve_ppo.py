"""LLMServeEnv's PPO agent: trains (BC warm start + PPO), saves, loads through make_agent and plays
deterministically; its episodes grade in [0, 1] (issue 20, acceptance 3); the CLI trains and prints the table."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmserve.agents import make_agent
from llmserve.grader import grade, run_agent
from llmserve.models import ServeAction
from llmserve.ppo import LEVELS, TrainConfig, from_action, to_action, train
from server.cli import main

TINY = {"steps": 200, "bc_episodes": 4, "bc_epochs": 20, "val_seeds": 2, "episodes_per_iter": 2, "eval_every": 1}


def test_discretised_actions_round_trip() -> None:
    for idx in ([0, 0, 0, 0, 0, 0], [len(v) - 1 for v in LEVELS.values()], [3, 2, 1, 1, 0, 1]):
        assert from_action(to_action(idx)) == idx
    assert from_action(ServeAction(batch_cap=40, kv_budget_fraction=0.93))[:2] == [3, 3]  # nearest levels (ties low)


def test_train_save_load_evaluate_is_deterministic(tmp_path: Path) -> None:
    stats = train(TrainConfig(task_id="static_workload", seed=3, **TINY), tmp_path / "a", log=lambda _: None)
    train(TrainConfig(task_id="static_workload", seed=3, **TINY), tmp_path / "b", log=lambda _: None)
    assert stats["history"][-1]["env_steps"] >= 200 and stats["bc_accuracy"] > 0.5
    a = torch.load(tmp_path / "a" / "static_workload" / "policy.pt", weights_only=True)
    b = torch.load(tmp_path / "b" / "static_workload" / "policy.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # same seed -> same weights

    agent = make_agent("ppo", weights=str(tmp_path / "a"))
    logs = [run_agent(agent, "static_workload", 7) for _ in range(2)]
    assert logs[0] == logs[1]  # greedy policy: same seed -> same actions and rewards
    for seed in (0, 1, 2):
        g = grade(run_agent(agent, "static_workload", seed))
        assert 0.0 <= g.score <= 1.0 and g.episode_return == pytest.approx(
            sum(run_agent(agent, "static_workload", seed).rewards)
        )


def test_missing_weights_name_the_train_command(tmp_path: Path) -> None:
    agent = make_agent("ppo", weights=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="primerl llmserve train --task bursty_workload"):
        run_agent(agent, "bursty_workload", 0)
    with pytest.raises(SystemExit, match="unknown task 'nope'; tasks: static_workload"):
        main(["llmserve", "evaluate", "--task", "nope", "--weights", str(tmp_path)])


def test_cli_train_then_evaluate_prints_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "w")
    assert main(["llmserve", "train", "--task", "static_workload", "--steps", "32", "--seed", "1", "--out", out]) == 0
    assert (tmp_path / "w" / "static_workload" / "meta.json").is_file()
    assert "trained in" in capsys.readouterr().out
    argv = ["llmserve", "evaluate", "--task", "static_workload", "--episodes", "2", "--weights", out]
    assert main(argv) == 0
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("| static_workload")]
    assert [r.split("|")[2].strip() for r in rows] == ["ppo", "heuristic", "random"]
    assert "| static_workload | heuristic | " in table and "0.500 |" in table  # the reference grades 0.5
    assert main(argv) == 0 and capsys.readouterr().out == table  # deterministic
