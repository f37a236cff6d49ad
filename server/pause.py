"""The pause around a weight update on one bridge outside a fleet (a fleet's barrier does the same for all its
bridges: ``server.fleet.member``): new turns wait, the running ones end or are aborted, the update runs, turns resume.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Protocol

from server.errors import EngineUnavailable

log = logging.getLogger(__name__)

ABORTED_DRAIN_S = 30.0  # how long aborted turns may take to end before an update gives up (nothing loaded)


class Pausable(Protocol):
    """What ``exclusive`` needs of the bridge."""

    @property
    def paused(self) -> bool: ...

    @property
    def inflight(self) -> int: ...

    async def pause(self, abort: bool) -> int: ...

    def resume(self) -> None: ...


class PhaseTimer(Protocol):
    def weight_update_phase(self, phase: str, seconds: float) -> None: ...


@contextlib.asynccontextmanager
async def exclusive(bridge: Pausable, mode: str, drain_s: float, metrics: PhaseTimer) -> AsyncIterator[None]:
    """No turn runs while weights change and are proven (a bridge outside a fleet; a fleet's barrier does this for
    all its bridges): new turns wait, the running ones end (``mode`` keep) or are aborted (abort, or still running
    after ``drain_s``; their partial tokens are kept, all of the old version); turns resume after commit or rollback
    unless the bridge was paused before (``POST /pause``)."""
    was_paused, began = bridge.paused, time.perf_counter()
    await bridge.pause(abort=mode == "abort")
    try:
        aborted, abort_s = mode == "abort", max(drain_s, ABORTED_DRAIN_S)
        deadline = time.monotonic() + (abort_s if aborted else drain_s)
        while bridge.inflight:
            if time.monotonic() > deadline:
                if aborted:
                    raise EngineUnavailable(
                        f"{bridge.inflight} Steps still running {abort_s:g} s after their turns were aborted; "
                        "no weights were loaded: retry the update"
                    )
                log.warning("%d Steps still running after %g s: aborting their turns", bridge.inflight, drain_s)
                await bridge.pause(abort=True)
                aborted, deadline = True, time.monotonic() + abort_s
            await asyncio.sleep(0.005)
        metrics.weight_update_phase("drain", time.perf_counter() - began)
        yield
    finally:
        if not was_paused:
            bridge.resume()
        metrics.weight_update_phase("held", time.perf_counter() - began)
