"""LoRA adapters: several per replica, each with its own policy version, each update a transaction with no pause.

An adapter update (UpdateWeights with ``adapter``) is prepare, load, verify, then commit or unload:

- prepare, before anything changes: the name, the version, the caller's proof and the adapter directory (the
  engine's own check: vLLM's a peft LoRA directory within the server's ``--max-lora-rank``);
- load the new version on every replica at once under its own name (``AdapterRef.served``, ``name@vN``), beside
  the version that serves: turns keep running on that one all along, so nothing pauses;
- verify: every replica scores the proof's probe with the new version, all at once (the caller's logprobs, else the
  first replica's are the reference: ``core.proof``);
- commit: new turns take the new version; the old one is unloaded once its last turn has ended. Any failure before
  (a replica that cannot load it or fails the proof, the caller gone) unloads the new version everywhere and fails
  naming the replica: the old version never stopped serving.

A turn takes its adapter's committed version when it opens (``acquire``) and holds it to its end (``release``):
every token it samples carries that version, committed when the token was sampled. The base model's weights are
``server.weights``' (LoRA RL trains the adapter on a frozen base: prime-rl's ``adapter_only``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from core.proof import WeightProof, default_probe, deviation
from core.types import AdapterRef, Capability, check_adapter_name
from engines.base import Engine
from engines.scoring import ScoreRequest
from server.errors import EngineUnavailable, FailedPrecondition, InvalidArgument, PrimeRLError, Unimplemented
from server.weights import MAX_POLICY_VERSION, Weights, _to_the_end, each

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Adapter:
    """The committed version of one adapter: where it was loaded from and what it proved."""

    ref: AdapterRef
    path: str
    proof: WeightProof | None
    replicas: tuple[int, ...] = ()  # those it was loaded and proven on (a replica that rejoins loads it too)


class Adapters:
    """The LoRA adapters a bridge's replicas serve, and the one path that changes them."""

    def __init__(
        self,
        engines: Sequence[Engine],
        weights: Weights,
        phase: Callable[[str, float], None],
        in_rotation: Callable[[int], bool] = lambda _replica: True,
    ) -> None:
        self.engines = engines
        self._weights = weights  # the base weights: removed and fenced replicas, and reads while they are stable
        self._in_rotation = in_rotation  # a replica out of rotation gets the adapters when it rejoins (``restore``)
        self._phase = phase  # the metrics: primerl_weight_update_seconds{phase="adapter_..."}
        self.live: dict[str, Adapter] = {}  # name -> its committed version
        self._users: Counter[AdapterRef] = Counter()  # turns running on each loaded version
        self._retired: set[AdapterRef] = set()  # superseded versions, unloaded when their last turn ends
        self._lock = asyncio.Lock()  # one adapter update at a time
        self._tasks: set[asyncio.Task[None]] = set()

    def versions(self) -> dict[str, int]:
        """Each adapter's committed version (``GetServerInfo``)."""
        return {name: a.ref.version for name, a in sorted(self.live.items())}

    def known(self, name: str) -> bool:
        return name in self.live

    def ref(self, name: str) -> AdapterRef:
        """The committed version of ``name``; InvalidArgument naming the loaded ones for any other name."""
        adapter = self.live.get(name)
        if adapter is None:
            loaded = sorted(self.live) or "none"
            raise InvalidArgument(
                f"unknown adapter {name!r} (loaded: {loaded}); load it first with UpdateWeights (POST /update_weights) "
                "naming it in adapter and its peft directory in checkpoint_path"
            )
        return adapter.ref

    def acquire(self, name: str) -> AdapterRef:
        """A turn opens on ``name``: its committed version, held until ``release``."""
        ref = self.ref(name)
        self._users[ref] += 1
        return ref

    def release(self, ref: AdapterRef) -> None:
        """A turn on ``ref`` ended; the last turn on a superseded version unloads it."""
        self._users[ref] -= 1
        if self._users[ref] <= 0:
            del self._users[ref]
            if ref in self._retired:
                self._unload_later(ref)

    def _retire(self, ref: AdapterRef) -> None:
        self._retired.add(ref)
        if not self._users[ref]:
            del self._users[ref]
            self._unload_later(ref)

    def _unload_later(self, ref: AdapterRef) -> None:
        self._retired.discard(ref)
        replicas = [i for i in range(len(self.engines)) if i not in self._weights.removed]
        task = asyncio.get_running_loop().create_task(self._unload(ref, replicas))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _replicas(self) -> list[int]:
        """The replicas an update loads on: those in rotation (one out gets the adapters at its rejoin)."""
        w = self._weights
        return [i for i in range(len(self.engines)) if i not in w.removed | w.tainted and self._in_rotation(i)]

    def check(self, name: str, policy_version: int, proof: WeightProof | None) -> int:
        """Before anything loads: the adapter's next version (``policy_version``, 0: current + 1), or InvalidArgument /
        Unimplemented naming what is wrong."""
        check_adapter_name(name)
        info = self.engines[0].info
        if name == info.model:
            raise InvalidArgument(f"adapter name {name!r} is the base model's: name the adapter something else")
        current = self.live[name].ref.version if name in self.live else 0
        version = policy_version or current + 1
        if version > MAX_POLICY_VERSION:
            raise InvalidArgument(f"policy_version must be at most {MAX_POLICY_VERSION} (int64), got {version}")
        if version <= current:
            raise InvalidArgument(
                f"policy_version {version} must be greater than adapter {name!r}'s current version {current}"
            )
        if proof is not None:
            proof.validate(info.vocab_size, info.max_model_len)
        if Capability.LORA not in info.capabilities:
            raise Unimplemented(f"engine {info.engine!r} cannot serve LoRA adapters (capability 'lora')")
        if proof is not None and Capability.SCORE not in info.capabilities:
            raise Unimplemented(f"engine {info.engine!r} cannot score a probe (capability 'score'): send no probe")
        return version

    async def update(
        self, name: str, path: str, policy_version: int, proof: WeightProof | None, in_fleet: bool = False
    ) -> int:
        """Load ``path`` as a new version of adapter ``name`` on every replica, prove it, commit (module docstring);
        returns the version."""
        if in_fleet:
            raise Unimplemented("adapter updates in a fleet are not supported yet: update each bridge on its own")
        version = self.check(name, policy_version, proof)
        began = time.perf_counter()
        for check in {type(e): getattr(e, "check_adapter", None) for e in self.engines}.values():
            if check is not None:
                await asyncio.to_thread(check, path)
        self._phase("adapter_prepare", time.perf_counter() - began)
        async with self._lock:
            version = self.check(name, policy_version, proof)  # another update may have landed meanwhile
            ref, loaded, replicas = AdapterRef(name, version), [], self._replicas()
            if not replicas:
                raise EngineUnavailable(f"no replica is in rotation to load adapter {name!r} on; retry when one is")
            try:
                async with self._weights.stable():  # never beside a base update's apply, verify or rollback
                    mark = time.perf_counter()
                    loaded.extend(replicas)  # (an unload covers every one, loaded or not)
                    for result in await each(replicas, lambda i: self._load(i, ref, path), PrimeRLError):
                        if isinstance(result, PrimeRLError):
                            raise result  # the first replica, in order, that could not load it
                    self._phase("adapter_load", time.perf_counter() - mark)
                    mark = time.perf_counter()
                    proven = await self._verify(ref, loaded, proof)
                    self._phase("adapter_verify", time.perf_counter() - mark)
            except BaseException:
                await _to_the_end(self._unload(ref, loaded))
                raise
            old = self.live.get(name)
            self.live[name] = Adapter(ref, path, proven, tuple(loaded))
            if old is not None:
                self._retire(old.ref)
        self._phase("adapter_total", time.perf_counter() - began)
        log.info("adapter %s: version %d committed on %d replicas (%s)", name, version, len(loaded), path)
        return version

    async def restore(self, replica: int) -> str:
        """Before a replica comes back into rotation (``Weights.rejoin``): load every committed adapter version on it
        again (one that restarted lost them; loading one it holds is harmless). Returns why it stays out, or ""."""
        async with self._lock:
            for name, adapter in list(self.live.items()):
                try:
                    await self.engines[replica].load_adapter(adapter.ref, adapter.path)  # type: ignore[attr-defined]
                except PrimeRLError as exc:
                    return f"could not load adapter {adapter.ref.served!r} again: {exc.message}"
                if replica not in adapter.replicas:
                    self.live[name] = replace(adapter, replicas=(*adapter.replicas, replica))
        return ""

    def serving(self, name: str) -> int:
        """Replicas in the fleet and trusted that serve adapter ``name``'s committed version (``replicas_updated``)."""
        adapter, out = self.live.get(name), self._weights.removed | self._weights.tainted
        return sum(1 for i in adapter.replicas if i not in out) if adapter is not None else 0

    async def _load(self, i: int, ref: AdapterRef, path: str) -> None:
        engine = self.engines[i]
        try:
            await engine.load_adapter(ref, path)  # type: ignore[attr-defined]
        except PrimeRLError as exc:
            serving = f"; version {self.live[ref.name].ref.version} keeps serving" if ref.name in self.live else ""
            raise type(exc)(
                f"replica {engine.info.replica!r} could not load version {ref.version} of adapter {ref.name!r}: "
                f"{exc.message}{serving}"
            ) from None

    async def _verify(self, ref: AdapterRef, loaded: list[int], proof: WeightProof | None) -> WeightProof | None:
        """Every replica scores the probe with ``ref``; FailedPrecondition names the first that strays from the proof
        (the caller's, else the first replica's) beyond its tolerance. Returns the proof the version committed with."""
        scorers = [i for i in loaded if Capability.SCORE in self.engines[i].info.capabilities]
        if not scorers:
            return None
        proof = proof or WeightProof()
        want = list(proof.logprobs) or None
        probe = proof.token_ids or default_probe(self.engines[0].info.vocab_size)
        request = ScoreRequest(probe, 1, adapter=ref)
        scores = await each(scorers, lambda i: self.engines[i].score(request), PrimeRLError)  # type: ignore[attr-defined]
        for i, score in zip(scorers, scores, strict=True):
            engine = self.engines[i]
            if isinstance(score, PrimeRLError):
                raise score
            got = score.logprobs.tolist()
            if want is None:
                want = got
                continue
            worst, at = deviation(got, want) if len(got) == len(want) else (float("inf"), 0)
            if worst > proof.tolerance:
                whose = "the caller's proof" if proof.logprobs else "the other replicas'"
                serving = f"version {self.live[ref.name].ref.version}" if ref.name in self.live else "nothing"
                raise FailedPrecondition(
                    f"replica {engine.info.replica!r} loaded version {ref.version} of adapter {ref.name!r} but it "
                    f"fails the proof: probe token {at + 1} is off {whose} by {worst:.4g} nats (probe_tolerance "
                    f"{proof.tolerance:g}); it was unloaded everywhere and {serving} keeps serving"
                )
        return WeightProof(probe, tuple(want or ()), proof.tolerance)

    async def _unload(self, ref: AdapterRef, replicas: list[int]) -> None:
        """Unload ``ref`` from ``replicas``; a replica that cannot (it died: it lost it anyway) is logged, not fatal."""
        for i in replicas:
            engine = self.engines[i]
            try:
                await engine.unload_adapter(ref)  # type: ignore[attr-defined]
            except PrimeRLError as exc:
                log.warning("replica %s: could not unload adapter %s: %s", engine.info.replica, ref.served, exc.message)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
