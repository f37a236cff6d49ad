"""The three-component loop's contracts without a model (issue 37): how ``primerl rl`` splits its arguments, what
the trainer accepts from the orchestrator (a batch from the future or older than ``max_async_level`` is refused
naming the step), the run directory's atomic hand-offs, and the clear errors of bad configs.
The processes themselves run in ``tests/integration/test_rl_components.py``."""

from __future__ import annotations

import io
import logging
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from core.layered_config import ConfigError, load_config
from grpo.exchange import Batch, ExchangeError, RunDir, sampling_policy
from grpo.launcher import LaunchError, is_launch, launch, split_args, table
from grpo.orchestrator import OrchestratorConfig
from grpo.trainer import TrainerConfig, check_batch, next_batch


def member(*versions: int) -> SimpleNamespace:
    """A trajectory whose sampled tokens carry ``versions`` (one prompt token, never trained, at version 0)."""
    tokens = SimpleNamespace(
        policy_versions=np.array([0, *versions]), loss_mask=np.array([False] + [True] * len(versions))
    )
    return SimpleNamespace(tokens=tokens)


def batch(step: int, policy: int, *versions: int, wid: str = "w") -> Batch:
    return Batch(step, policy, wid, [member(*(versions or (policy,)))])


def test_batch_s_is_sampled_from_policy_s_minus_k() -> None:
    assert [sampling_policy(s, 2) for s in range(6)] == [0, 0, 0, 1, 2, 3]
    assert [sampling_policy(s, 0) for s in range(3)] == [0, 1, 2]


def test_the_trainer_measures_the_gap_and_refuses_old_and_future_batches() -> None:
    assert check_batch(batch(5, 3), 5, 2) == 2
    assert check_batch(batch(5, 5), 5, 2) == 0
    assert check_batch(batch(4, 3, 3, 4), 4, 2) == 1  # a multi-turn episode straddling an update: the oldest counts
    with pytest.raises(ExchangeError, match=r"batch of step 5 was sampled from policy 2, 3 versions old: more than "
                       r"max_async_level = 2 \(expected policy 3\)"):  # fmt: skip
        check_batch(batch(5, 2), 5, 2)
    with pytest.raises(ExchangeError, match=r"batch of step 3 was sampled from policy 4, newer than the trainer's "
                       r"policy 3: a batch from the future"):  # fmt: skip
        check_batch(batch(3, 3, 4), 3, 2)
    with pytest.raises(ExchangeError, match="from the future"):
        check_batch(batch(3, 4), 3, 2)


def test_batches_and_weights_change_hands_atomically(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    run.write_batch(batch(0, 0, wid="a"))
    assert [p.name for p in (tmp_path / "rollouts").iterdir()] == ["step_0.pkl"]  # no temporary left behind
    got = run.read_batch(0)
    assert (got.step, got.policy, got.weights_id) == (0, 0, "a")
    assert got.token_versions() == (0, 0)
    with pytest.raises(ExchangeError, match=r"no rollout batch for step 1 at .*step_1.pkl"):
        run.read_batch(1)
    run.batch_path(1).write_bytes(run.batch_path(0).read_bytes())
    with pytest.raises(ExchangeError, match="holds the batch of step 0, not of step 1"):
        run.read_batch(1)
    run.batch_path(2).write_bytes(b"not a pickle")
    with pytest.raises(ExchangeError, match=r"step_2\.pkl is unreadable"):
        run.read_batch(2)

    first = run.write_weights(0, lambda d: (d.mkdir(parents=True), (d / "model.safetensors").write_text("0")))
    again = run.write_weights(0, lambda d: (d.mkdir(parents=True), (d / "model.safetensors").write_text("0")))
    assert first != again and run.weights_id(run.weights(0)) == again  # a rewrite is another directory
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["step_0"]
    with pytest.raises(ExchangeError, match="no weights directory of a trainer"):
        run.weights_id(tmp_path)


def test_a_resumed_run_finds_its_policies_in_the_checkpoint_or_names_the_missing_one(tmp_path: Path) -> None:
    old, new = RunDir(tmp_path / "a"), RunDir(tmp_path / "b", tmp_path / "a" / "checkpoints")
    for n in range(4, 7):
        old.write_weights(n, lambda d: (d.mkdir(parents=True), (d / "model.safetensors").write_text("w")))
    ckpt = old.trainer_ckpt(6)
    ckpt.mkdir(parents=True)
    old.link_weights_into(ckpt, range(4, 7))
    assert (ckpt / "weights" / "step_4" / "model.safetensors").stat().st_nlink == 2  # a hard link, not a copy
    old.prune_weights(6)
    assert sorted(p.name for p in (tmp_path / "a" / "weights").iterdir()) == ["step_6"]
    assert new.policy_weights(4, 6, 2) == ckpt / "weights" / "step_4"  # the checkpoint's link survived the prune
    assert new.policy_weights(7, 6, 2) is None  # not written yet: the orchestrator waits for the trainer
    import shutil

    shutil.rmtree(ckpt / "weights" / "step_5")
    with pytest.raises(ExchangeError, match=r"policy 5: no weights directory at .* \(resuming at step 6 with "
                       r"max_async_level = 2 needs the trainer checkpoint's policies 4..6\)"):  # fmt: skip
        new.policy_weights(5, 6, 2)


def test_the_trainer_waits_out_an_earlier_runs_batch_and_names_the_step_when_none_comes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = RunDir(tmp_path)
    run.write_batch(batch(0, 0, wid="earlier-run"))
    fresh = batch(0, 0, wid="ours")
    threading.Timer(0.5, run.write_batch, args=(fresh,)).start()  # the orchestrator replaces it
    with caplog.at_level(logging.INFO, logger="primerl.trainer"):
        assert next_batch(run, 0, {0: {"ours"}}, timeout_s=30).weights_id == "ours"
    assert "sampled from other weights (an earlier run): waiting" in caplog.text
    t0 = time.monotonic()
    with pytest.raises(ExchangeError, match=r"waited 0 s for the rollout batch of step 1 at .*step_1.pkl: is the "
                       r"orchestrator running on this out_dir\?"):  # fmt: skip
        next_batch(run, 1, {0: {"ours"}}, timeout_s=0.3)
    assert time.monotonic() - t0 < 30
    run.write_batch(batch(1, 2, wid="x"))
    with pytest.raises(ExchangeError, match="from the future"):
        next_batch(run, 1, {0: {"ours"}}, timeout_s=5)


def test_primerl_rl_splits_files_component_keys_and_run_wide_keys() -> None:
    argv = ["--trainer", "@", "t.toml", "@", "t2.toml", "--orchestrator", "@", "o.toml", "--inference", "@", "i.toml"]
    argv += ["--max-steps", "10", "--trainer.lr", "1e-5", "--orchestrator.rollout.group-size=4", "--ckpt"]
    argv += ["--inference.engine.type", "toy", "--trainer.normalize-advantages"]
    assert is_launch(argv) and not is_launch(["@", "examples/grpo.toml", "--max-steps", "3"])
    assert not is_launch(["@", "examples/grpo.toml", "--trainer.lr", "1e-5"])  # the one-process loop's [trainer]
    assert is_launch(["--orchestrator.rollout.group-size", "4"])
    assert split_args(argv) == {
        "trainer": ["@", "t.toml", "@", "t2.toml", "--lr", "1e-5", "--normalize-advantages", "--max-steps", "10",
                    "--ckpt"],
        "orchestrator": ["@", "o.toml", "--rollout.group-size=4", "--max-steps", "10", "--ckpt"],
        "inference": ["@", "i.toml", "--engine.type", "toy"],
    }  # fmt: skip
    with pytest.raises(LaunchError, match=r"--trainer: expected '@ FILE' after it"):
        split_args(["--trainer", "t.toml"])
    with pytest.raises(LaunchError, match=r"--lr: not a run-wide key .* give it to one component as --trainer.lr"):
        split_args(["--trainer", "@", "t.toml", "--lr", "1e-5"])


def test_bad_configs_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"loss: Input should be 'clip', 'aipo', 'gspo' or 'cispo'"):
        load_config(TrainerConfig, ["--loss", "ppo2"])
    with pytest.raises(ConfigError, match=r"estimator: Input should be"):
        load_config(TrainerConfig, ["--estimator", "vtrace"])
    with pytest.raises(ConfigError, match=r"unknown config key 'lr'"):
        load_config(OrchestratorConfig, ["--lr", "1e-5"])
    cfg = load_config(TrainerConfig, ["--loss", "gspo", "--estimator", "opo", "--max-async-level", "1"])
    assert (cfg.loss, cfg.estimator, cfg.max_async_level, cfg.max_steps) == ("gspo", "opo", 1, 10)
    sink = io.StringIO()
    args = ["--trainer", "@", "examples/rl/trainer.toml", "--orchestrator", "@", "examples/rl/orchestrator.toml"]
    assert launch([*args, "--trainer.loss", "ppo2"], sink) == 2
    assert launch([*args, "--trainer.max-steps", "3"], sink) == 2  # a run-wide key set for one component only
    assert sink.getvalue() == ""  # nothing started


def test_the_trainer_and_the_orchestrator_refuse_bad_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from grpo.cli import run_command

    assert run_command("trainer", ["--model", str(tmp_path / "nope"), "--out-dir", str(tmp_path)]) == 1
    assert f"primerl trainer: model: no model directory at {tmp_path / 'nope'}" in capsys.readouterr().err
    out = ["--out-dir", str(tmp_path), "--ckpt.resume-step", "6"]
    assert run_command("trainer", out) == 1
    assert "primerl trainer: ckpt.resume_step: no trainer checkpoint at" in capsys.readouterr().err
    assert run_command("orchestrator", out) == 1
    assert "primerl orchestrator: no orchestrator checkpoint for step 6 at" in capsys.readouterr().err
    assert run_command("orchestrator", ["--out-dir", str(tmp_path)]) == 1
    assert "primerl orchestrator: bridge.target: set host:port of a running bridge" in capsys.readouterr().err


def test_the_table_shows_the_sampling_policy_and_the_gap(tmp_path: Path) -> None:
    import json

    rows = [{"step": 3, "reward": 0.5, "loss": 0.01, "policy_version": 3, "batch_policy": 0, "off_policy_gap": 2}]
    rows[0]["mismatch/k3_kl"] = 2.5e-6
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval.json").write_text(json.dumps({"before": {"correct": 0.4, "reward": 0.6, "policy": 0.0}}))
    text = table(tmp_path)
    head = ["step", "reward", "loss", "policy", "sampled", "gap", "k3_kl", "rollout_s", "train_s"]
    assert text.splitlines()[1].split() == head
    assert text.splitlines()[2].split()[:7] == ["3", "0.5", "0.01", "3", "0", "2", "2.5e-06"]
    assert "held-out before: 40.0% correct, reward 0.600 (policy 0)" in text
