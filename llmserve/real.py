"""Real mode (``LLMSERVE_MODE=real``): each window's requests run through this project's bridge on a real engine.

A window replays the task's arrivals of that window, scaled to what the engine can serve (``RealConfig``: at most
``max_requests`` per window, prompts and outputs capped), paced at their arrival offsets, as streamed episodes
through ``rl_client`` (one ``StartEpisode`` + streamed ``Step`` + discard per request, ``ignore_eos`` so each
produces exactly its output length). The observation is built from what was measured: TTFT from the send to the
first streamed chunk, ITL from the chunk times, throughput from the tokens over the window's wall time, SLO
compliance against the task's SLOs.

What the action changes here: ``batch_cap`` is the number of requests in flight at once (a client-side admission
bound). The engine cannot apply the other knobs per window (KV budget, quantization tier, speculation depth,
prefill/decode split, priority routing), so they are not applied: the observation lists them in
``metadata["simulated"]`` and the memory figures come from the simulator's capacity model. The window timeline
is wall time, so real mode is not deterministic (sim mode is).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from llmserve.models import ServeAction
from llmserve.sim import WindowStats, capacity
from llmserve.tasks import Request, TaskSpec

NOT_APPLIED = ("kv_budget_fraction", "quantization_tier", "speculation_depth", "prefill_decode_split",
               "priority_routing")  # fmt: skip


@dataclass(frozen=True)
class RealConfig:
    """Where the bridge is and how a task's windows are scaled to the engine (``LLMSERVE_REAL_*`` variables)."""

    bridge: str = "127.0.0.1:50051"
    max_requests: int = 4
    prompt_cap: int = 64
    output_cap: int = 16
    timeout_s: float = 120.0

    @classmethod
    def from_env(cls) -> RealConfig:
        env = os.environ
        return cls(
            bridge=env.get("LLMSERVE_BRIDGE", cls.bridge),
            max_requests=int(env.get("LLMSERVE_REAL_MAX_REQUESTS", cls.max_requests)),
            prompt_cap=int(env.get("LLMSERVE_REAL_PROMPT_CAP", cls.prompt_cap)),
            output_cap=int(env.get("LLMSERVE_REAL_OUTPUT_CAP", cls.output_cap)),
        )


class _LoopThread:
    """One event loop on a thread of its own: the gRPC channel lives there, whatever thread steps the env."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="llmserve-real", daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout_s: float) -> Any:
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout_s)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class RealBackend:
    """The simulator's window interface (``run_window``, queues) over measured requests through a bridge."""

    def __init__(self, spec: TaskSpec, workload: list[list[Request]], config: RealConfig | None = None) -> None:
        from rl_client import AsyncBridgeClient

        self.spec = spec
        self.workload = workload
        self.config = config or RealConfig.from_env()
        self.window = 0
        self.waiting: list[Any] = []  # every window's requests finish inside it: nothing waits or runs after
        self.running: list[Any] = []
        self._loop = _LoopThread()
        self._client = self._loop.run(self._connect(AsyncBridgeClient), self.config.timeout_s)

    async def _connect(self, client_cls: Any) -> Any:
        client = client_cls(self.config.bridge, timeout=self.config.timeout_s)
        await client.wait_until_ready(self.config.timeout_s)
        return client

    def run_window(self, action: ServeAction) -> WindowStats:
        arrivals = self.workload[self.window][: self.config.max_requests]
        st = self._loop.run(self._window(action, arrivals), self.config.timeout_s * 2)
        self.window += 1
        return st

    async def _window(self, action: ServeAction, arrivals: list[Request]) -> WindowStats:
        start = (self.window) * self.spec.window_s
        st = WindowStats(arrivals=len(arrivals))
        gate = asyncio.Semaphore(action.batch_cap)
        t0 = time.perf_counter()
        await asyncio.gather(*(self._request(r, r.arrival_s - start, t0, gate, st) for r in arrivals))
        st.elapsed_s = st.gpu_seconds = time.perf_counter() - t0  # wall time: what the engine was held for
        return st

    async def _request(
        self, req: Request, offset_s: float, t0: float, gate: asyncio.Semaphore, st: WindowStats
    ) -> None:
        cfg = self.config
        prompt = [100 + (req.rid * 7 + i) % 1000 for i in range(max(1, min(req.prompt_len, cfg.prompt_cap)))]
        out_len = max(1, min(req.output_len, cfg.output_cap))
        st.prompt_tokens += len(prompt)
        await asyncio.sleep(max(0.0, t0 + offset_s - time.perf_counter()))
        sent = time.perf_counter()
        async with gate:  # batch_cap: requests in flight at once
            sampling = {"max_tokens": out_len, "temperature": 1.0, "seed": req.rid, "ignore_eos": True}
            started = await self._client.start_episode(prompt, sampling=sampling)
            eid = started.episode_id
            try:
                times: list[float] = []
                tokens = 0
                async for chunk in self._client.stream_step(eid):
                    if chunk.token_ids:
                        times.append(time.perf_counter())
                        tokens += len(chunk.token_ids)
            finally:
                await self._client.discard_episode(eid)
        self._judge(req, sent, times, tokens, st)

    def _judge(self, req: Request, sent: float, times: list[float], tokens: int, st: WindowStats) -> None:
        st.judged += 1
        st.tokens += tokens
        if not times:
            return
        ttft = (times[0] - sent) * 1000
        itl = (times[-1] - times[0]) * 1000 / max(1, tokens - 1)
        st.ttfts_ms.append(ttft)
        st.itls_ms.append(itl)
        if ttft <= self.spec.ttft_slo_ms[req.priority] and itl <= self.spec.itl_slo_ms:
            st.met += 1
            st.good_tokens += tokens

    def kv_capacity(self, action: ServeAction) -> int:
        """The simulator's capacity model (the KV budget is one of the knobs real mode does not apply)."""
        return int(
            capacity(self.spec.hardware.memory_gib, action.quantization_tier).kv_tokens * action.kv_budget_fraction
        )

    def kv_used(self) -> int:
        return 0

    def close(self) -> None:
        self._loop.run(self._client.close(), 30)
        self._loop.stop()
