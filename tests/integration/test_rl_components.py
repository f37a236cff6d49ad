"""prime-rl's three components as three processes (issue 37, acceptance 1-3): ``primerl rl --trainer @ ...
--orchestrator @ ... --inference @ ...`` on the embedded engine.

The run is the shipped example (``examples/rl/``: ``make run``'s task and settings) with ``max_async_level = 2``,
shrunk to groups of 4, one episode at a time (``rollout.max-concurrent 1``: the engine's batching, hence every float,
is the same in every run) and no held-out evaluation: five steps, every batch sampled from policy ``max(0, S - 2)``
(from the versions the bridge recorded on its tokens), rollouts overlapping training (the recorded timestamps), the
per-step table showing the sampling policy and the gap. A run resumed from the step-3 checkpoints into another
directory (a fresh bridge, given policy 1 from the trainer checkpoint by the orchestrator) has steps 4-5 equal to
the uninterrupted run's and ends with the same weights bit for bit (the optimizer moments were restored: AdamW's
update depends on them): ``test_rl_resume.py``'s assertions for the single-process loop, here through the
trainer's and the orchestrator's checkpoints. That the held-out reward rises over such a run, with the example's
full settings, is ``bench/rl_components.py``'s figure (``bench/RESULTS.md``), not this test's: it needs groups of 8
and 60 greedy episodes of evaluation (with them this test took 428 s alone, 210 s without; ten steps resumed from
step 6, as it was until issue 33 shrank it, took 296 s in a full run; seven resumed from step 4 took 241 s in a full
run on 2026-12-06; five resumed from 3 assert the same: two resumed steps that train, both checkpointed policies
handed to the fresh bridge, each batch from policy max(0, S - 2)).
Killing the trainer process ends the run, naming it, with a non-zero exit and no component left running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from grpo.exchange import RunDir

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
COMPONENTS = [
    "--trainer", "@", "examples/rl/trainer.toml",
    "--orchestrator", "@", "examples/rl/orchestrator.toml",
    "--inference", "@", "examples/rl/inference.toml",
]  # fmt: skip
K = 2
STEPS, RESUME = 5, 3


def primerl_rl(out: Path, *flags: str, timeout: float = 2400) -> str:
    cmd = [sys.executable, "-m", "server", "rl", *COMPONENTS, "--out-dir", str(out), "--max-async-level", str(K)]
    proc = subprocess.run([*cmd, *flags], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    return proc.stdout


def rows(out: Path, name: str = "metrics.jsonl") -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


def weights(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.mark.timeout(2400)
def test_three_processes_async_by_two_learn_and_resume_exactly(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    small = ("--orchestrator.rollout.max-concurrent", "1", "--orchestrator.rollout.group-size", "4")
    small += ("--orchestrator.eval.problems", "0")
    stdout = primerl_rl(a, "--max-steps", str(STEPS), "--ckpt", "--ckpt.interval", str(RESUME), *small)
    for prefix in ("[inference] ", "[orchestrator] ", "[trainer] "):
        assert prefix in stdout, stdout[-3000:]
    straight = rows(a)
    assert [r["step"] for r in straight] == list(range(1, STEPS + 1))
    # the per-step table: the policy each batch was sampled from and the off-policy gap
    table = stdout[stdout.index("     step") :].splitlines()
    assert table[0].split() == ["step", "reward", "loss", "policy", "sampled", "gap", "k3_kl", "rollout_s", "train_s"]
    assert [line.split()[4:6] for line in table[1 : STEPS + 1]] == [[str(max(0, s - K)), str(s - max(0, s - K))]
                                                                     for s in range(STEPS)], table  # fmt: skip

    # every batch from policy max(0, S - 2), by the versions the bridge recorded on its sampled tokens
    run = RunDir(a)
    for s in range(STEPS):
        batch = run.read_batch(s)
        assert batch.token_versions() == (max(0, s - K), max(0, s - K)), (s, batch.token_versions())
        assert straight[s]["off_policy_gap"] == s - max(0, s - K) <= K
    # rollouts overlap training: batch S+1 (or S+2) is sampled while the trainer trains on batch S
    overlapping = [
        s for s in range(STEPS - 1)
        if any(straight[t]["rollout_start"] < straight[s]["train_end"] and straight[s]["train_start"] <
               straight[t]["rollout_end"] for t in (s + 1, min(s + 2, STEPS - 1)))
    ]  # fmt: skip
    assert len(overlapping) >= STEPS // 2, [
        (r["rollout_start"], r["rollout_end"], r["train_start"], r["train_end"]) for r in straight
    ]
    print(f"\nrewards per step: {[round(r['reward'], 3) for r in straight]}")
    saved = sorted([f"step_{RESUME}", f"step_{STEPS}"])
    assert sorted(p.name for p in (a / "checkpoints" / "trainer").iterdir()) == saved
    assert sorted(p.name for p in (a / "checkpoints" / "orchestrator").iterdir()) == saved

    # resume from step RESUME in another directory, on a fresh bridge
    resume = ("--ckpt.dir", str(a / "checkpoints"), "--ckpt.resume-step", str(RESUME))
    primerl_rl(b, "--max-steps", str(STEPS), *resume, *small)
    resumed = rows(b)
    assert [r["step"] for r in resumed] == list(range(RESUME + 1, STEPS + 1))
    keys = ("reward", "reward_std", "loss", "grad_norm", "policy_version", "trained_tokens", "clip_frac")
    keys += ("batch_policy", "off_policy_gap")
    for got, want in zip(resumed, straight[RESUME:], strict=True):
        assert {k: got[k] for k in keys} == pytest.approx({k: want[k] for k in keys}, rel=1e-9, abs=1e-12), (got, want)
    assert any(r["grad_norm"] > 0 and r["reward_std"] > 0 for r in straight[RESUME:])  # steps that trained
    # the orchestrator gave the fresh bridge the checkpoint's policies RESUME-2 and RESUME-1, then the trainer's
    loads = rows(b, "orchestrator.jsonl")
    assert [(r["step"], r["policy"], r["loaded"]) for r in loads] == [(s, s - K, True) for s in range(RESUME, STEPS)]
    ckpt_weights = a / "checkpoints" / "trainer" / f"step_{RESUME}" / "weights"
    assert [r["weights"] for r in loads[:K]] == [str(ckpt_weights / f"step_{RESUME - K + i}") for i in range(K)]
    wa, wb = weights(a / "weights" / f"step_{STEPS}"), weights(b / "weights" / f"step_{STEPS}")
    assert wa.keys() == wb.keys()
    assert all(wa[k].equal(wb[k]) for k in wa), [k for k in wa if not wa[k].equal(wb[k])][:5]


@pytest.mark.timeout(600)
def test_killing_the_trainer_ends_the_run_naming_it(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "server", "rl", *COMPONENTS, "--out-dir", str(tmp_path), "--max-steps", "10"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines: list[str] = []
    pids: dict[str, int] = {}
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("primerl rl: pids: "):  # "inference 123, orchestrator 124, trainer 125"
                pids = {n: int(p) for n, p in (x.split() for x in line.split(": ", 2)[2].split(", "))}
                break
        assert set(pids) == {"inference", "orchestrator", "trainer"}, "".join(lines)[-3000:]
        ps = subprocess.run(["ps", "-o", "pid=,args=", "-p", ",".join(map(str, pids.values()))], capture_output=True,
                            text=True, check=True).stdout  # fmt: skip
        for name, pid in pids.items():
            assert any(r.split(None, 1)[0] == str(pid) and f"-m server {name}" in r for r in ps.splitlines()), ps
        os.kill(pids["trainer"], signal.SIGKILL)
        rest, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    out = "".join(lines) + rest
    assert proc.returncode == 1, out[-3000:]
    assert f"primerl rl: the trainer (pid {pids['trainer']}) was killed by SIGKILL; stopping the others" in out
    time.sleep(0.5)
    for name in ("inference", "orchestrator"):
        with pytest.raises(ProcessLookupError):
            os.kill(pids[name], 0)  # stopped and reaped by the launcher
