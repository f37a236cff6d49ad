"""Staged full-weight reloads on a vLLM server: load beside the served weights before the pause, swap under it.

The server side is ``engines/http/vllm_worker/primerl_vllm_worker.py``, a vLLM worker extension that
``scripts/serve_vllm.sh`` loads; this is its client, one per ``VllmEngine``, over the dev-mode ``/collective_rpc``:

* ``stage(path)``, in the update's prepare phase (``server.weights.Weights.prepare``): the server loads the
  checkpoint into a twin of its model in a thread while it keeps serving; polled until ready;
* ``swap(path)``, under the pause (``VllmEngine.update_weights``): the twin's weights become the served ones, and
  the twin keeps the previous ones, so a rollback to the previous checkpoint is one more swap.

Every step falls back to vLLM's in-place ``reload_weights`` and never fails an update by itself: a server without
the extension (any vLLM started otherwise), one where it cannot work (GPU, compiled, LoRA on, quantized: the server
says why, logged once), a staging that failed (logged), or a twin that holds something else by the time of the swap
(another bridge staged meanwhile). Tokens name what the twin holds; the server makes them unique per start.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from core.errors import PrimeRLError, Unimplemented

log = logging.getLogger(__name__)

Request = Callable[..., Awaitable[httpx.Response]]
"""``RemoteEngine.request``: one control call to the server, errors mapped."""

NOT_IMPLEMENTED = "is not implemented"  # vLLM's answer to a method its workers lack (the server carries on)
POLL_S = (0.02, 0.2)  # how often ``stage`` asks how the staging goes: first, then at most (doubling)


class StagedReload:
    """The client side of one server's twin (module docstring)."""

    def __init__(self, request: Request, label: str, timeout_s: float) -> None:
        self._request = request
        self._label = label
        self._timeout_s = timeout_s
        self.extension: bool | None = None  # the server has the worker extension (None: not asked since it started)
        self.available: bool | None = None  # it stages (None: not asked since it started)
        self._staged: tuple[str, str] | None = None  # (directory, token) ready in the twin
        self._undo: tuple[str, str] | None = None  # (the directory served before the last swap, its token)
        self.last_swap: dict[str, Any] = {}  # the server's report of the last swap (what changed places)

    async def _call(self, method: str, kwargs: dict[str, str]) -> Any:
        """``/collective_rpc``: the first (only) worker's result."""
        body = {"method": method, "kwargs": kwargs, "timeout": self._timeout_s}
        response = await self._request("POST", "/collective_rpc", json_body=body, timeout=self._timeout_s)
        return response.json()["results"][0]

    async def report(self) -> dict[str, Any]:
        """The server's twin: its state, token and the directory it holds."""
        return await self._call("primerl_staged", {})

    def forget(self) -> None:
        """The server (re)started: its twin, if any, is gone."""
        self.extension, self.available, self._staged, self._undo = None, None, None, None

    async def stage(self, path: str) -> float | None:
        """Load ``path`` into the server's twin while it serves; the seconds it took, or None where it was not
        staged (the update then reloads in place). Never raises for a server that cannot stage."""
        if self.available is False:
            return None
        path = await asyncio.to_thread(os.path.realpath, path)  # as the server names what its twin holds
        self._staged, self._undo = None, None  # a new update: what the twin held for the last one is no rollback
        began = time.perf_counter()
        deadline, delay = began + self._timeout_s, POLL_S[0]
        try:
            report = await self._call("primerl_stage", {"weights_path": path})
            while report.get("state") in ("busy", "staging") and time.perf_counter() < deadline:
                await asyncio.sleep(delay)
                delay = min(2 * delay, POLL_S[1])
                if report.get("state") == "busy":  # another bridge's staging on this server: ours after it
                    report = await self._call("primerl_stage", {"weights_path": path})
                else:
                    token = report.get("token")
                    report = await self.report()
                    if report.get("token") != token:  # someone staged over ours
                        break
        except Unimplemented:  # no dev mode: the in-place reload says so
            self.available = False
            return None
        except PrimeRLError as exc:
            if NOT_IMPLEMENTED in exc.message:
                log.info("%s: no staged reloads (vLLM started without PrimeRL's worker extension)", self._label)
                self.extension = self.available = False
            else:  # unreachable, timed out, the staging failed: the in-place reload meets it
                log.warning("%s: staging %s failed (%s); the update reloads in place", self._label, path, exc.message)
            return None
        self.extension = True
        state = report.get("state")
        if state == "unsupported":
            log.info("%s: no staged reloads: %s; full-weight updates reload in place", self._label, report.get("error"))
            self.available = False
            return None
        self.available = True
        if state != "ready" or report.get("holds") != path:
            log.warning(
                "%s: staging %s ended %s%s; the update reloads in place",
                self._label, path, state, f" ({report.get('error', '').strip()})" if report.get("error") else "",
            )  # fmt: skip
            return None
        self._staged = (path, str(report["token"]))
        return time.perf_counter() - began

    async def swap(self, path: str, restore: bool = False) -> bool:
        """Under the pause: serve ``path`` from the twin if it holds it: staged for this update, or (``restore``, a
        rollback) the weights served before this update's swap. False where it does not: the caller reloads in
        place, after which the twin holds no rollback. An error of the swap itself raises."""
        path = await asyncio.to_thread(os.path.realpath, path)  # as the server names what its twin holds
        held = self._undo if restore else self._staged
        self._staged, self._undo = None, None
        if held is None or held[0] != path or not self.available:
            return False
        report = await self._call("primerl_swap", {"token": held[1]})
        if not report.get("swapped"):
            log.info("%s: the twin no longer holds %s (%s); reloading in place", self._label, path, report.get("state"))
            return False
        self.last_swap = report
        log.debug("%s: swapped in %s: %s", self._label, path, {k: report[k] for k in ("tensors", "attributes")})
        self._undo = (str(report["holds"]), str(report["token"]))
        return True

    async def apply(self, path: str, restore: bool = False) -> None:
        """Under the pause: swap ``path`` in (``swap``), else reload it in place: through the extension, which also
        processes again the layers vLLM's reload leaves stale (a tied LM head on CPU:
        ``primerl_vllm_worker._reprocess_tied``), else through vLLM's own ``reload_weights``."""
        try:
            if await self.swap(path, restore):
                return
            if self.extension is not False:
                try:
                    await self._call("primerl_reload", {"weights_path": path})
                    self.extension = True
                    return
                except PrimeRLError as exc:
                    if NOT_IMPLEMENTED not in exc.message:
                        raise
                    self.extension = self.available = False
            await self._call("reload_weights", {"weights_path": path})
        except Unimplemented:
            raise Unimplemented(
                f"{self._label} has no /collective_rpc endpoint: start vLLM with VLLM_SERVER_DEV_MODE=1 "
                "(`primerl engine launch vllm` does) to allow weight reloads"
            ) from None
