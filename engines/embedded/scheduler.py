"""The embedded engine's scheduler: it owns the sequences, the decode batch, parked KV and the speculative step.

``EmbeddedEngine`` (``engines.embedded.engine``) checks a request, builds its ``Seq`` and reads its queue; from
``submit`` on, a sequence belongs to the scheduler. ``run`` is the engine's one background task: it admits
waiting sequences, runs each step on the engine's worker thread and puts the step's chunks into the requests'
queues. Every torch call and every KV change happens on that worker thread, between two steps or inside one.

Invariants
----------
* Exact logprobs: a sampled token's logprob is that of the distribution it was drawn from (after temperature,
  top-k, top-p; ``engines.sampling`` on float64 logits); greedy reports the raw distribution's.
* Stateful decode: an episode's KV cache is kept between turns, keyed by episode id and tagged with the
  request's ``cache_salt`` (model and policy version). A turn feeds only the tokens its KV does not cover.
  The last token sampled in a turn enters the KV at the start of the next one; that forward is the decode
  work of a sampled token and is counted as ``deferred_decode_tokens``, never as prefill.
* Idle KV (episodes between turns, GRPO prompts) lives in an LRU store bounded by ``kv_budget_bytes``.
  An evicted episode is recomputed from its token ids on its next turn: same ids, same tokens.
* GRPO groups: the first member of a group to start keeps its prompt's KV and next-token logits; the other
  members fork a copy and prefill nothing.
* Policy versions: KV is reused only under the same ``cache_salt``. ``swap_weights`` drops every KV computed
  under the old weights (idle and in flight; in-flight sequences are re-prefilled) unless ``keep_kv``.
  Each token carries the version of the weights that produced its logits.
* Batching: sequences that need one decode token share a forward pass (left-padded KV, per-row positions);
  sequences join and leave at token boundaries. The batched KV is rebuilt only when membership changes. The
  forward passes themselves live in ``engines.embedded.passes``.
* Deterministic mode (``batch_invariant``): every sequence runs its own fixed-shape forward
  (``engines.embedded.invariant``), draws at the wire's float32 temperature, and records a sampled token's logprob
  with the trainer's own function of the logit row: bit for bit what ``grpo``'s ``batch_invariant`` forward
  recomputes from the same weights.
* Speculation (``GenerateRequest.drafter``): a sequence whose drafter proposes a draft leaves the batch for that
  step and is fed [pending token + draft] in ONE forward of its own; ``engines.sampling.verify`` accepts or
  resamples exactly, so the output is distributed as without speculation (greedy: identical up to float
  rounding of a multi-token forward). The KV is then cropped to the accepted prefix; the last emitted token
  stays pending as in plain decode. Steps with an empty draft take the plain (batched) path.
* One finish path (``_emit``): a sequence that stops, reaches its budget or is aborted is marked finished, its
  KV parked for the episode's next turn (dropped when aborted) and its last chunk carries the turn's usage.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import threading
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

import numpy as np

from core.errors import EngineError, EngineUnavailable
from core.types import (
    EngineCounters,
    FinishReason,
    Origin,
    SamplingParams,
    TokenChunk,
    Usage,
    WeightUpdate,
    check_token_ids,
)
from engines.config import EmbeddedConfig
from engines.embedded.invariant import token_logprobs, wire_temperature
from engines.embedded.kvcache import KVStore, Parked, cache_nbytes, common_prefix, fork
from engines.embedded.lora import LoraBank
from engines.embedded.model import Seq
from engines.embedded.passes import Passes
from engines.sampling import kept_logmass, raw_logprob, sample, unfiltered, verify

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger("engines.embedded.engine")  # the engine's log, as before the scheduler had its own module


class Scheduler:
    """Owns the running sequences, the decode batch, parked KV and the speculative step (module docstring).

    ``submit``, ``withdraw``, ``abort``, ``fail_all`` and ``run`` belong to the event loop; ``release``,
    ``swap_weights`` and the steps run on the worker thread; ``evict`` may run on either (the store is locked).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        config: EmbeddedConfig,
        counters: EngineCounters,
        worker: Executor,
        *,
        vocab_size: int,
        replica: str,
    ) -> None:
        self.model = model
        self.config = config
        self.counters = counters
        self._worker = worker
        self._vocab_size = vocab_size
        self._replica = replica
        self._version = 0
        self._store = KVStore(config.kv_budget_bytes, counters)
        self._group_members: dict[str, set[str]] = {}
        self._groups_lock = threading.Lock()
        self._waiting: list[Seq] = []
        self._active: list[Seq] = []
        self._passes = Passes(model, counters, config.batch_invariant)
        self._wake = asyncio.Event()
        self._invariant = config.batch_invariant  # deterministic mode: engines.embedded.invariant's forward

    @property
    def lora(self) -> LoraBank:
        """The LoRA adapters its forwards apply (``engines.embedded.lora``)."""
        return self._passes.lora

    @property
    def version(self) -> int:
        """The policy version of the weights the model holds now."""
        return self._version

    @property
    def running(self) -> int:
        return len(self._active)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    # -- sequences (event-loop side) -------------------------------------------------------------

    def submit(self, seq: Seq) -> None:
        """Queue a new sequence; it is admitted at the next step with room in the batch."""
        self._waiting.append(seq)
        self._wake.set()

    def withdraw(self, seq: Seq) -> None:
        """Its request's generator has closed: a waiting sequence leaves now, a running one at the next token
        boundary."""
        seq.stop_requested = True
        if seq in self._waiting:
            self._waiting.remove(seq)

    def abort(self, request_id: str) -> None:
        for seq in itertools.chain(self._waiting, self._active):
            if seq.request.request_id == request_id:
                seq.stop_requested = True
        self._wake.set()

    def fail_all(self, message: str) -> None:
        """End every waiting and running request with ``EngineUnavailable(message)``."""
        for seq in [*self._waiting, *self._active]:
            seq.queue.put_nowait(EngineUnavailable(message))

    async def run(self) -> None:
        """The engine's background task: admit up to ``max_batch_size`` sequences, step on the worker, deliver."""
        loop = asyncio.get_running_loop()
        while True:
            if not self._waiting and not self._active:
                self._wake.clear()
                await self._wake.wait()
                continue
            room = self.config.max_batch_size - len(self._active)
            admitted, self._waiting = self._waiting[:room], self._waiting[room:]
            self._active.extend(admitted)
            try:
                events = await loop.run_in_executor(self._worker, self._step, admitted)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a failed forward fails its requests, not the process
                log.exception("embedded engine step failed")
                error = EngineError(f"embedded engine {self._replica!r} failed a forward pass: {exc}")
                for seq in self._active:
                    seq.queue.put_nowait(error)
                self._active.clear()
                self._passes.batch = None
                continue
            for seq, chunk in events:
                seq.queue.put_nowait(chunk)
            self._active = [s for s in self._active if s.finish is None]

    # -- one step (worker thread) ------------------------------------------------------------------

    def _step(self, admitted: list[Seq]) -> list[tuple[Seq, TokenChunk]]:
        """One scheduler step on the worker thread: admit, forward, sample, retire."""
        import torch

        events: list[tuple[Seq, TokenChunk]] = []
        with torch.inference_mode():
            for seq in admitted:  # one by one: a group's first member shares its prompt KV with the next
                self._acquire(seq)
                if not seq.stop_requested and seq.logits is None and len(seq.ids) - seq.cached > 1:
                    self._prefill(seq)
            live: list[Seq] = []
            for seq in self._active:
                if seq.stop_requested:
                    events.append((seq, self._emit(seq, FinishReason.ABORT)))
                else:
                    live.append(seq)
            drafts = self._drafts(live)
            # One fed token each (kept in scheduling order, so a stable batch is reused as is).
            decode = [
                s
                for s in live
                if s not in drafts
                and (s.in_batch or (s.logits is None and s.cache is not None and len(s.ids) - s.cached == 1))
            ]
            for seq in live:
                if seq.logits is None and seq not in decode and seq not in drafts:
                    self._prefill(seq)
            rows = {seq: self._passes.verify(seq, draft) for seq, draft in drafts.items()}
            if decode:
                self._passes.decode(decode)
            for seq in live:
                if seq in drafts:
                    events.append((seq, self._accept(seq, drafts[seq], rows[seq])))
                else:
                    events.append((seq, self._sample(seq)))
        return events

    def _sample(self, seq: Seq) -> TokenChunk:
        """Draw the next token from the sequence's logits (masked in constrained mode) and emit it."""
        assert seq.logits is not None
        logits = seq.logits.double().numpy()
        origin = Origin.SAMPLED
        params = self._params(seq)
        allowed = seq.request.constraint.allowed(seq.ids) if seq.request.constraint is not None else None
        masked = None
        if allowed is not None and len(allowed) == 1:  # constrained mode: no choice was made
            token, logprob, origin = int(allowed[0]), math.nan, Origin.FORCED  # not sampled: NaN
        elif allowed is not None:  # constrained mode: sample the masked, renormalised distribution
            idx = np.asarray(allowed, dtype=np.intp)
            masked = np.full_like(logits, -np.inf)
            masked[idx] = logits[idx]
            token, logprob = sample(masked, params, seq.rng)
        else:
            token, logprob = sample(logits, params, seq.rng)
            logprob = self._exact_logprob(seq.logits, token, seq.request.params, logprob)
        raw = (raw_logprob(logits, token),) if params.raw_logprobs else ()
        kept: tuple[float, ...] = ()
        if params.kept_mass:
            kept = (math.nan if origin == Origin.FORCED else kept_logmass(logits, params, masked),)
        seq.ids.append(token)
        seq.logits = None
        seq.produced += 1
        self.counters.generated_tokens += 1
        reason: FinishReason | None = None
        if token in seq.stops:
            reason = FinishReason.STOP
        elif seq.produced >= seq.budget:
            reason = FinishReason.LENGTH
        origins = (origin,) if origin != Origin.SAMPLED else ()
        return self._emit(seq, reason, (token,), (logprob,), origins, raw, kept)

    def _params(self, seq: Seq) -> SamplingParams:
        """The sampling parameters a draw uses: in deterministic mode at the wire's float32 temperature, the one
        the trainer's recompute uses (``invariant.wire_temperature``)."""
        params = seq.request.params
        if not self._invariant:
            return params
        return dataclasses.replace(params, temperature=wire_temperature(params.temperature))

    def _exact_logprob(self, row: Any, token: int, params: Any, logprob: float) -> float:
        """Deterministic mode: the logprob as the trainer computes it from the same logit row
        (``invariant.token_logprobs``), where the trainer can (no filter cut the distribution); else ``logprob``."""
        if not self._invariant or not unfiltered(params):
            return logprob
        import torch

        return float(token_logprobs(torch.as_tensor(row)[None], [token], params.temperature)[0])

    def _emit(
        self,
        seq: Seq,
        reason: FinishReason | None,
        ids: tuple[int, ...] = (),
        logprobs: tuple[float, ...] = (),
        origins: tuple[Origin, ...] = (),
        raw: tuple[float, ...] = (),
        kept: tuple[float, ...] = (),
    ) -> TokenChunk:
        """The chunk of this step's tokens for ``seq``. With a finish ``reason`` this is the one finish path: the
        sequence is marked finished, its KV parked (``_park``) and the chunk carries the turn's usage."""
        if reason is None:
            return TokenChunk(ids, logprobs, self._version, origins, raw_logprobs=raw, kept_logmass=kept)
        seq.finish = reason
        self._park(seq)
        usage = Usage(prompt_tokens=len(seq.request.token_ids), cached_tokens=seq.reused, generated_tokens=seq.produced)
        return TokenChunk(
            ids,
            logprobs,
            self._version,
            origins,
            finish_reason=reason,
            usage=usage,
            raw_logprobs=raw,
            kept_logmass=kept,
        )

    # -- the speculative step (worker thread) --------------------------------------------------------

    def _drafts(self, live: list[Seq]) -> dict[Seq, tuple[int, ...]]:
        """Drafts of the sequences that have a drafter and at most one token to feed (others decode plainly)."""
        drafts: dict[Seq, tuple[int, ...]] = {}
        for seq in live:
            drafter = seq.request.drafter
            if drafter is None or seq.request.constraint is not None:
                continue  # constrained mode decodes under its mask, one token per forward
            if len(seq.ids) - seq.cached > 1 or not (seq.in_batch or seq.cache is not None):
                continue
            draft = drafter.draft(seq.ids, seq.budget - seq.produced - 1)
            if draft:
                check_token_ids(draft, self._vocab_size, "draft")
                drafts[seq] = tuple(draft)
        return drafts

    def _accept(self, seq: Seq, draft: tuple[int, ...], rows: list[np.ndarray]) -> TokenChunk:
        """Verify a scored draft, emit the accepted prefix plus one token, crop the KV to what was accepted."""
        params = self._params(seq)
        emitted = verify(rows, draft, params, seq.rng)
        accepted = sum(o == Origin.DRAFT_ACCEPTED for _, _, o in emitted)
        assert seq.request.drafter is not None
        seq.request.drafter.feedback(len(draft), accepted)
        self.counters.extra["spec_accepted"] = self.counters.extra.get("spec_accepted", 0) + accepted
        ids: list[int] = []
        logprobs: list[float] = []
        origins: list[Origin] = []
        raw: list[float] = []
        kept: list[float] = []
        reason: FinishReason | None = None
        for i, (token, logprob, origin) in enumerate(emitted):
            ids.append(token)
            logprobs.append(self._exact_logprob(rows[i], token, params, logprob))
            origins.append(origin)
            if params.raw_logprobs:
                raw.append(raw_logprob(rows[i], token))
            if params.kept_mass:
                kept.append(kept_logmass(rows[i], params))
            seq.ids.append(token)
            seq.produced += 1
            self.counters.generated_tokens += 1
            if token in seq.stops:
                reason = FinishReason.STOP
            elif seq.produced >= seq.budget:
                reason = FinishReason.LENGTH
            if reason is not None:
                break
        # The KV holds the pending token and the whole draft; keep only the accepted part. The last emitted
        # token is fed at the next step (or next turn), exactly as after a plain sample.
        assert seq.cache is not None
        surplus = seq.cached - (len(seq.ids) - 1)
        if surplus > 0:
            seq.cache.crop(-surplus)  # transformers 5: a negative count removes that many trailing tokens
        seq.cached = len(seq.ids) - 1
        return self._emit(seq, reason, tuple(ids), tuple(logprobs), tuple(origins), tuple(raw), tuple(kept))

    # -- KV bookkeeping (worker thread) --------------------------------------------------------------

    def _acquire(self, seq: Seq) -> None:
        """Give an admitted sequence the longest reusable KV: its episode's, else its group's prompt."""
        req = seq.request
        entry: Parked | None = None
        if req.episode_id:
            entry = self._store.take(("ep", req.episode_id))
            if entry is not None and entry.salt != req.cache_salt:
                entry = None  # computed under other weights: never reused
        if entry is None and req.group_id:
            shared = self._store.peek(("grp", req.group_id))
            if shared is not None and shared.salt == req.cache_salt and seq.ids[: len(shared.ids)] == list(shared.ids):
                entry = Parked(shared.ids, fork(shared.cache), shared.logits, shared.salt, 0, shared.nbytes)
                self.counters.extra["group_forks"] = self.counters.extra.get("group_forks", 0) + 1
        if req.group_id and req.episode_id:
            with self._groups_lock:
                members = self._group_members.setdefault(req.group_id, set())
                seq.share_prompt = entry is None and req.episode_id not in members
                members.add(req.episode_id)
        n = common_prefix(entry.ids, seq.ids) if entry is not None else 0
        if entry is not None and n == len(seq.ids) and entry.logits is None:
            n -= 1  # the next token's logits are needed: recompute the last position
        if entry is not None and n > 0:
            if n < len(entry.ids):
                entry.cache.crop(n - len(entry.ids))  # transformers 5: a negative count removes trailing tokens
                entry.logits = None
            seq.cache, seq.cached, seq.reused = entry.cache, n, n
            seq.logits = entry.logits if n == len(seq.ids) else None
            if n == len(entry.ids):  # last turn's sampled token(s) lead the fed tokens
                seq.deferred = min(entry.deferred, len(seq.ids) - n)
        self.counters.prefill_tokens += len(seq.ids) - seq.cached - seq.deferred
        self.counters.cached_tokens += seq.cached
        self.counters.extra["deferred_decode_tokens"] += seq.deferred

    def _park(self, seq: Seq) -> None:
        """Keep a finished sequence's KV for its episode's next turn.

        An aborted turn's KV is dropped: its episode may already have been ended and released
        while the abort was on its way here, and parking it then would leak it until evicted.
        """
        if seq.in_batch:
            self._passes.unpack()
        if seq.cache is None or seq.cached == 0 or not seq.request.episode_id or seq.finish == FinishReason.ABORT:
            seq.cache = None
            return
        cache, seq.cache = seq.cache, None
        logits = seq.logits if seq.cached == len(seq.ids) else None
        entry = Parked(
            tuple(seq.ids[: seq.cached]),
            cache,
            logits,
            seq.request.cache_salt,
            len(seq.ids) - seq.cached,
            cache_nbytes(cache),
        )
        self._store.put(("ep", seq.request.episode_id), entry)

    def release(self, episode_id: str) -> None:
        """Forget an ended episode: its parked KV, and its group's prompt once no member is left (worker thread,
        so a turn finishing in the step before has parked its KV already)."""
        self._store.take(("ep", episode_id))
        with self._groups_lock:
            for group, members in list(self._group_members.items()):
                members.discard(episode_id)
                if not members:
                    del self._group_members[group]
                    self._store.take(("grp", group))

    def evict(self, episode_id: str) -> bool:
        """Drop an idle episode's KV now (its next turn recomputes it); True if there was any."""
        return self._store.take(("ep", episode_id)) is not None

    # -- forward passes (worker thread) --------------------------------------------------------------

    def _prefill(self, seq: Seq) -> None:
        """Prefill (``Passes.prefill``); a group's first member then keeps its prompt's KV for the others."""
        self._passes.prefill(seq)
        req = seq.request
        if seq.share_prompt and ("grp", req.group_id) not in self._store:
            assert seq.cache is not None
            prompt = Parked(tuple(seq.ids), fork(seq.cache), seq.logits, req.cache_salt, 0, 0)
            prompt.nbytes = cache_nbytes(prompt.cache)
            self._store.put(("grp", req.group_id), prompt)

    # -- weights (worker thread) ---------------------------------------------------------------------

    def swap_weights(self, state: dict[str, Any], update: WeightUpdate) -> None:
        """Copy a checked checkpoint into the live parameters between two steps; drop old KV unless ``keep_kv``."""
        import torch

        own = self.model.state_dict()
        with torch.no_grad():
            for k, t in state.items():
                own[k].copy_(t)
        self._version = update.policy_version
        if not update.keep_kv:
            self._passes.unpack()
            self._store.clear()
            for seq in self._active:  # in flight: recompute under the new weights at the next step
                seq.cache, seq.cached, seq.logits, seq.deferred = None, 0, None, 0
        log.info("embedded engine %s now serves policy version %d", self._replica, self._version)
