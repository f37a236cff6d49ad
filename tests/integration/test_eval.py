"""``primerl eval``: registered tasks x checkpoints through a real bridge, scores signed into the verifier log.

Small budgets on the toy engine (its "weights" are its base tables or a version-seeded perturbation of
them): two registered tasks against two checkpoints; a rerun against a fresh bridge gives identical
numbers; every sample's verdict is in the log, the log audits and the written material verifies offline
with ``primerl verifier verify``; bad task files and arguments are errors naming what is wrong.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from core.errors import InvalidArgument
from engines.toy import TOY_BASE_WEIGHTS
from evals.cli import run_eval_command
from evals.registry import load_registry, select
from evals.runner import Checkpoint
from server.cli import build_parser, main
from tests.conftest import StartBridge


def _args(tmp_path: Path, out: str, target: str, *extra: str) -> Any:
    argv = ["eval", "--task", "calculator", "--task", "arith-exact", "--samples", "3", "--bridge", target]
    argv += [
        "--checkpoint",
        f"base={TOY_BASE_WEIGHTS}",
        "--checkpoint",
        "v1=/toy/perturbed",
        "--out",
        str(tmp_path / out),
    ]
    argv += ["--database-url", f"sqlite:///{tmp_path / 'log.sqlite3'}", "--key-dir", str(tmp_path / "keys"), *extra]
    return build_parser().parse_args(argv)


async def _run(tmp_path: Path, out: str, start_bridge: StartBridge) -> dict[str, Any]:
    import asyncio

    server, _ = await start_bridge()
    rc = await asyncio.to_thread(run_eval_command, _args(tmp_path, out, f"127.0.0.1:{server.port}"))
    assert rc == 0
    return json.loads((tmp_path / out / "summary.json").read_text())


async def test_two_tasks_two_checkpoints_reproducible_signed_and_verified(
    start_bridge: StartBridge, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = await _run(tmp_path, "a", start_bridge)
    table = capsys.readouterr().out
    assert "calculator" in table and "arith-exact" in table and "base" in table and "v1" in table
    assert set(first["table"]) == {"calculator", "arith-exact"}
    assert set(first["table"]["calculator"]) == {"base", "v1"} and set(first["table"]["calculator"]["base"]) == {
        "mean",
        "pass",
    }
    second = await _run(tmp_path, "b", start_bridge)  # a fresh bridge, the same seed
    assert second["table"] == first["table"]
    rows = [json.loads(x) for x in (tmp_path / "a" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 2 * 3 and [r["log_index"] for r in rows] == list(range(12))
    rows_b = [json.loads(x) for x in (tmp_path / "b" / "samples.jsonl").read_text().splitlines()]
    assert [r["turns"] for r in rows_b] == [r["turns"] for r in rows]  # the same episodes, not just the same means
    assert [r["log_index"] for r in rows_b] == list(range(12, 24))  # appended to the same log
    mean = sum(r["score"] for r in rows if r["task"] == "calculator" and r["checkpoint"] == "base") / 3
    assert first["table"]["calculator"]["base"]["mean"] == pytest.approx(mean)
    db = ["--database-url", f"sqlite:///{tmp_path / 'log.sqlite3'}"]
    assert main(["verifier", "audit", *db]) == 0
    v = tmp_path / "b" / "verify"
    files = ["--envelope", "envelope", "--proof", "proof", "--checkpoint", "checkpoint", "--keys", "keys"]
    argv = ["verifier", "verify", *(str(v / f"{x}.json") if i % 2 else x for i, x in enumerate(files))]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "verified: entry 23" in out
    entry = json.loads((v / "envelope.json").read_text())
    assert entry  # the signed params name the task, checkpoint and sample
    import base64

    statement = json.loads(base64.b64decode(entry["envelope"]["payload"]))
    assert statement["predicate"]["params"]["eval"] == {
        "task": "arith-exact",
        "checkpoint": "v1",
        "weights_sha256": "",
        "sample": 2,
        "seed": 0,
    }


BAD_FILES = [
    ("tasks: [{name: x, generator: nope, grader: exact}]", "tasks.0.generator"),
    ("tasks: [{name: x, grader: exact}]", "exactly one of generator and dataset"),
    ("tasks: [{name: x, dataset: missing.jsonl, grader: exact}]", "tasks.0.dataset"),
    ("tasks: [{name: x, generator: 'a:b', grader: exact, samples: 0}]", "tasks.0.samples"),
    ("tasks: [{name: x, generator: 'a:b', grader: exact, answer_regex: 'no group'}]", "tasks.0.answer_regex"),
    ("tasks: [{name: x, generator: 'a:b', grader: exact, colour: red}]", "tasks.0.colour"),
    ("tasks: [{name: x, generator: 'a:b', grader: exact}, {name: x, generator: 'a:b', grader: exact}]", "tasks.1.name"),
    ("include: [bad.yaml]", "include: includes itself"),
    ("- just a list", "a task file is a mapping"),
    ("tasks: [", "not YAML"),
]


@pytest.mark.parametrize(("text", "field"), BAD_FILES)
def test_a_bad_task_file_names_the_field(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(InvalidArgument) as err:
        load_registry(path)
    assert field in err.value.message and "bad.yaml" in err.value.message


def test_bad_arguments_name_what_is_wrong(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shipped = load_registry()
    assert {"calculator", "arith-exact"} <= set(shipped)
    with pytest.raises(InvalidArgument, match="unknown 'nope'"):
        select(shipped, ["nope"])
    with pytest.raises(InvalidArgument, match="NAME=PATH"):
        Checkpoint.parse("no-equals-sign")
    argv = ["eval", "--task", "nope", "--out", str(tmp_path / "o"), "--database-url", f"sqlite:///{tmp_path / 'l'}"]
    assert main(argv) == 2
    assert "task: unknown 'nope'" in capsys.readouterr().err
    assert not (tmp_path / "l").exists()  # nothing opened, nothing written
