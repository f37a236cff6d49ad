"""Weight updates and the policy version of one bridge's replicas.

An update is prepare, apply, verify, then commit or roll back:

- prepare, before anything pauses: the version, the caller's proof, and the checkpoint (``prepare``: the engine's
  own check, files complete, the served model's tensors, shapes and dtypes, a content digest, where the engine
  loads it from a filesystem the bridge shares);
- apply and verify with no turn running (``exclusive`` outside a fleet, the fleet's barrier in one): every replica
  loads at once, then every one that can score proves what it serves (``core.proof``), all at once too (``each``:
  the pause is the slowest replica's, not the sum); the version commits only when all did;
- any failure before the commit (a failed proof, a refusal, the caller gone) sends every replica the update
  reached back to its previous checkpoint and version; a replica that cannot go back, or that failed to load or to
  answer, is fenced (``tainted``: out of rotation, left out of ``version``) and the others go on;
- a replica comes back into rotation only on the committed weights (``rejoin``, at the health check).

Versions only move forward: one update at a time, each strictly greater than the current version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from core.proof import WeightProof, default_probe, deviation
from core.types import Capability, WeightUpdate
from engines.base import Engine
from engines.checkpoint import Manifest, check_compatible, read_manifest
from engines.scoring import ScoreRequest
from server.errors import (
    EngineError,
    FailedPrecondition,
    InvalidArgument,
    PrimeRLError,
    Unimplemented,
)

log = logging.getLogger(__name__)

MAX_POLICY_VERSION = 2**63 - 1
T = TypeVar("T")
E = TypeVar("E", bound=PrimeRLError)


class Weights:
    """The policy version of a set of replicas, and the one path that changes it."""

    def __init__(
        self,
        engines: Sequence[Engine],
        mark: Callable[[int, bool, str], None],
        updated: Callable[[int, int, float, float], None] | None = None,
        phase: Callable[[str, float], None] | None = None,
    ) -> None:
        self.engines = engines
        self._mark = mark  # take a replica out of rotation (the router)
        # Told of each update that reached a replica: (previous version, new version, unix start, seconds taken).
        self._updated = updated
        self.removed: set[int] = set()  # replicas removed from the fleet (server.replicas): never updated
        self.tainted: set[int] = set()  # replicas fenced by an update: rejoin reloads and proves them first
        self.gate = asyncio.Lock()  # one update at a time, from before its pause (Bridge.update_weights)
        self._steady = asyncio.Event()  # clear while an update applies and verifies: reads of the weights wait
        self._steady.set()
        self._reading = 0  # reads in progress (``stable``): an update waits for them before it loads
        self._no_reads = asyncio.Event()
        self._no_reads.set()
        self._lock = asyncio.Lock()
        self._served: dict[str, Manifest | None] = {}  # base checkpoint -> its manifest (None: not readable here)
        self._paths: dict[int, str] = {}  # replica -> the checkpoint it serves, once updated (its rollback target)
        self._phase = phase or (lambda _name, _seconds: None)  # told each phase's duration (the metrics)
        # The committed weights' proof (the probe and the logprobs every replica matched): a replica coming back into
        # rotation must match it too (``rejoin``). None before the first proven update: replicas serve what they
        # started from.
        self.proven: WeightProof | None = None
        self._proven: WeightProof | None = None  # the update in progress's, until it commits

    @property
    def steady(self) -> bool:
        """No update is applying, verifying or rolling back (the pause)."""
        return self._steady.is_set()

    @property
    def version(self) -> int:
        """The newest version a trusted replica serves (a fenced one, ``tainted``, is out of rotation and may carry
        the label of an update that never committed)."""
        if not self.tainted:
            if len(self.engines) == 1:  # the common case, on every Step: no generator
                return self.engines[0].policy_version
            return max(e.policy_version for e in self.engines)
        trusted = [e.policy_version for i, e in enumerate(self.engines) if i not in self.tainted]
        return max(trusted or [e.policy_version for e in self.engines])

    def serving(self, version: int) -> int:
        """Replicas in the fleet and trusted that serve ``version`` (UpdateWeights' ``replicas_updated``)."""
        out = self.removed | self.tainted
        return sum(1 for i, e in enumerate(self.engines) if i not in out and e.policy_version == version)

    def _check(self, version: int) -> None:
        current = self.version
        if version > MAX_POLICY_VERSION:
            raise InvalidArgument(f"policy_version must be at most {MAX_POLICY_VERSION} (int64), got {version}")
        if version <= current:
            raise InvalidArgument(f"policy_version {version} must be greater than the current version {current}")

    async def prepare(self, checkpoint_path: str) -> Manifest | None:
        """The prepare phase, before anything pauses: read the checkpoint's manifest and digest and check it against
        the served model's (InvalidArgument names the file or tensor at fault; None where the engine loads
        checkpoints from a filesystem the bridge cannot check: ``Capability.LOCAL_CHECKPOINTS``), then have every
        replica that can stage it beside the served weights (``stage``)."""
        info = self.engines[0].info
        if not info.supports_weight_updates:
            raise Unimplemented(f"engine {info.engine!r} cannot load new weights at run time")
        manifest = None
        if Capability.LOCAL_CHECKPOINTS in info.capabilities:
            began = time.perf_counter()
            manifest = await asyncio.to_thread(self._prepare, checkpoint_path, info.base_weights)
            log.info(
                "checkpoint %s checked in %.2f s: %d tensors, %.1f MB, %s",
                manifest.path, time.perf_counter() - began, len(manifest.tensors), manifest.nbytes / 1e6,
                manifest.digest,
            )  # fmt: skip
        await self.stage(checkpoint_path)
        return manifest

    async def stage(self, path: str) -> None:
        """Every replica whose engine can (``stage_weights``: vLLM with PrimeRL's worker extension) loads ``path``
        beside the weights it serves, while it serves them: the pause then only swaps them in. A replica that does
        not stage reloads in place under the pause; staging never fails an update."""
        stagers = [
            (i, stage) for i, e in enumerate(self.engines)
            if i not in self.removed and (stage := getattr(e, "stage_weights", None)) is not None
        ]  # fmt: skip
        if not stagers:
            return
        began = time.perf_counter()
        results = await asyncio.gather(*(stage(path) for _, stage in stagers), return_exceptions=True)
        for (i, _), result in zip(stagers, results, strict=True):
            if isinstance(result, Exception):  # a bug, not a refusal (those are logged and answered None)
                log.warning("replica %s did not stage %s: %r", self.engines[i].info.replica, path, result)
        self._phase("stage", time.perf_counter() - began)

    def _prepare(self, path: str, base: str) -> Manifest:
        for check in {type(e): getattr(e, "check_checkpoint", None) for e in self.engines}.values():
            if check is not None:  # what the engine's reload itself needs (vLLM: config.json)
                check(path)
        new = read_manifest(path, digest=True)
        if base not in self._served:
            self._served[base] = self._served_manifest(base)
        served = self._served[base]
        if served is not None:
            check_compatible(new, served)
        return new

    @staticmethod
    def _served_manifest(base: str) -> Manifest | None:
        try:
            if base and Path(base).is_dir():
                return read_manifest(base)
            reason = "not a directory here"
        except InvalidArgument as exc:
            reason = exc.message
        except OSError as exc:  # e.g. a parent directory the bridge may not search
            reason = str(exc)
        log.warning("served checkpoint %r unreadable (%s): updates are checked for completeness only", base, reason)
        return None

    async def update(
        self, checkpoint_path: str, policy_version: int, keep_kv: bool, proof: WeightProof | None = None
    ) -> int:
        """Load a checkpoint on every replica, prove it, commit; returns the new version (``policy_version`` or
        current + 1)."""
        return await self._apply([checkpoint_path] * len(self.engines), policy_version, keep_kv, proof)

    async def reload(self, policy_version: int = 0) -> int:
        """Take every replica back to the weights it started from, as a new version (the KV of the trained
        weights is not reused: a new version salts the prefix cache anew)."""
        self.check(policy_version, reload=True)
        return await self._apply([e.info.base_weights for e in self.engines], policy_version, False, None)

    @contextlib.asynccontextmanager
    async def stable(self) -> AsyncIterator[None]:
        """Around a read of the served weights outside a turn (ScoreTokens): never while an update applies, verifies
        or rolls back, so what is read carries a committed version; an update waits for the reads in progress."""
        await self._steady.wait()
        self._reading += 1
        self._no_reads.clear()
        try:
            yield
        finally:
            self._reading -= 1
            if not self._reading:
                self._no_reads.set()

    def serves(self, replica: int) -> str:
        """The checkpoint a replica serves ("" where unknown): the one it started from until an update."""
        return self._paths.get(replica, self.engines[replica].info.base_weights)

    def adopted(self, replica: int, path: str) -> None:
        """A fleet update moved a replica to ``path`` (``server.fleet.member``). The bridge that ran it holds the
        proof; this one has none for the new version, so its returning replicas are not checked against an old one."""
        if path:
            self._paths[replica] = path
        self.proven = None

    async def rejoin(self, replica: int) -> str:
        """Before a replica that was out of rotation, or is behind the committed version, serves again: it must serve
        the committed weights. One behind (it missed an update, or restarted and says so) is reloaded with the
        committed checkpoint; one that can score must then match the committed proof's probe, and one that does not
        (e.g. a vLLM replica restarted on its start-up weights: it cannot tell) is reloaded and checked once more.
        Returns "" when it is fit to serve, else why it stays out."""
        engine = self.engines[replica]
        async with self._lock:  # not while an update changes the weights
            version = self.version
            proof = self.proven if Capability.SCORE in engine.info.capabilities else None
            why = f"serves policy version {engine.policy_version}, not {version}"
            if replica in self.tainted:  # an update fenced it: its label says nothing about its weights
                why = "was fenced by a weight update"
            elif engine.policy_version >= version:
                if proof is None:
                    return ""
                why = await self._prove(engine, proof)
                if not why:
                    return ""
            path = self.serves(replica)
            if not path:
                return f"{why}; the bridge does not know its weights' checkpoint: run UpdateWeights"
            log.warning("replica %s: %s; reloading %s as version %d", engine.info.replica, why, path, version)
            try:
                await engine.update_weights(WeightUpdate(path, version))
            except PrimeRLError as exc:
                return f"{why}; reloading {path} failed: {exc.message}"
            if proof is not None and (failed := await self._prove(engine, proof)):
                return f"fails the proof of version {version} even after reloading {path}: {failed}"
            if engine.policy_version < version:  # an engine that reports its version still says another one
                return f"serves policy version {engine.policy_version} after reloading {path}, not {version}"
            self.tainted.discard(replica)
            log.info("replica %s serves the weights of version %d again", engine.info.replica, version)
            return ""

    @staticmethod
    async def _prove(engine: Engine, proof: WeightProof) -> str:
        try:
            got = (await engine.score(ScoreRequest(proof.token_ids, 1))).logprobs.tolist()  # type: ignore[attr-defined]
        except PrimeRLError as exc:
            return f"could not score the probe: {exc.message}"
        if len(got) != len(proof.logprobs):
            return f"scored {len(got)} probe tokens, not {len(proof.logprobs)}"
        worst, at = deviation(got, proof.logprobs)
        return "" if worst <= proof.tolerance else f"probe token {at + 1} is off by {worst:.4g} nats"

    def check(self, policy_version: int, proof: WeightProof | None = None, reload: bool = False) -> None:
        """Before anything pauses: ``policy_version`` (0: current + 1) may come next, the replicas can load the start-up
        weights (``reload``), and a proof is one they can check (InvalidArgument / Unimplemented otherwise)."""
        self._check(policy_version or self.version + 1)
        missing = [e.info.replica for e in self.engines if not e.info.base_weights]
        if reload and missing:
            raise Unimplemented(
                f"engine {self.engines[0].info.engine!r} replicas {missing} do not know the weights they started "
                "from; load them with UpdateWeights (POST /update_weights) and their checkpoint directory"
            )
        if proof is None:
            return
        info = self.engines[0].info
        proof.validate(info.vocab_size, info.max_model_len)
        unable = [e.info.replica for e in self.engines if Capability.SCORE not in e.info.capabilities]
        if unable:
            raise Unimplemented(
                f"replicas {unable} ({info.engine}) cannot score a probe (capability 'score'), so they cannot prove "
                "the weights they load; send no probe"
            )

    async def _apply(self, paths: list[str], policy_version: int, keep_kv: bool, proof: WeightProof | None) -> int:
        version = policy_version or self.version + 1
        self._check(version)
        info = self.engines[0].info
        if not info.supports_weight_updates:
            raise Unimplemented(f"engine {info.engine!r} cannot load new weights at run time")
        async with self._lock:
            self._check(version)  # another update may have landed while this one waited
            previous, began, clock = self.version, time.time(), time.perf_counter()
            before = [(e.policy_version, self.serves(i)) for i, e in enumerate(self.engines)]
            attempted: list[int] = []
            self._steady.clear()
            try:  # the pause proper: no replica generates from here to commit or rollback
                await self._no_reads.wait()  # a ScoreTokens in progress ends on the weights it began on
                done, failed = await self._load(paths, version, keep_kv, attempted)
                self._phase("apply", time.perf_counter() - clock)
                if not done:
                    raise failed[0][1]
                mark = time.perf_counter()
                wrong = await self._verify(done, failed, proof, version)
                self._phase("verify", time.perf_counter() - mark)
                if wrong:
                    raise FailedPrecondition(wrong)
            except BaseException as exc:  # a failure, a refusal, the caller gone: every replica back, then raise
                self._proven = None
                stuck = await _to_the_end(self._roll_back(attempted, before, version))
                if isinstance(exc, FailedPrecondition):
                    back = f"except {stuck} (out of rotation until they reload them)" if stuck else ""
                    raise FailedPrecondition(
                        f"{exc.message}; every replica is back on its previous weights and version {back}".rstrip()
                    ) from None
                raise
            finally:
                self._steady.set()  # (no await from here to the commit below)
                self._phase("pause", time.perf_counter() - clock)
            for i in range(len(self.engines)):  # a replica out (fenced, removed) gets them when it rejoins
                self._paths[i] = paths[i]
            self.tainted -= set(done)
            self.proven, self._proven = self._proven, None
            if self._updated is not None:
                self._updated(previous, version, began, time.perf_counter() - clock)
            if failed:
                names = ", ".join(f"{name!r} ({exc.message})" for name, exc in failed)
                raise EngineError(
                    f"weights updated to version {version} on {[self.engines[i].info.replica for i in done]} but "
                    f"failed on {names}; out of rotation until they load them (at a health check that passes)"
                )
        return version

    def _fence(self, replica: int, why: str) -> None:
        """Out of rotation, its weights and version not trusted (left out of ``version``) until it rejoins."""
        self.tainted.add(replica)
        self._mark(replica, False, why)

    async def _load(
        self, paths: list[str], version: int, keep_kv: bool, attempted: list[int]
    ) -> tuple[list[int], list[tuple[str, EngineError]]]:
        """Apply: every replica loads at once (``each``; ``attempted`` lists them before: a rollback covers them).
        A replica that fails (dead, unreachable) is fenced and the others go on; any other error is raised."""
        replicas = [i for i in range(len(self.engines)) if i not in self.removed]
        attempted.extend(replicas)

        def load(i: int) -> Awaitable[None]:
            update = WeightUpdate(checkpoint_path=paths[i], policy_version=version, keep_kv=keep_kv)
            return self.engines[i].update_weights(update)

        results = await each(replicas, load, EngineError)
        done: list[int] = []
        failed: list[tuple[str, EngineError]] = []
        for i, result in zip(replicas, results, strict=True):
            if isinstance(result, EngineError):
                # The others go on: one dead replica must not hold every replica at the old version.
                self._fence(i, f"weight update to version {version} failed: {result.message}")
                failed.append((self.engines[i].info.replica, result))
            else:
                done.append(i)
        return done, failed

    async def _verify(
        self, done: list[int], failed: list[tuple[str, EngineError]], proof: WeightProof | None, version: int
    ) -> str:
        """Verify: every replica that loaded scores the probe; returns why the first whose logprobs stray from the
        proof's (the caller's, else the first replica's) beyond the tolerance fails ("" when none does). A replica
        that cannot answer is fenced like one that failed to load (taken out of ``done``)."""
        scorers = [i for i in done if Capability.SCORE in self.engines[i].info.capabilities]
        if not scorers:  # nothing can prove it (and check refused a caller's proof)
            return ""
        proof = proof or WeightProof()
        want = list(proof.logprobs) or None
        probe = proof.token_ids or default_probe(self.engines[0].info.vocab_size)
        request = ScoreRequest(probe, 1)
        scores = await each(scorers, lambda i: self.engines[i].score(request), EngineError)  # type: ignore[attr-defined]
        for i, score in zip(scorers, scores, strict=True):
            engine = self.engines[i]
            if isinstance(score, EngineError):
                self._fence(i, f"could not prove the weights of version {version}: {score.message}")
                failed.append((engine.info.replica, score))
                done.remove(i)
                continue
            got = score.logprobs.tolist()
            if want is None:
                want = got
                continue
            if len(got) != len(want):
                return f"replica {engine.info.replica!r} scored {len(got)} probe tokens, not {len(want)}"
            worst, at = deviation(got, want)
            if worst > proof.tolerance:
                whose = "the caller's proof" if proof.logprobs else "the other replicas'"
                return (
                    f"replica {engine.info.replica!r} loaded the weights of version {version} but they fail the "
                    f"proof: probe token {at + 1} has logprob {got[at]:.4f} there and {want[at]:.4f} in {whose} "
                    f"(|difference| {worst:.4g} > probe_tolerance {proof.tolerance:g})"
                )
        if want is not None:
            self._proven = WeightProof(probe, tuple(want), proof.tolerance)
        return ""

    async def _roll_back(self, attempted: list[int], before: list[tuple[int, str]], version: int) -> list[str]:
        """Send every replica an update reached back to the weights it served before, under its old version; one
        that cannot go back (it died, or its previous weights are unknown) is fenced. Returns those."""
        began, stuck = time.perf_counter(), []
        for i in attempted:
            engine, (old, path) = self.engines[i], before[i]
            why = "its previous weights are unknown (the engine did not say what it started from)"
            if path:
                try:
                    await engine.update_weights(WeightUpdate(checkpoint_path=path, policy_version=old, restore=True))
                    continue
                except PrimeRLError as exc:
                    why = exc.message
            self._fence(i, f"could not roll back from version {version} to {old}: {why}")
            log.error("replica %s could not roll back from version %d: %s", engine.info.replica, version, why)
            stuck.append(engine.info.replica)
        self._phase("rollback", time.perf_counter() - began)
        return stuck


async def each(replicas: Sequence[int], call: Callable[[int], Awaitable[T]], keep: type[E]) -> list[T | E]:
    """``call(i)`` for every replica at once (each is a server of its own: an update's pause lasts as long as the
    slowest replica, not the sum of all); each one's result or the ``keep`` error it raised, in ``replicas``' order.
    Any other exception is raised, the first in that order, once every call has ended; a cancelled caller cancels
    them all and waits for them: no call outlives this (a rollback that follows never races one)."""

    async def one(i: int) -> T | E:
        try:
            return await call(i)
        except keep as exc:
            return exc

    tasks = [asyncio.ensure_future(one(i)) for i in replicas]
    if not tasks:
        return []
    try:
        await asyncio.wait(tasks)
    except asyncio.CancelledError:
        for task in tasks:
            task.cancel()
        await _to_the_end(asyncio.wait(tasks))
        raise
    for task in tasks:
        exc = task.exception()
        if exc is not None:
            raise exc
    return [task.result() for task in tasks]


async def _to_the_end(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to its end even when the caller is cancelled meanwhile (a rollback must not stop half-way);
    the cancellation is raised after it."""
    task = asyncio.ensure_future(coro)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return task.result()
