"""A pytest plugin that records where the suite's time goes and spreads it over ``pytest-xdist`` workers.

Recording: with ``PRIMERL_TEST_DURATIONS=PATH`` (``make test`` and ``make test-fast`` set it), every test phase
(set-up, call, tear-down) with its duration and worker is written to PATH at the end of the session;
``scripts/suite_durations.py`` sums it per module and per fixture set-up, and writes the per-unit estimates
below. A run of one module by hand records nothing, so it never overwrites the last full run's record.

Scheduling (``make test`` runs ``-n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder``, 2 or 3
workers on 2 cores): xdist hands a worker one work unit at a time, and this plugin says what a unit is
(``GroupScheduling``):

* a module by default: its module-scoped fixtures (an embedded model, a bridge child) are set up once, as
  without xdist;
* ``vllm``: every module that uses the session's vLLM server (``vllm_url``), so one server serves the run; a
  module that asks for ``vllm_url`` without being listed fails the collection, naming this file;
* each test of a module in ``SPLIT`` on its own (long, independent tests: every worker can take one);

and at most ``MAX_HEAVY`` workers hold a heavy unit (a model in training, a real vLLM) at once: memory.

(xdist's own ``xdist_group`` marks do not work with pytest 9.2: xdist 3.8 renames ``item._nodeid``, which
pytest 9.2 no longer reads; so the groups are named here, by node id, where the controller can see them.)

Units are queued longest first, by the committed estimates in ``tests/durations.json`` (seconds per unit,
measured), so that the workers finish together instead of one starting the longest module last.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

ESTIMATES = Path(__file__).resolve().parent / "durations.json"
RECORD_ENV = "PRIMERL_TEST_DURATIONS"
INTEGRATION = "tests/integration/"
GROUPS = {  # modules that share a session-scoped server: one unit, one worker, one server
    "vllm": tuple(
        f"{INTEGRATION}{m}.py"
        for m in (
            "test_engine_vllm",
            "test_http_dropin",
            "test_score_tokens_vllm",
            "test_control_vllm",
            "test_kv_event_index",
            "test_vllm_kill_during_update",
            "test_vllm_staged_reload",
        )
    ),
}
SHARED_FIXTURES = {"vllm_url": "vllm"}  # the session fixture each group exists for
SPLIT = frozenset(
    {f"{INTEGRATION}test_rl_primitives.py", f"{INTEGRATION}test_rl_components.py"}
)  # one unit per test: training runs, independent
UNKNOWN_S = 10.0  # a unit with no estimate yet (a new module)
# Units that train a model or run a real vLLM (4-5 GiB each). On 3 workers (one 24 GB, 2-core machine) two learning
# runs beside a vLLM peaked at 22.4 GiB used of 23.5 (docs/testing.md); so a worker takes a heavy unit only while
# fewer than MAX_HEAVY other workers hold one, and light units meanwhile. On 2 workers the rule never bites.
HEAVY_MODULES = frozenset(
    f"{INTEGRATION}{m}.py"
    for m in (
        "test_rl_primitives",
        "test_rl_components",
        "test_quickstart",
        "test_mismatch_rl",
        "test_rl_resume",
        "test_mismatch_exact",
        "test_lora_vllm",
        "test_failover_processes",
    )
)
MAX_HEAVY = 2
# While make test provisions the vLLM and verifiers virtualenvs in the background (PRIMERL_SIDE_ENVS_PENDING=1: a
# fresh machine, or a pin changed), the units that need them start only after this many seconds of other units'
# estimates (two or three workers: a half to a third of it in wall time), instead of waiting first in line on the
# provisioner.
SIDE_ENVS_PENDING_ENV = "PRIMERL_SIDE_ENVS_PENDING"
DEFER_SIDE_ENV_UNITS_S = 400.0
SIDE_ENV_MARKER = "engine"  # a real vLLM: the vLLM virtualenv
SIDE_ENV_MODULES = frozenset({f"{INTEGRATION}test_http_verifiers.py"})  # verifiers' own virtualenv

_MODULE_GROUP = {module: group for group, modules in GROUPS.items() for module in modules}
_phases = pytest.StashKey[list[dict[str, object]]]()
_started = pytest.StashKey[float]()


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def unit_of(nodeid: str) -> str:
    """The work unit a test belongs to: its group, its module, or (``SPLIT``) the test itself."""
    module = module_of(nodeid)
    if module in SPLIT:
        return nodeid
    return _MODULE_GROUP.get(module, module)


def is_heavy(unit: str) -> bool:
    return unit in GROUPS or module_of(unit) in HEAVY_MODULES


def next_unit(queue: list[str], heavy_elsewhere: int, holds_heavy: bool) -> str | None:
    """The unit a worker takes next: the first queued one, unless it is heavy and ``MAX_HEAVY`` other workers hold a
    heavy unit (a worker that holds one already may queue another: it runs them one after the other); then the first
    light one, or none (the worker waits until a heavy unit ends)."""
    for unit in queue:
        if holds_heavy or heavy_elsewhere < MAX_HEAVY or not is_heavy(unit):
            return unit
    return None


def load_estimates() -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(ESTIMATES.read_text())["units"].items()}
    except (OSError, ValueError, KeyError):
        return {}


@pytest.hookimpl(trylast=True)  # after -m and -k deselected: only what runs is checked and ordered
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for fixture, group in SHARED_FIXTURES.items():
            module = module_of(item.nodeid)
            if fixture in getattr(item, "fixturenames", ()) and _MODULE_GROUP.get(module) != group:
                raise pytest.UsageError(
                    f"{module} uses the session fixture {fixture!r}: add it to GROUPS[{group!r}] in "
                    "tests/scheduling.py, or each xdist worker starts a server of its own"
                )
    # Longest unit first; within a unit (and among units of equal estimate) the collection order stays.
    estimates = load_estimates()
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        first_seen.setdefault(unit_of(item.nodeid), i)
    items.sort(key=lambda item: (-estimates.get(unit_of(item.nodeid), UNKNOWN_S), first_seen[unit_of(item.nodeid)]))
    if os.environ.get(SIDE_ENVS_PENDING_ENV):
        needs = {
            unit_of(i.nodeid)
            for i in items
            if i.get_closest_marker(SIDE_ENV_MARKER) or module_of(i.nodeid) in SIDE_ENV_MODULES
        }
        order = defer_units([unit_of(i.nodeid) for i in items], needs, estimates)
        rank = {unit: k for k, unit in enumerate(order)}
        items.sort(key=lambda item: rank[unit_of(item.nodeid)])  # stable: a unit's own order stays


def defer_units(units: list[str], deferred: set[str], estimates: dict[str, float]) -> list[str]:
    """``units`` (in queue order, repeats allowed) without repeats, the ``deferred`` ones moved behind the first
    ``DEFER_SIDE_ENV_UNITS_S`` seconds of the others' estimates (in their own order); everything else keeps its
    place. Fewer other units than that: the deferred ones go last."""
    order = list(dict.fromkeys(units))
    rest = [u for u in order if u not in deferred]
    late = [u for u in order if u in deferred]
    ahead, cut = 0.0, len(rest)
    for k, unit in enumerate(rest):
        if ahead >= DEFER_SIDE_ENV_UNITS_S:
            cut = k
            break
        ahead += estimates.get(unit, UNKNOWN_S)
    return rest[:cut] + late + rest[cut:]


@pytest.hookimpl(optionalhook=True)  # an xdist hook: absent without pytest-xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        """xdist's scope scheduling with ``unit_of`` as the scope, and every item of a node id sent.

        schemathesis' ``schema.parametrize()`` makes one item per API operation, and under pytest 9.2 they all
        carry the test's bare node id (13 items of ``test_no_server_error_and_openai_error_json``). xdist keys a
        work unit by node id and sends ``collection.index(nodeid)``: only the first of them ran, 41 of the
        suite's items silently did not. So a unit sends the index of every item whose node id it holds."""

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

        def _holds_heavy(self, node: Any) -> bool:
            work = self.assigned_work.get(node, {})
            return any(is_heavy(scope) and not all(done.values()) for scope, done in work.items())

        def _assign_work_unit(self, node: Any) -> None:
            elsewhere = sum(self._holds_heavy(other) for other in self.assigned_work if other is not node)
            scope = next_unit(list(self.workqueue), elsewhere, self._holds_heavy(node))
            if scope is None:  # only heavy units are left and MAX_HEAVY workers hold one: wait
                return
            work_unit = self.workqueue.pop(scope)
            self.assigned_work.setdefault(node, {})[scope] = work_unit
            pending = {nodeid for nodeid, completed in work_unit.items() if not completed}
            collection = self.registered_collections[node]
            node.send_runtest_some([i for i, nodeid in enumerate(collection) if nodeid in pending])

        def mark_test_complete(self, node: Any, item_index: int, duration: float = 0) -> None:
            super().mark_test_complete(node, item_index, duration)
            for other in self.nodes:  # a worker left waiting for a heavy unit may take one now
                if other is not node and not self._pending_of(self.assigned_work.get(other, {})):
                    self._reschedule(other)

    return GroupScheduling(config, log)


def _worker(report: pytest.TestReport) -> str:
    node = getattr(report, "node", None)  # set by xdist's controller on a worker's report
    return str(node.gateway.id) if node is not None else "main"


def pytest_configure(config: pytest.Config) -> None:
    phases: list[dict[str, object]] = []
    config.stash[_phases] = phases
    config.stash[_started] = time.time()

    class _Recorder:  # a plugin object: the report hook does not get the config
        @staticmethod
        def pytest_runtest_logreport(report: pytest.TestReport) -> None:
            phases.append(
                {
                    "nodeid": report.nodeid,
                    "unit": unit_of(report.nodeid),
                    "when": report.when,
                    "duration": round(report.duration, 4),
                    "outcome": report.outcome,
                    "worker": _worker(report),
                    "stop": round(report.stop, 3),
                }
            )

    config.pluginmanager.register(_Recorder(), "scheduling_recorder")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if hasattr(config, "workerinput"):  # a worker: the controller saw every report and writes once
        return
    phases = config.stash.get(_phases, [])
    record_path = os.environ.get(RECORD_ENV)
    if not phases or not record_path:
        return
    started = config.stash.get(_started, time.time())
    record = {
        "started": round(started, 3),
        "wall_s": round(time.time() - started, 1),
        "workers": config.getoption("numprocesses", None) or 0,
        "exitstatus": int(exitstatus),
        "phases": phases,
    }
    path = Path(record_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=0))
