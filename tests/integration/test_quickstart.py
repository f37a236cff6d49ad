"""The product README's quick start, command by command, as subprocesses with small budgets.

``make dev``, ``make gen-proto`` (into a scratch copy: the stubs it writes equal the committed ones),
``PYTHONPATH=. python -m server.main --engine toy`` (and the ``PRIMERL_ENGINE`` alias) serving an episode,
``scripts/analyze_metrics.py`` on a scrape, ``scripts/dev_loop.sh`` end to end (one step per algorithm; its perf
leg is ``make test``'s fast performance gate), then the reference GRPO trainer resuming from the loop's run, and the
committed ``artifacts/`` being what artifacts/README.md says they are.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from engines.launch import free_port
from rl_client import BridgeClient

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": f"{Path(PY).parent}:{os.environ.get('PATH', '')}"}
ENV = {k: v for k, v in ENV.items() if not k.startswith("PRIMERL_")}  # the commands' own defaults


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def run(cmd: list[str], timeout: float, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, cwd=cwd, env={**ENV, **env}, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    )
    return proc


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_make_dev_is_setup_and_leaves_the_tools_in_place() -> None:
    out = run(["make", "--no-print-directory", "dev"], timeout=880).stdout
    assert "Error" not in out
    for tool in ("ruff", "mypy", "pytest", "lint-imports"):
        assert (ROOT / ".venv" / "bin" / tool).exists(), tool
    dry = run(["make", "-n", "dev"], timeout=60).stdout
    assert "apt-get" in dry  # the same recipe as setup (the test services' packages)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_make_gen_proto_regenerates_the_committed_stubs(tmp_path: Path) -> None:
    for name in ("Makefile", "pyproject.toml", "constraints.txt"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "proto", tmp_path / "proto", ignore=shutil.ignore_patterns("*_pb2*", "__pycache__"))
    # -o setup: the scratch copy borrows the repo's virtualenv, it must not reinstall the project into it (its
    # copied pyproject.toml is newer than the venv's stamp, so setup would run `pip install -e .` from the copy and
    # leave the editable install pointing at this temporary directory; tests/env_guard.py catches that).
    cmd = ["make", "--no-print-directory", "-o", "setup", "gen-proto", f"VENV={ROOT / '.venv'}"]
    run(cmd, timeout=580, cwd=tmp_path)
    generated = sorted((tmp_path / "proto" / "primerl" / "v1").glob("*_pb2*"))
    assert generated, "make gen-proto wrote no stubs"
    for stub in generated:
        committed = ROOT / "proto" / "primerl" / "v1" / stub.name
        assert committed.read_bytes() == stub.read_bytes(), f"{stub.name} differs from the committed stub"


@pytest.mark.parametrize("how", ["flag", "env-alias"])
def test_python_m_server_main_serves_an_episode_and_stops_cleanly(how: str) -> None:
    port, metrics = free_port(), free_port()
    cmd = [PY, "-m", "server.main", "--port", str(port), "--metrics-port", str(metrics), "--http-port", "0"]
    env = dict(ENV)
    if how == "flag":
        cmd += ["--engine", "toy"]
    else:
        env["PRIMERL_ENGINE"] = "toy"
    bridge = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with BridgeClient(f"127.0.0.1:{port}") as client:
            client.wait_until_ready(timeout=120)
            assert client.server_info().models[0].engine == "toy"
            ep = client.start_episode([{"role": "user", "content": "hi"}], sampling={"max_tokens": 8, "seed": 1})
            turn = client.step(ep.episode_id)
            traj = client.end_episode(ep.episode_id, reward=1.0)
            assert len(turn.token_ids) > 0 and traj.reward == 1.0
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10) as resp:
            scrape = resp.read().decode()
        assert "primerl_turns_total" in scrape
    finally:
        bridge.send_signal(signal.SIGTERM)
        out, _ = bridge.communicate(timeout=60)
    assert bridge.returncode == 0, out[-3000:]


def test_analyze_metrics_summarises_the_committed_scrape() -> None:
    scrape = ROOT / "artifacts" / "metrics_scrape.txt"
    text = run([PY, "scripts/analyze_metrics.py", str(scrape)], timeout=120).stdout
    assert text.strip() == (ROOT / "artifacts" / "metrics_summary.txt").read_text().strip()
    summary = json.loads(run([PY, "scripts/analyze_metrics.py", str(scrape), "--json"], timeout=120).stdout)
    # 4 episodes x 2 turns of 16 tokens went through the bridge that was scraped (dev_loop_bridge.py):
    # StartEpisode, Step, Step, EndEpisode each, plus the readiness probe's health Check.
    toy = summary["models"]["toy/toy"]
    assert (toy["turns"], toy["generated"], toy["step_latency_count"]) == (8, 128, 8)
    assert summary["rpcs_by_code"] == {"OK": 17}
    piped = subprocess.run(
        [PY, "scripts/analyze_metrics.py", "-"], input=scrape.read_text(), capture_output=True, text=True, cwd=ROOT
    )
    assert piped.returncode == 0 and piped.stdout == text  # `curl -s HOST:9300/metrics | ... -`


def test_committed_artifacts_are_what_their_readme_says() -> None:
    art = ROOT / "artifacts"
    readme = (art / "README.md").read_text()
    for name in ("verifier_reward_sample.json", "perf_gate.csv", "grpo_steps.csv", "metrics_scrape.txt"):
        assert (art / name).is_file() and f"`{name}`" in readme, name
    verdict = json.loads((art / "verifier_reward_sample.json").read_text())
    assert isinstance(verdict["reward"], float) and verdict["receipt"]["envelope"]["signatures"]
    perf = read_csv(art / "perf_gate.csv")
    assert perf and {"figure", "value", "baseline", "better", "tolerance", "ok"} <= set(perf[0])
    steps = read_csv(art / "grpo_steps.csv")
    assert [int(r["step"]) for r in steps] == list(range(len(steps)))


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_dev_loop_runs_ppo_grpo_the_bridge_and_the_perf_gate_then_grpo_resumes(tmp_path: Path) -> None:
    """The dev loop (STEPS=1), then ``examples/grpo_train.py --resume`` from its GRPO leg's output.

    The perf leg is the fast performance gate of ``make test`` (the deterministic probes against
    bench/baselines.json "fast"): a regression fails this test with the gate's table and the figure named. The
    resume part was tests/integration/test_grpo_train.py until the test-loop issue 33; that test's first run was
    the same command as the loop's GRPO leg (``--group-size 2 --call-tokens 6 --answer-tokens 3 --no-record``)."""
    proc = run(["scripts/dev_loop.sh"], timeout=1450, STEPS="1", OUT=str(tmp_path), PY=PY)
    out = proc.stdout
    for line in ("GRPO gate passed: 1 steps", "PPO gate passed: 1 steps", "perf gate passed", "dev loop passed"):
        assert line in out, out[-4000:]
    art = tmp_path / "artifacts"
    assert json.loads((art / "verifier_reward_sample.json").read_text())["receipt"]["log_index"] == 0
    rows = read_csv(art / "perf_gate.csv")
    assert rows and all(r["ok"] == "True" for r in rows)
    assert "primerl_turns_total" in (art / "metrics_scrape.txt").read_text()

    # The GRPO leg's run: one optimizer step, its weights pushed and checkpointed, on-policy.
    grpo = tmp_path / "grpo"
    steps = json.loads((grpo / "history.json").read_text())["steps"]
    assert [s["step"] for s in steps] == [0]
    assert (grpo / "trainer_state.pt").exists() and (grpo / "weights" / "model.safetensors").exists()
    # on-policy: the trainer's recomputed logprobs match the engine's (ratio 1) whenever a step trained
    assert steps[0]["ratio"] == pytest.approx(1.0, abs=1e-3) or steps[0]["loss"] == 0.0
    # --resume: a fresh bridge is given the resumed weights first (v1), and step 1 trains on samples from it
    tiny = ["--group-size", "2", "--call-tokens", "6", "--answer-tokens", "3", "--no-record", "--max-minutes", "30"]
    run([PY, "examples/grpo_train.py", "--out", str(grpo), *tiny, "--steps", "2", "--resume"], timeout=1200)
    steps2 = json.loads((grpo / "history.json").read_text())["steps"]
    assert [s["step"] for s in steps2] == [0, 1]
    assert steps2[1]["version"] == 1 and steps2[1]["lag"] == 0
    assert (grpo / "reward_curve.png").stat().st_size > 1000
