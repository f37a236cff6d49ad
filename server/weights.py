"""Weight updates and the policy version of one bridge's replicas.

Invariants:
- versions only move forward: one update at a time, each strictly greater than the current version;
- replicas never serve mixed versions: a replica whose update failed leaves rotation until an update
  reaches it (``mark``; the health check keeps it out while it is behind), and the error says which
  replicas were updated. A failed replica does not stop the update of the others.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from core.types import WeightUpdate
from engines.base import Engine
from server.errors import EngineError, InvalidArgument, Unimplemented

MAX_POLICY_VERSION = 2**63 - 1


class Weights:
    """The policy version of a set of replicas, and the one path that changes it."""

    def __init__(
        self,
        engines: Sequence[Engine],
        mark: Callable[[int, bool, str], None],
        updated: Callable[[int, int, float, float], None] | None = None,
    ) -> None:
        self.engines = engines
        self._mark = mark  # take a replica out of rotation (the router)
        # Told of each update that reached a replica: (previous version, new version, unix start, seconds taken).
        self._updated = updated
        self.removed: set[int] = set()  # replicas removed from the fleet (server.replicas): never updated
        self._lock = asyncio.Lock()

    @property
    def version(self) -> int:
        """The newest version any replica serves (a replica whose update failed is out of rotation)."""
        if len(self.engines) == 1:  # the common case, on every Step: no generator
            return self.engines[0].policy_version
        return max(e.policy_version for e in self.engines)

    def _check(self, version: int) -> None:
        current = self.version
        if version > MAX_POLICY_VERSION:
            raise InvalidArgument(f"policy_version must be at most {MAX_POLICY_VERSION} (int64), got {version}")
        if version <= current:
            raise InvalidArgument(f"policy_version {version} must be greater than the current version {current}")

    async def update(self, checkpoint_path: str, policy_version: int, keep_kv: bool) -> int:
        """Load a checkpoint on every replica; returns the new version (``policy_version`` or current + 1)."""
        return await self._apply([checkpoint_path] * len(self.engines), policy_version, keep_kv)

    async def reload(self, policy_version: int = 0) -> int:
        """Take every replica back to the weights it started from, as a new version (the KV of the trained
        weights is not reused: a new version salts the prefix cache anew)."""
        missing = [e.info.replica for e in self.engines if not e.info.base_weights]
        if missing:
            raise Unimplemented(
                f"engine {self.engines[0].info.engine!r} replicas {missing} do not know the weights they started "
                "from; load them with UpdateWeights (POST /update_weights) and their checkpoint directory"
            )
        return await self._apply([e.info.base_weights for e in self.engines], policy_version, False)

    async def _apply(self, paths: list[str], policy_version: int, keep_kv: bool) -> int:
        version = policy_version or self.version + 1
        self._check(version)
        info = self.engines[0].info
        if not info.supports_weight_updates:
            raise Unimplemented(f"engine {info.engine!r} cannot load new weights at run time")
        async with self._lock:
            self._check(version)  # another update may have landed while this one waited
            previous, began, clock = self.version, time.time(), time.perf_counter()
            done: list[str] = []
            failed: list[tuple[str, EngineError]] = []
            for i, (engine, path) in enumerate(zip(self.engines, paths, strict=True)):
                if i in self.removed:
                    continue
                try:
                    await engine.update_weights(
                        WeightUpdate(checkpoint_path=path, policy_version=version, keep_kv=keep_kv)
                    )
                except EngineError as exc:
                    # Go on with the others: one dead replica must not hold every replica at the old version.
                    self._mark(i, False, f"weight update to version {version} failed: {exc.message}")
                    failed.append((engine.info.replica, exc))
                    continue
                done.append(engine.info.replica)
            if failed and not done:
                raise failed[0][1]
            if self._updated is not None:
                self._updated(previous, version, began, time.perf_counter() - clock)
            if failed:
                names = ", ".join(f"{name!r} ({exc.message})" for name, exc in failed)
                raise EngineError(
                    f"weights updated to version {version} on {done} but failed on {names}; "
                    "out of rotation until an update reaches them"
                )
        return version
