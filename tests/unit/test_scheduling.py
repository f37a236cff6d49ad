"""tests/scheduling.py: what an xdist work unit is, the queue order, and the record scripts/suite_durations.py reads."""

from __future__ import annotations

import json
from pathlib import Path

from scripts import suite_durations
from tests import scheduling

ROOT = Path(__file__).resolve().parents[2]


def test_a_module_is_one_unit_and_the_vllm_modules_are_one() -> None:
    assert scheduling.unit_of("tests/unit/test_toolcall.py::test_a") == "tests/unit/test_toolcall.py"
    assert scheduling.unit_of("tests/integration/test_engine_vllm.py::test_errors_and_abort") == "vllm"
    assert scheduling.unit_of("tests/integration/test_control_vllm.py::test_x[1]") == "vllm"
    split = "tests/integration/test_rl_primitives.py::test_algorithm_raises_the_mean_reward[ppo]"
    assert scheduling.unit_of(split) == split  # a SPLIT module: each test its own unit


def test_units_that_need_the_side_venvs_wait_behind_other_work_while_they_are_provisioned() -> None:
    est = {"vllm": 395.0, "a": 200.0, "b": 150.0, "c": 100.0, "verifiers": 20.0, "d": 5.0}
    queue = ["vllm", "vllm", "a", "b", "c", "verifiers", "d"]  # longest first, a unit's items in a row
    order = scheduling.defer_units(queue, {"vllm", "verifiers"}, est)
    # a + b + c = 450 s >= DEFER_SIDE_ENV_UNITS_S (400): the deferred units go after c, longest first
    assert order == ["a", "b", "c", "vllm", "verifiers", "d"]
    assert scheduling.defer_units(queue, set(), est) == ["vllm", "a", "b", "c", "verifiers", "d"]
    # too little other work: last
    assert scheduling.defer_units(["vllm", "d"], {"vllm"}, est) == ["d", "vllm"]


def test_a_worker_takes_a_heavy_unit_only_while_fewer_than_two_others_hold_one() -> None:
    ppo = "tests/integration/test_rl_primitives.py::test_algorithm_raises_the_mean_reward[ppo]"
    light = "tests/unit/test_toolcall.py"
    assert scheduling.is_heavy("vllm") and scheduling.is_heavy(ppo) and not scheduling.is_heavy(light)
    queue = ["vllm", ppo, light]
    assert scheduling.MAX_HEAVY == 2
    assert scheduling.next_unit(queue, heavy_elsewhere=1, holds_heavy=False) == "vllm"
    assert scheduling.next_unit(queue, heavy_elsewhere=2, holds_heavy=False) == light  # two hold one: light
    assert scheduling.next_unit(queue, heavy_elsewhere=2, holds_heavy=True) == "vllm"  # runs after its own
    assert scheduling.next_unit(["vllm", ppo], heavy_elsewhere=2, holds_heavy=False) is None  # waits
    assert scheduling.next_unit([], heavy_elsewhere=0, holds_heavy=False) is None


RL_COMPONENTS = "tests/integration/test_rl_components.py::"  # the three-process runs (issue 37)


def test_every_named_module_exists_and_every_estimate_is_a_unit_of_today() -> None:
    named = [m for modules in scheduling.GROUPS.values() for m in modules] + list(scheduling.SPLIT)
    named += list(scheduling.HEAVY_MODULES)
    assert all((ROOT / m).is_file() for m in named), named
    estimates = scheduling.load_estimates()
    assert estimates and all(seconds >= 0 for seconds in estimates.values())
    assert max(estimates, key=estimates.__getitem__) in {"vllm", "tests/integration/test_rl_resume.py"} | {
        u for u in estimates if u.startswith(("tests/integration/test_rl_primitives.py::", RL_COMPONENTS))
    }


def test_the_summary_sums_phases_per_module_unit_and_worker(tmp_path: Path) -> None:
    phases = [
        {"nodeid": "tests/a.py::t1", "unit": "tests/a.py", "when": "setup", "duration": 2.0, "outcome": "passed",
         "worker": "gw0"},
        {"nodeid": "tests/a.py::t1", "unit": "tests/a.py", "when": "call", "duration": 3.0, "outcome": "passed",
         "worker": "gw0"},
        {"nodeid": "tests/b.py::t2", "unit": "vllm", "when": "call", "duration": 1.0, "outcome": "failed",
         "worker": "gw1"},
    ]  # fmt: skip
    path = tmp_path / "record.json"
    path.write_text(json.dumps({"wall_s": 4.0, "workers": 2, "exitstatus": 1, "phases": phases}))
    summary = suite_durations.summarise(suite_durations.load(path), top=5)
    assert summary["outcomes"] == {"passed": 1, "failed": 1}
    assert summary["busy_s"] == {"gw0": 5.0, "gw1": 1.0}
    assert summary["modules"][0] == {"module": "tests/a.py", "setup": 2.0, "call": 3.0, "teardown": 0.0, "total": 5.0}
    assert summary["units"] == {"tests/a.py": 5.0, "vllm": 1.0}
    assert summary["slowest"][0] == {"test": "tests/a.py::t1", "seconds": 5.0}
