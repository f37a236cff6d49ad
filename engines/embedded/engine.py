"""``embedded``: a Hugging Face causal LM in-process on torch CPU (SmolLM2-135M-Instruct by default).

Structure (after vLLM's engine core / client split): ``EmbeddedEngine`` is the facade (``engines.base.Engine``)
and the per-request side: it checks a request, builds its sequence with its own queue, hands it to the
``Scheduler`` (``engines.embedded.scheduler``) and yields what arrives on that queue. The scheduler owns the
sequences, the batch, parked KV and the speculative step, and runs the one background task. Every torch call
(prefill, batched decode, scoring, weight swap) runs on one worker thread owned here, so the event loop stays
responsive and a weight swap or a score always falls between two decode steps.

Invariants
----------
* A request is checked here (non-empty, in vocabulary, room in the context window, valid sampling) before the
  scheduler sees it; its budget is ``max_tokens`` capped by what the context window leaves.
* Closing a request's generator early (client gone, deadline) withdraws its sequence: the scheduler drops it at
  the next token boundary.
* A scheduler that dies fails every request in flight with ``EngineUnavailable``; the engine then refuses new
  requests and reports unhealthy. ``close`` fails the requests still running the same way.
* Scoring and releases run on the worker, under the weights and the KV of that moment.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from core.errors import EngineUnavailable, InvalidArgument
from core.tasks import cancel_and_wait
from core.types import (
    AdapterRef,
    Capability,
    EngineCounters,
    EngineHealth,
    EngineInfo,
    GenerateRequest,
    TokenChunk,
    WeightUpdate,
    check_token_ids,
)
from engines.config import EmbeddedConfig
from engines.embedded.lora import read_adapter
from engines.embedded.model import DEFAULT_MODEL_NAME, Loaded, Seq, load_model
from engines.embedded.scheduler import Scheduler
from engines.embedded.weights import read_checkpoint
from engines.scoring import ScoreRequest, ScoreResult, score_sync

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
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"primerl-{replica}")
        self._scheduler = Scheduler(self.model, config, self.counters, self._worker, vocab_size=vocab, replica=replica)
        self._task: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None
        self._rng = np.random.default_rng()

    @classmethod
    async def start(cls, config: EmbeddedConfig, model: str = "", replica: str = "embedded-0") -> EmbeddedEngine:
        """Load the model off the event loop (seconds when cached; ~30 s for the first conversion)."""
        loaded = await asyncio.to_thread(load_model, config, model)
        if config.batch_invariant:
            from engines.embedded.invariant import check_supported

            try:
                check_supported(loaded.model)
            except ValueError as exc:
                raise EngineUnavailable(f"engine.embedded.batch_invariant: {exc}") from None
        return cls(loaded, config, replica)

    @property
    def policy_version(self) -> int:
        return self._scheduler.version

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
            self._task = asyncio.create_task(self._scheduler.run(), name=f"primerl-{self.info.replica}-scheduler")
            self._task.add_done_callback(self._on_scheduler_exit)
        self._scheduler.submit(seq)
        try:
            while True:
                item = await seq.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            self._scheduler.withdraw(seq)  # a running sequence is dropped at the next token boundary

    def _on_scheduler_exit(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._failure = task.exception()
            log.error("embedded engine %s scheduler died: %r", self.info.replica, self._failure)
            self._scheduler.fail_all(f"embedded engine scheduler failed: {self._failure}")

    async def abort(self, request_id: str) -> None:
        self._scheduler.abort(request_id)

    async def health(self) -> EngineHealth:
        if self._failure is not None:
            return EngineHealth(False, f"scheduler failed: {self._failure}")
        return EngineHealth(True, f"{self._scheduler.running} running, {self._scheduler.waiting} waiting")

    async def release(self, episode_id: str) -> None:
        # On the worker, after any step in flight: a turn finishing in that step parks its KV first,
        # so nothing of an ended episode is parked after its release.
        await asyncio.get_running_loop().run_in_executor(self._worker, self._scheduler.release, episode_id)

    def evict(self, episode_id: str) -> bool:
        """Drop an idle episode's KV now (its next turn recomputes it); True if there was any."""
        return self._scheduler.evict(episode_id)

    async def score(self, request: ScoreRequest) -> ScoreResult:
        """Teacher-forced logprobs on the worker, between two decode steps, under the weights of that moment (and the
        request's LoRA adapter)."""
        scheduler, adapter = self._scheduler, request.adapter

        def run() -> ScoreResult:
            with scheduler.lora.rows([adapter.served if adapter is not None else None]):
                return score_sync(self.model, request, scheduler.version)  # the version is read on the worker

        return await asyncio.get_running_loop().run_in_executor(self._worker, run)

    def check_adapter(self, path: str) -> None:
        """The prepare phase of an adapter update (``server.adapters``): the directory, read and checked whole."""
        read_adapter(self.model, path)

    async def load_adapter(self, ref: AdapterRef, path: str) -> None:
        """Serve a LoRA adapter version beside the others (only requests that name it use it)."""
        layers = await asyncio.to_thread(read_adapter, self.model, path)
        await asyncio.get_running_loop().run_in_executor(self._worker, self._scheduler.lora.load, ref.served, layers)

    @property
    def loaded_adapters(self) -> frozenset[str]:
        """The adapter versions it serves now, by served name (as vLLM's ``/v1/models`` lists its LoRAs)."""
        return frozenset(self._scheduler.lora.adapters)

    async def unload_adapter(self, ref: AdapterRef) -> None:
        await asyncio.get_running_loop().run_in_executor(self._worker, self._scheduler.lora.unload, ref.served)

    async def update_weights(self, update: WeightUpdate) -> None:
        state = await asyncio.to_thread(read_checkpoint, self.model, update.checkpoint_path)
        await asyncio.get_running_loop().run_in_executor(self._worker, self._scheduler.swap_weights, state, update)

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        self._scheduler.fail_all(f"embedded engine {self.info.replica!r} is shutting down")
        await asyncio.to_thread(self._worker.shutdown, True)  # a forward in flight finishes off the loop


__all__ = ["DEFAULT_MODEL_NAME", "EmbeddedEngine", "load_model"]
