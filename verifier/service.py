"""The verifier core: grade a trajectory with a registered grader, sign the verdict, append it to the log.

One request (or batch item) is graded in a thread of ``grader_threads`` under ``grader_timeout_s`` (or
the item's smaller ``timeout_s``; trusted graders are synchronous functions), inline for the built-ins
marked ``inline`` (constant, exact: no thread hop), or, for an untrusted grader (``sandboxed.py``), in a
sandboxed process; a failing or late item fails alone. Graded verdicts go to one
named background task, the *appender*, which takes everything queued (up to ``max_batch`` verdicts),
signs and appends it in one transaction with one checkpoint on the log's single writer thread, and
fans the receipts back to the waiting requests: group commit, so concurrent callers share a checkpoint.

The reward is a function of (grader id and version, trajectory, params) alone: graders are
deterministic by contract (``envhub.graders``). What varies between two scorings of the same input is
``predicate.timings`` and the log index.

A trusted grader past its deadline cannot be killed (it is a thread): its item fails with
DEADLINE_EXCEEDED, the thread finishes in the background and holds a pool slot until then. A sandboxed
grader past its deadline is killed (its process group), so untrusted code never outlives its item.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError, field_validator

from core.canonical import canonical_json
from core.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, PrimeRLError
from envhub.graders import get_grader, grader_names, grader_policy_digest, register_grader
from rl_client.types import Trajectory as BridgeTrajectory
from verifier.bridge import BridgeSource, no_bridge
from verifier.config import VerifierConfig
from verifier.keys import KeyRing
from verifier.log import Receipt, TransparencyLog
from verifier.sandboxed import SandboxedGrader
from verifier.statement import Trajectory, Verdict, VerdictSample
from verifier.store import LogStore

ENTRY_POINT_GROUP = "primerl.graders"


class GraderFailed(FailedPrecondition):
    """The grader raised or returned something that is not a finite number (HTTP 422: the verdict cannot be made)."""

    http_status = 422


class LogUnavailable(PrimeRLError):
    """The log's database refused the append (nothing of the batch was written)."""

    code = "UNAVAILABLE"


class ScoreRequest(BaseModel):
    """``POST /v1/score``: one trajectory, the grader to run on it, and the grader's params."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    grader: str = Field(min_length=1, max_length=200, description="A registered grader id.")
    trajectory: Trajectory
    params: dict[str, JsonValue] = Field(default_factory=dict, description="Grader inputs (signed with the verdict).")
    timeout_s: float | None = Field(
        None, gt=0, le=3600, description="This item's grader deadline (capped by the service's grader_timeout_s)."
    )

    @field_validator("params")
    @classmethod
    def _finite(cls, v: dict[str, JsonValue]) -> dict[str, JsonValue]:
        try:
            canonical_json(v)
        except ValueError as exc:
            raise ValueError(f"params must be plain JSON without NaN or Infinity ({exc})") from exc
        return v


class BatchRequest(BaseModel):
    """``POST /v1/score/batch``: items scored independently (each with its own deadline and outcome)."""

    model_config = ConfigDict(extra="forbid")

    items: list[ScoreRequest] = Field(min_length=1)


@dataclass(frozen=True, slots=True)
class ScoreResult:
    reward: float
    receipt: Receipt

    def to_json(self) -> dict[str, Any]:
        return {"reward": self.reward, "receipt": self.receipt.to_json()}


def validation_fields(exc: ValidationError) -> tuple[str, list[dict[str, str]]]:
    """A validation error as one message naming each bad field (``trajectory.logprobs: ...``) and the fields."""
    fields = [{"field": ".".join(map(str, e["loc"])) or "body", "message": e["msg"]} for e in exc.errors()]
    return "; ".join(f"{f['field']}: {f['message']}" for f in fields), fields


def sandbox_sample(trajectory: Trajectory, params: Mapping[str, Any]) -> dict[str, Any]:
    """What a sandboxed grader's function receives: the trajectory JSON (NaN logprob -> null) and the params."""
    t = trajectory.model_dump(mode="json")
    t["logprobs"] = [None if x is None or math.isnan(x) else x for x in trajectory.logprobs]
    return {"trajectory": t, "params": dict(params)}


def load_entry_point_graders(group: str = ENTRY_POINT_GROUP) -> list[str]:
    """Register the graders that installed packages declare under the ``primerl.graders`` entry point group."""
    added = []
    for ep in entry_points(group=group):
        grader = ep.load()
        if not hasattr(grader, "name"):  # a plain function: untrusted, runs in the sandbox (sandboxed.py)
            grader = SandboxedGrader.from_function(ep.name, grader)
        if grader.name not in grader_names():
            register_grader(grader)
            added.append(grader.name)
    return added


class Verifier:
    """Grades, signs and appends; ``open`` / ``close`` own the log, its threads and the appender task."""

    def __init__(self, config: VerifierConfig, log: TransparencyLog, writer: ThreadPoolExecutor) -> None:
        self.config = config
        self.log = log
        self._writer = writer  # the log's one writer thread (also its database reads)
        self._graders = ThreadPoolExecutor(config.grader_threads, thread_name_prefix="verifier-grader")
        self._queue: asyncio.Queue[tuple[list[dict[str, Any]], asyncio.Future[list[Receipt]]]] = asyncio.Queue()
        self._appender = asyncio.create_task(self._append_loop(), name="verifier-appender")
        self.bridge = BridgeSource(config.bridge) if config.bridge else None
        self._digests: dict[str, str] = {}

    @classmethod
    async def open(cls, config: VerifierConfig) -> Verifier:
        load_entry_point_graders()
        writer = ThreadPoolExecutor(1, thread_name_prefix="verifier-log")
        loop = asyncio.get_running_loop()

        def _open() -> TransparencyLog:
            return TransparencyLog(LogStore(config.database_url), KeyRing.open(config.key_dir), config.origin)

        try:
            log = await loop.run_in_executor(writer, _open)
        except BaseException:
            writer.shutdown(wait=False)
            raise
        return cls(config, log, writer)

    async def close(self) -> None:
        if self.bridge is not None:
            await self.bridge.close()
        self._appender.cancel()
        await asyncio.gather(self._appender, return_exceptions=True)
        await asyncio.get_running_loop().run_in_executor(self._writer, self.log.store.close)
        self._writer.shutdown(wait=True)
        self._graders.shutdown(wait=False, cancel_futures=True)

    def _policy_digest(self, name: str, grader: Any) -> str:
        """The grader's policy digest, computed once per grader id (a registered id never changes grader)."""
        digest = self._digests.get(name)
        if digest is None:
            digest = self._digests[name] = grader_policy_digest(grader)
        return digest

    async def end_episode(self, episode_id: str) -> BridgeTrajectory:
        """End ``episode_id`` on the ``--bridge`` and return its trajectory (``verifier.bridge``)."""
        if self.bridge is None:
            raise no_bridge()
        return await self.bridge.end_episode(episode_id)

    async def read(self, fn: Any, *args: Any) -> Any:
        """Run a log read that touches the database on the writer thread."""
        return await asyncio.get_running_loop().run_in_executor(self._writer, fn, *args)

    async def grade(self, req: ScoreRequest) -> Verdict:
        grader = get_grader(req.grader)
        n = len(req.trajectory.token_ids)
        if n > self.config.max_tokens:
            raise InvalidArgument(f"trajectory.token_ids: {n} tokens, more than max_tokens={self.config.max_tokens}")
        sample = VerdictSample(req.trajectory, req.params)
        started = dt.datetime.now(dt.UTC).isoformat(timespec="microseconds")
        t0 = time.perf_counter()
        timeout, bound = self.config.grader_timeout_s, "grader_timeout_s"
        if req.timeout_s is not None and req.timeout_s < timeout:
            timeout, bound = req.timeout_s, "timeout_s"
        try:
            if getattr(grader, "inline", False):  # a built-in of tiny, bounded cost: no thread hop
                value = grader(sample)
            elif isinstance(grader, SandboxedGrader):  # a process: cancelled on the deadline, its group killed
                value = await asyncio.wait_for(grader.grade(sandbox_sample(req.trajectory, req.params)), timeout)
            else:
                work = asyncio.get_running_loop().run_in_executor(self._graders, grader, sample)
                value = await asyncio.wait_for(work, timeout)
        except TimeoutError:
            raise DeadlineExceeded(f"grader {req.grader!r} took longer than {bound}={timeout:g}") from None
        except PrimeRLError:
            raise
        except Exception as exc:  # user grader code: its failure is this item's outcome, not the service's
            raise GraderFailed(f"grader {req.grader!r} failed: {type(exc).__name__}: {exc}") from exc
        try:
            reward = float(value)
        except (TypeError, ValueError):
            raise GraderFailed(f"grader {req.grader!r} returned {type(value).__name__}, not a number") from None
        if not math.isfinite(reward):
            raise GraderFailed(f"grader {req.grader!r} returned {reward}, not a finite reward")
        return Verdict(
            subject_digest=req.trajectory.digest(),
            episode_id=req.trajectory.episode_id,
            grader=req.grader,
            grader_version=str(getattr(grader, "version", "1")),
            reward=reward,
            params=req.params,
            policy_version=req.trajectory.policy_version,
            started_at=started,
            grade_seconds=round(time.perf_counter() - t0, 6),
            sandbox_policy_digest=self._policy_digest(req.grader, grader),
        )

    async def score_batch(self, reqs: Sequence[ScoreRequest]) -> list[ScoreResult | PrimeRLError]:
        """Each item's result or its error, in order; the graded ones are signed and appended together."""
        outcomes = await asyncio.gather(*(self.grade(r) for r in reqs), return_exceptions=True)
        for o in outcomes:
            if isinstance(o, BaseException) and not isinstance(o, PrimeRLError):
                raise o
        verdicts = [o for o in outcomes if isinstance(o, Verdict)]
        receipts = iter(await self._append([v.statement() for v in verdicts]) if verdicts else [])
        return [ScoreResult(o.reward, next(receipts)) if isinstance(o, Verdict) else o for o in outcomes]  # type: ignore[misc]

    async def score(self, req: ScoreRequest) -> ScoreResult:
        (result,) = await self.score_batch([req])
        if isinstance(result, PrimeRLError):
            raise result
        return result

    async def _append(self, statements: list[dict[str, Any]]) -> list[Receipt]:
        future: asyncio.Future[list[Receipt]] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((statements, future))
        return await future

    async def _append_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            count = len(batch[0][0])
            while count < self.config.max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
                count += len(batch[-1][0])
            statements = [s for group, _ in batch for s in group]
            try:
                receipts = await loop.run_in_executor(self._writer, self.log.append, statements)
            except Exception as exc:  # noqa: BLE001 - rolled back: every caller of this batch gets the error
                error = LogUnavailable(f"the log did not append the batch (nothing was written): {exc}")
                for _, future in batch:
                    if not future.done():
                        future.set_exception(error)
                continue
            start = 0
            for group, future in batch:
                if not future.done():  # a caller that went away: its verdict is logged all the same
                    future.set_result(receipts[start : start + len(group)])
                start += len(group)


def summary(results: Sequence[ScoreResult | PrimeRLError]) -> list[Mapping[str, Any]]:
    """Batch results on the wire: ``{"reward", "receipt"}`` or ``{"error": {"code", "message"}}``."""
    return [
        r.to_json() if isinstance(r, ScoreResult) else {"error": {"code": r.code, "message": r.message}}
        for r in results
    ]
