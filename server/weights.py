"""Weight updates and the policy version of one bridge's replicas.

Invariants:
- versions only move forward: one update at a time, each strictly greater than the current version;
- a checkpoint is checked before anything pauses (``prepare``: files complete, the served model's tensors, shapes
  and dtypes, a content digest) where the engine loads it from a filesystem the bridge shares;
- replicas never serve mixed versions: a replica whose update failed leaves rotation until an update
  reaches it (``mark``; the health check keeps it out while it is behind), and the error says which
  replicas were updated. A failed replica does not stop the update of the others.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from core.types import Capability, WeightUpdate
from engines.base import Engine
from engines.checkpoint import Manifest, check_compatible, read_manifest
from server.errors import EngineError, InvalidArgument, Unimplemented

log = logging.getLogger(__name__)

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
        self._served: dict[str, Manifest | None] = {}  # base checkpoint -> its manifest (None: not readable here)

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

    async def prepare(self, checkpoint_path: str) -> Manifest | None:
        """The prepare phase, before anything pauses: read the checkpoint's manifest and digest and check it against
        the served model's; InvalidArgument names the file or tensor at fault. None where the engine loads
        checkpoints from a filesystem the bridge cannot check (``Capability.LOCAL_CHECKPOINTS``)."""
        info = self.engines[0].info
        if not info.supports_weight_updates:
            raise Unimplemented(f"engine {info.engine!r} cannot load new weights at run time")
        if Capability.LOCAL_CHECKPOINTS not in info.capabilities:
            return None
        began = time.perf_counter()
        manifest = await asyncio.to_thread(self._prepare, checkpoint_path, info.base_weights)
        log.info(
            "checkpoint %s checked in %.2f s: %d tensors, %.1f MB, %s",
            manifest.path, time.perf_counter() - began, len(manifest.tensors), manifest.nbytes / 1e6, manifest.digest,
        )  # fmt: skip
        return manifest

    def _prepare(self, path: str, base: str) -> Manifest:
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
