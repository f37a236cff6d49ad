"""Run registered eval tasks through a bridge against checkpoints; every sample's score is a signed verdict.

For each checkpoint (``NAME=PATH``: ``UpdateWeights(PATH)`` on the bridge; an empty path keeps the weights
the bridge serves) and each task: the task's first ``samples`` problems run as episodes through the bridge
(``rl_client``, the GRPO demo's sampler and calculator loop: a tool-call turn, the tool's answer, an answer
turn), sample ``i`` with sampling seed ``task.seed + i``. Each finished episode is graded by the task's
grader through the verifier (``verifier.Verifier``, in process): the verdict, signed and appended
to the verifier's log, *is* the score; its params name the task, checkpoint (and its weights' SHA-256) and
sample, so the log says which checkpoint earned which score.

Reproducible: the same tasks, checkpoints and seed against a fresh bridge on the same engine give the same
numbers (greedy by default; seeded sampling otherwise). Outputs under ``out``: ``samples.jsonl`` (one line
per sample, with its log index), ``summary.json`` (the table) and ``verify/`` (the last verdict's
receipt, inclusion proof, checkpoint and keys: ``primerl verifier verify`` checks it offline).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from core.errors import InvalidArgument, PrimeRLError
from core.toolcall import strip_end_markers
from evals import graders as _graders  # noqa: F401  (registers grpo-arithmetic)
from evals.registry import EvalTask
from rl_client import AsyncBridgeClient
from verifier.bridge import verifier_trajectory
from verifier.service import ScoreRequest, ScoreResult, Verifier


@dataclass(frozen=True, slots=True)
class Checkpoint:
    name: str
    path: str  # a weights directory the engine loads; "" = the bridge's current weights

    @classmethod
    def parse(cls, text: str) -> Checkpoint:
        name, sep, path = text.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z0-9][\w.-]*", name):
            raise InvalidArgument(f"checkpoint: {text!r} is not NAME=PATH (NAME: letters, digits, . _ -)")
        return cls(name, path)

    def digest(self) -> str:
        """SHA-256 of the weights files (sorted by name), '' for the bridge's current weights."""
        if not self.path:
            return ""
        root = Path(self.path)
        files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
        h = hashlib.sha256()
        for f in files:
            with f.open("rb") as fh:
                while chunk := fh.read(1 << 20):
                    h.update(chunk)
        return h.hexdigest() if files else ""


@dataclass(frozen=True, slots=True)
class SampleResult:
    task: str
    checkpoint: str
    index: int
    question: str
    reference: str
    turns: list[str]
    score: float
    log_index: int
    episode_id: str


def problems(task: EvalTask) -> list[tuple[str, str]]:
    """(question, reference) of the task's first ``samples`` problems."""
    if task.dataset is not None:
        rows = []
        for n, line in enumerate(Path(task.dataset).read_text().splitlines(), 1):
            if line.strip():
                try:
                    row = json.loads(line)
                    rows.append((str(row["question"]), str(row["reference"])))
                except (ValueError, KeyError, TypeError) as exc:
                    raise InvalidArgument(
                        f"{task.dataset}:{n}: not a {{question, reference}} JSON line ({exc})"
                    ) from None
        return rows[: task.samples]
    module, _, attr = str(task.generator).partition(":")
    try:
        generate = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise InvalidArgument(f"task {task.name}: generator {task.generator!r} does not load ({exc})") from None
    return [(str(p.question), str(p.answer)) for p in generate(task.samples, task.seed)]


def _params(task: EvalTask, turns: list[str], tools: list[Any], reference: str, meta: dict[str, Any]) -> dict[str, Any]:
    if task.grader == "grpo-arithmetic":
        results = [
            {"name": r.name, "content": r.content, "is_error": r.is_error, "error_kind": r.error_kind} for r in tools
        ]
        return {"turns": turns, "tool_results": results, "reference": reference, "eval": meta}
    answer = strip_end_markers(turns[-1]) if turns else ""
    if task.answer_regex is not None:
        found = re.search(task.answer_regex, answer)
        answer = found.group(1) if found else ""
    return {"answer": answer, "reference": reference, "eval": meta}


async def run_task(
    client: AsyncBridgeClient, verifier: Verifier, task: EvalTask, ckpt: Checkpoint, weights: str, concurrency: int
) -> list[SampleResult]:
    from grpo.sampler import GroupSampler, GroupSpec
    from grpo.tasks import TOOLS, ArithmeticEnv, Problem, arithmetic_rater

    rows = problems(task)
    s = task.sampling
    specs = [
        GroupSpec(
            prompt=Problem(q, "", 0).messages(),
            problem=Problem(q, "", ref),  # type: ignore[arg-type]  # the env only reads str(answer)
            group_size=1,
            sampling={"temperature": s.temperature, "max_tokens": s.max_tokens, "seed": task.seed + i},
            tools=TOOLS,
            turn_sampling=[None, {"max_tokens": s.answer_max_tokens}],
            max_turns=2,
        )
        for i, (q, ref) in enumerate(rows)
    ]
    sampler = GroupSampler(client, ArithmeticEnv, arithmetic_rater(), concurrency=concurrency)
    groups, _ = await sampler.collect(specs)
    requests = []
    for i, g in enumerate(groups):
        rollout, trajectory = g.rollouts[0], g.trajectories[0]
        meta = {"task": task.name, "checkpoint": ckpt.name, "weights_sha256": weights, "sample": i, "seed": task.seed}
        params = _params(task, rollout.turns, rollout.tool_results, rows[i][1], meta)
        body = {"grader": task.grader, "trajectory": verifier_trajectory(trajectory), "params": params}
        requests.append(ScoreRequest.model_validate(body))
    out = []
    for i, (req, result) in enumerate(zip(requests, await verifier.score_batch(requests), strict=True)):
        if isinstance(result, PrimeRLError):
            raise result
        assert isinstance(result, ScoreResult)
        turns = list(groups[i].rollouts[0].turns)
        eid = req.trajectory.episode_id
        out.append(
            SampleResult(
                task.name, ckpt.name, i, rows[i][0], rows[i][1], turns, result.reward, result.receipt.log_index, eid
            )
        )
    return out


def metrics(task: EvalTask, results: Sequence[SampleResult]) -> dict[str, float]:
    scores = [r.score for r in results]
    values = {"mean": sum(scores) / len(scores), "pass": sum(s >= 1.0 for s in scores) / len(scores)}
    return {m: round(values[m], 6) for m in task.metrics}


async def run_eval(
    client: AsyncBridgeClient,
    verifier: Verifier,
    tasks: Sequence[EvalTask],
    checkpoints: Sequence[Checkpoint],
    out: Path,
    concurrency: int = 4,
) -> dict[str, Any]:
    """Every task against every checkpoint; writes ``out`` and returns the summary (``table[task][ckpt]``)."""
    table: dict[str, dict[str, dict[str, float]]] = {t.name: {} for t in tasks}
    samples: list[SampleResult] = []
    for ckpt in checkpoints:
        if ckpt.path:
            await client.update_weights(ckpt.path)
        weights = await asyncio.to_thread(ckpt.digest)
        for task in tasks:
            results = await run_task(client, verifier, task, ckpt, weights, concurrency)
            samples += results
            table[task.name][ckpt.name] = metrics(task, results)
    summary = {
        "tasks": [t.name for t in tasks],
        "checkpoints": [asdict(c) for c in checkpoints],
        "table": table,
        "log": {"origin": verifier.log.origin, "entries": [samples[0].log_index, samples[-1].log_index]},
    }
    verify = await verify_material(verifier, samples[-1].log_index)
    await asyncio.to_thread(write_outputs, out, summary, samples, verify)
    return summary


async def verify_material(verifier: Verifier, index: int) -> dict[str, Any]:
    """What ``primerl verifier verify`` needs for entry ``index``: receipt, proof, checkpoint, keys."""
    log = verifier.log
    checkpoint = log.checkpoint()
    size = int(checkpoint["tree_size"])
    return {
        "envelope": await verifier.read(log.entry, index),
        "proof": {"index": index, "tree_size": size, "hashes": log.inclusion_proof(index, size)},
        "checkpoint": checkpoint,
        "keys": log.key_list(),
    }


def write_outputs(out: Path, summary: dict[str, Any], samples: list[SampleResult], verify: dict[str, Any]) -> None:
    (out / "verify").mkdir(parents=True, exist_ok=True)
    with (out / "samples.jsonl").open("w") as fh:
        for r in samples:
            fh.write(json.dumps(asdict(r)) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    for name, body in verify.items():
        (out / "verify" / f"{name}.json").write_text(json.dumps(body))


def format_table(summary: dict[str, Any]) -> str:
    """Rows task x metric, one column per checkpoint."""
    names = [c["name"] for c in summary["checkpoints"]]
    width = max(8, *(len(n) for n in names))
    lines = [f"{'task':<14} {'metric':<6} " + " ".join(f"{n:>{width}}" for n in names)]
    for task, by_ckpt in summary["table"].items():
        for metric in next(iter(by_ckpt.values())):
            cells = " ".join(f"{by_ckpt[n][metric]:>{width}.3f}" for n in names)
            lines.append(f"{task:<14} {metric:<6} {cells}")
    return "\n".join(lines)
