"""``embedded``: a Hugging Face causal LM in-process on torch CPU (SmolLM2-135M-Instruct by default).

Structure (after vLLM's engine core / client split): one background task owns a scheduler loop; every torch
call (prefill, batched decode, weight swap) runs on one worker thread, so the event loop stays responsive and a
weight swap always falls between two decode steps. Each request's async generator reads its own queue.

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
* Policy versions: KV is reused only under the same ``cache_salt``. ``update_weights`` drops every KV computed
  under the old weights (idle and in flight; in-flight sequences are re-prefilled) unless ``keep_kv``.
  Each token carries the version of the weights that produced its logits.
* Batching: sequences that need one decode token share a forward pass (left-padded KV, per-row positions);
  sequences join and leave at token boundaries. The batched KV is rebuilt only when membership changes.
* Speculation (``GenerateRequest.drafter``): a sequence whose drafter proposes a draft leaves the batch for that
  step and is fed [pending token + draft] in ONE forward of its own; ``engines.sampling.verify`` accepts or
  resamples exactly, so the output is distributed as without speculation (greedy: identical up to float
  rounding of a multi-token forward). The KV is then cropped to the accepted prefix; the last emitted token
  stays pending as in plain decode. Steps with an empty draft take the plain (batched) path.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import threading
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from core.errors import EngineError, EngineUnavailable, InvalidArgument
from core.tasks import cancel_and_wait
from core.types import (
    Capability,
    EngineCounters,
    EngineHealth,
    EngineInfo,
    FinishReason,
    GenerateRequest,
    Origin,
    TokenChunk,
    Usage,
    WeightUpdate,
    check_token_ids,
)
from engines.config import EmbeddedConfig
from engines.embedded import spec as embedded_spec
from engines.embedded.kvcache import (
    KVStore,
    Parked,
    cache_nbytes,
    common_prefix,
    fork,
    forward_with_cache,
    new_cache,
    pack_left,
    unpack_left,
)
from engines.embedded.model import DEFAULT_MODEL_NAME, Batch, Loaded, Seq, load_model
from engines.embedded.weights import read_checkpoint
from engines.sampling import raw_logprob, sample
from engines.scoring import ScoreRequest, ScoreResult, score_sync

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


class EmbeddedEngine:
    """In-process torch engine with stateful decode, GRPO prompt sharing, batching and weight swaps."""

    def __init__(self, loaded: Loaded, config: EmbeddedConfig, replica: str = "embedded-0") -> None:
        self.config = config
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        vocab = int(self.model.config.vocab_size)
        self.info = EngineInfo(
            engine="embedded",
            model=loaded.name,
            vocab_size=vocab,
            max_model_len=loaded.max_model_len,
            eos_token_ids=loaded.tokenizer.eos_token_ids,
            replica=replica,
            capabilities=frozenset(Capability),  # every one: raw logprobs, min-p, masks, drafts, weight swaps, scoring
            base_weights=loaded.model_dir,
        )
        self.counters = EngineCounters(extra={"kv_bytes": 0, "kv_evictions": 0, "deferred_decode_tokens": 0})
        self._version = 0
        self._store = KVStore(config.kv_budget_bytes, self.counters)
        self._group_members: dict[str, set[str]] = {}
        self._groups_lock = threading.Lock()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"primerl-{replica}")
        self._waiting: list[Seq] = []
        self._active: list[Seq] = []
        self._batch: Batch | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None
        self._rng = np.random.default_rng()

    @classmethod
    async def start(cls, config: EmbeddedConfig, model: str = "", replica: str = "embedded-0") -> EmbeddedEngine:
        """Load the model off the event loop (seconds when cached; ~30 s for the first conversion)."""
        return cls(await asyncio.to_thread(load_model, config, model), config, replica)

    @property
    def policy_version(self) -> int:
        return self._version

    # -- requests (event-loop side) -------------------------------------------------------------

    def _check(self, request: GenerateRequest) -> None:
        if not request.token_ids:
            raise InvalidArgument("token_ids is empty: the engine needs at least one token to continue")
        check_token_ids(request.token_ids, self.info.vocab_size, "token_ids")
        request.params.validate(self.info.vocab_size)
        if len(request.token_ids) >= self.info.max_model_len:
            raise InvalidArgument(
                f"{len(request.token_ids)} tokens leave no room in the context window of "
                f"{self.info.max_model_len} tokens"
            )

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        self._check(request)
        if self._failure is not None:
            raise EngineUnavailable(f"embedded engine {self.info.replica!r} has failed: {self._failure}")
        params = request.params
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(self.info.eos_token_ids)
        seq = Seq(
            request=request,
            queue=asyncio.Queue(),
            rng=np.random.default_rng(params.seed) if params.seed is not None else self._rng,
            budget=min(params.max_tokens, self.info.max_model_len - len(request.token_ids)),
            stops=frozenset(stops),
            ids=list(request.token_ids),
        )
        self.counters.requests += 1
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"primerl-{self.info.replica}-scheduler")
            self._task.add_done_callback(self._on_scheduler_exit)
        self._waiting.append(seq)
        self._wake.set()
        try:
            while True:
                item = await seq.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            seq.stop_requested = True  # the scheduler drops it at the next token boundary
            if seq in self._waiting:
                self._waiting.remove(seq)

    def _on_scheduler_exit(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._failure = task.exception()
            log.error("embedded engine %s scheduler died: %r", self.info.replica, self._failure)
            for seq in [*self._waiting, *self._active]:
                seq.queue.put_nowait(EngineUnavailable(f"embedded engine scheduler failed: {self._failure}"))

    async def abort(self, request_id: str) -> None:
        for seq in itertools.chain(self._waiting, self._active):
            if seq.request.request_id == request_id:
                seq.stop_requested = True
        self._wake.set()

    async def health(self) -> EngineHealth:
        if self._failure is not None:
            return EngineHealth(False, f"scheduler failed: {self._failure}")
        return EngineHealth(True, f"{len(self._active)} running, {len(self._waiting)} waiting")

    async def release(self, episode_id: str) -> None:
        # On the worker, after any step in flight: a turn finishing in that step parks its KV first,
        # so nothing of an ended episode is parked after its release.
        await asyncio.get_running_loop().run_in_executor(self._worker, self._release, episode_id)

    def _release(self, episode_id: str) -> None:
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

    async def score(self, request: ScoreRequest) -> ScoreResult:
        """Teacher-forced logprobs on the worker, between two decode steps, under the weights of that moment."""
        run = lambda: score_sync(self.model, request, self._version)  # noqa: E731 - the version is read on the worker
        return await asyncio.get_running_loop().run_in_executor(self._worker, run)

    async def update_weights(self, update: WeightUpdate) -> None:
        state = await asyncio.to_thread(read_checkpoint, self.model, update.checkpoint_path)
        await asyncio.get_running_loop().run_in_executor(self._worker, self._swap_weights, state, update)

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        for seq in [*self._waiting, *self._active]:
            seq.queue.put_nowait(EngineUnavailable(f"embedded engine {self.info.replica!r} is shutting down"))
        await asyncio.to_thread(self._worker.shutdown, True)  # a forward in flight finishes off the loop

    # -- scheduler ---------------------------------------------------------------------------------

    async def _run(self) -> None:
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
                events = await loop.run_in_executor(self._worker, self._iteration, admitted)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a failed forward fails its requests, not the process
                log.exception("embedded engine step failed")
                error = EngineError(f"embedded engine {self.info.replica!r} failed a forward pass: {exc}")
                for seq in self._active:
                    seq.queue.put_nowait(error)
                self._active.clear()
                self._batch = None
                continue
            for seq, chunk in events:
                seq.queue.put_nowait(chunk)
            self._active = [s for s in self._active if s.finish is None]

    def _iteration(self, admitted: list[Seq]) -> list[tuple[Seq, TokenChunk]]:
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
                    events.append((seq, self._finish(seq, FinishReason.ABORT, ())))
                else:
                    live.append(seq)
            drafts = embedded_spec.drafts(self, live)
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
            rows = {seq: embedded_spec.verify_forward(self, seq, draft) for seq, draft in drafts.items()}
            if decode:
                self._decode(decode)
            version = self._version
            for seq in live:
                if seq in drafts:
                    events.append((seq, embedded_spec.accept(self, seq, drafts[seq], rows[seq], version)))
                    continue
                assert seq.logits is not None
                logits = seq.logits.double().numpy()
                origin = Origin.SAMPLED
                allowed = seq.request.constraint.allowed(seq.ids) if seq.request.constraint is not None else None
                if allowed is not None and len(allowed) == 1:  # constrained mode: no choice was made
                    token, logprob, origin = int(allowed[0]), math.nan, Origin.FORCED  # not sampled: NaN
                elif allowed is not None:  # constrained mode: sample the masked, renormalised distribution
                    idx = np.asarray(allowed, dtype=np.intp)
                    masked = np.full_like(logits, -np.inf)
                    masked[idx] = logits[idx]
                    token, logprob = sample(masked, seq.request.params, seq.rng)
                else:
                    token, logprob = sample(logits, seq.request.params, seq.rng)
                raw = (raw_logprob(logits, token),) if seq.request.params.raw_logprobs else ()
                seq.ids.append(token)
                seq.logits = None
                seq.produced += 1
                self.counters.generated_tokens += 1
                if token in seq.stops:
                    events.append((seq, self._finish(seq, FinishReason.STOP, (token, logprob), raw, origin)))
                elif seq.produced >= seq.budget:
                    events.append((seq, self._finish(seq, FinishReason.LENGTH, (token, logprob), raw, origin)))
                else:
                    origins = (origin,) if origin != Origin.SAMPLED else ()
                    events.append((seq, TokenChunk((token,), (logprob,), version, origins, raw_logprobs=raw)))
        return events

    def _finish(
        self,
        seq: Seq,
        reason: FinishReason,
        last: tuple[int, float] | tuple[()],
        raw: tuple[float, ...] = (),
        origin: Origin = Origin.SAMPLED,
    ) -> TokenChunk:
        seq.finish = reason
        self._park(seq)
        usage = Usage(prompt_tokens=len(seq.request.token_ids), cached_tokens=seq.reused, generated_tokens=seq.produced)
        ids, logprobs = ((last[0],), (last[1],)) if last else ((), ())
        origins = (origin,) if last and origin != Origin.SAMPLED else ()
        return TokenChunk(ids, logprobs, self._version, origins, finish_reason=reason, usage=usage, raw_logprobs=raw)

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
            self._unpack()
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

    # -- forward passes (worker thread) --------------------------------------------------------------

    def _prefill(self, seq: Seq) -> None:
        import torch

        if seq.in_batch:
            self._unpack()
        new = seq.ids[seq.cached :]
        if seq.cache is None:
            seq.cache, seq.cached = new_cache(self.model.config), 0
            new = seq.ids
        if seq.produced:  # KV dropped mid-turn by a weight swap: recomputed under the new weights
            self.counters.extra["recomputed_tokens"] = self.counters.extra.get("recomputed_tokens", 0) + len(new)
        out = forward_with_cache(self.model, seq.cache, input_ids=torch.tensor([new]), use_cache=True, logits_to_keep=1)
        seq.logits = out.logits[0, -1]
        seq.cached = len(seq.ids)
        self.counters.forward_passes += 1
        req = seq.request
        if seq.share_prompt and ("grp", req.group_id) not in self._store:
            prompt = Parked(tuple(seq.ids), fork(seq.cache), seq.logits, req.cache_salt, 0, 0)
            prompt.nbytes = cache_nbytes(prompt.cache)
            self._store.put(("grp", req.group_id), prompt)

    def _decode(self, seqs: list[Seq]) -> None:
        import torch

        self.counters.forward_passes += 1
        if len(seqs) == 1:
            seq = seqs[0]
            if seq.in_batch:
                self._unpack()
            assert seq.cache is not None
            out = forward_with_cache(self.model, seq.cache, input_ids=torch.tensor([[seq.ids[-1]]]), use_cache=True)
            seq.logits = out.logits[0, -1]
            seq.cached += 1
            return
        if self._batch is None or self._batch.rows != seqs:
            self._unpack()
            self._pack(seqs)
        batch = self._batch
        assert batch is not None
        batch.mask = torch.cat([batch.mask, torch.ones(len(seqs), 1, dtype=batch.mask.dtype)], dim=1)
        out = forward_with_cache(
            self.model,
            batch.cache,
            input_ids=torch.tensor([[s.ids[-1]] for s in seqs]),
            attention_mask=batch.mask,
            position_ids=torch.tensor([[s.cached] for s in seqs]),
            use_cache=True,
        )
        for i, seq in enumerate(seqs):
            seq.logits = out.logits[i, -1]
            seq.cached += 1
        self.counters.extra["batched_rows"] = self.counters.extra.get("batched_rows", 0) + len(seqs)

    def _pack(self, seqs: list[Seq]) -> None:
        """Left-pad the sequences' KV into one batched cache."""
        caches = []
        for seq in seqs:
            assert seq.cache is not None
            caches.append(seq.cache)
        cache, mask = pack_left(caches, [seq.cached for seq in seqs])
        for seq in seqs:
            seq.cache, seq.in_batch = None, True
        self._batch = Batch(list(seqs), cache, mask)

    def _unpack(self) -> None:
        """Split the batched cache back into per-sequence caches."""
        batch, self._batch = self._batch, None
        if batch is None:
            return
        for seq, cache in zip(batch.rows, unpack_left(batch.cache, [s.cached for s in batch.rows]), strict=True):
            seq.cache, seq.in_batch = cache, False

    # -- weights ------------------------------------------------------------------------------------

    def _swap_weights(self, state: dict[str, Any], update: WeightUpdate) -> None:
        import torch

        own = self.model.state_dict()
        with torch.no_grad():
            for k, t in state.items():
                own[k].copy_(t)
        self._version = update.policy_version
        if not update.keep_kv:
            self._unpack()
            self._store.clear()
            for seq in self._active:  # in flight: recompute under the new weights at the next step
                seq.cache, seq.cached, seq.logits, seq.deferred = None, 0, None, 0
        log.info("embedded engine %s now serves policy version %d", self.info.replica, self._version)


__all__ = ["DEFAULT_MODEL_NAME", "EmbeddedEngine", "load_model"]
