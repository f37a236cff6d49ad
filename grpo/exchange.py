"""What the orchestrator and the trainer hand each other on one machine: rollout batches and weights, as files.

Layout of a run directory (``out_dir``), as prime-rl lays out its own:

* ``rollouts/step_S.pkl``: the orchestrator's batch ``S`` (0-based: the batch that trains policy ``S`` into
  ``S + 1``), written to a temporary name and renamed, so the trainer never reads half a batch;
* ``weights/step_N/model.safetensors``: the trainer's policy ``N`` (``N`` updates done; ``step_0`` is the base
  model), written to ``step_N.tmp`` and renamed; the orchestrator has the bridge load it as policy version ``N``;
* ``checkpoints/trainer/step_N/``: the trainer's model, optimizer, RNGs and algorithm state, and hard links to the
  weights the orchestrator needs to resume (``step_{N-k} .. step_N``); ``checkpoints/orchestrator/step_N/
  progress.json``: the orchestrator's progress (next batch, tokens, samples, problems). Inference is stateless.

Batch ``S`` is sampled from policy ``max(0, S - k)`` exactly (``k`` = ``max_async_level``), whatever the relative
speed of the two processes: the orchestrator waits for that policy's weights, and never uses newer ones. That makes
an asynchronous run reproducible (a resumed run equals an uninterrupted one) while rollouts of batch ``S`` overlap
the training on batch ``S - 1``.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ExchangeError(RuntimeError):
    """A batch or weights directory that is missing, malformed, or from the wrong step or policy."""


def sampling_policy(step: int, max_async_level: int) -> int:
    """The policy batch ``step`` is sampled from: ``max(0, step - k)``."""
    return max(0, step - max_async_level)


@dataclass
class Batch:
    """One orchestrator batch, as the trainer receives it."""

    step: int
    policy: int  # the policy version the orchestrator had the bridge serve while sampling it
    weights_id: str  # the id of the weights directory of that policy (``RunDir.weights_id``)
    trajectories: list[Any]
    stats: dict[str, float] = field(default_factory=dict)
    started_at: float = 0.0  # wall clock (time.time) of the first and last rollout
    ended_at: float = 0.0

    def token_versions(self) -> tuple[int, int]:
        """(oldest, newest) policy version over the batch's sampled tokens, as the bridge recorded them."""
        import numpy as np

        seen = [
            np.asarray(t.tokens.policy_versions)[np.asarray(t.tokens.loss_mask, dtype=bool)] for t in self.trajectories
        ]
        versions = np.concatenate(seen) if seen else np.zeros(0, dtype=np.int64)
        if not versions.size:
            return self.policy, self.policy
        return int(versions.min()), int(versions.max())


class RunDir:
    """Paths of one run directory and the atomic writes/reads between the components."""

    def __init__(self, out_dir: str | Path, ckpt_dir: str | Path = "") -> None:
        self.root = Path(out_dir)
        self.ckpt = Path(ckpt_dir) if ckpt_dir else self.root / "checkpoints"

    # -- paths -------------------------------------------------------------------------------------

    def batch_path(self, step: int) -> Path:
        return self.root / "rollouts" / f"step_{step}.pkl"

    def weights(self, policy: int) -> Path:
        return self.root / "weights" / f"step_{policy}"

    def trainer_ckpt(self, step: int) -> Path:
        return self.ckpt / "trainer" / f"step_{step}"

    def orchestrator_ckpt(self, step: int) -> Path:
        return self.ckpt / "orchestrator" / f"step_{step}" / "progress.json"

    # -- batches -----------------------------------------------------------------------------------

    def write_batch(self, batch: Batch) -> Path:
        path = self.batch_path(batch.step)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("wb") as f:
            pickle.dump(batch, f, protocol=pickle.HIGHEST_PROTOCOL)
        tmp.replace(path)
        return path

    def read_batch(self, step: int) -> Batch:
        path = self.batch_path(step)
        try:
            with path.open("rb") as f:
                batch = pickle.load(f)  # our own orchestrator's file in our own run directory
        except FileNotFoundError:
            raise ExchangeError(f"no rollout batch for step {step} at {path}") from None
        except (pickle.UnpicklingError, EOFError, AttributeError) as exc:
            raise ExchangeError(f"rollout batch {path} is unreadable: {exc}") from exc
        if not isinstance(batch, Batch):
            raise ExchangeError(f"{path} holds a {type(batch).__name__}, not a rollout batch")
        if batch.step != step:
            raise ExchangeError(f"{path} holds the batch of step {batch.step}, not of step {step}")
        return batch

    # -- weights -----------------------------------------------------------------------------------

    def write_weights(self, policy: int, save: Callable[[Path], Any]) -> str:
        """``save(tmp_dir)`` writes the weights; the directory appears as ``weights/step_N`` in one rename (an
        older directory of that name, from an earlier run, is replaced). Returns the new directory's id: a random
        token in its ``weights_id`` file, which every batch sampled from it carries, so that the trainer trains
        only on batches sampled from weights it wrote (never on a stale batch an earlier run left behind)."""
        final = self.weights(policy)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        save(tmp)
        token = uuid.uuid4().hex
        (tmp / "weights_id").write_text(token)
        shutil.rmtree(final, ignore_errors=True)
        tmp.replace(final)
        return token

    @staticmethod
    def weights_id(directory: Path) -> str:
        try:
            return (directory / "weights_id").read_text().strip()
        except FileNotFoundError:
            raise ExchangeError(f"{directory} is no weights directory of a trainer (no weights_id file)") from None

    def clear_after(self, step: int) -> None:
        """Remove an earlier run's batches from ``step`` on and weights after ``step`` (``primerl rl`` does this
        before it starts the components in a run directory it resumes in)."""
        for sub, first in (("rollouts", step), ("weights", step + 1)):
            d = self.root / sub
            for p in d.glob("step_*") if d.is_dir() else ():
                n = p.name[5:].split(".")[0]
                if n.isdigit() and int(n) >= first:
                    shutil.rmtree(p) if p.is_dir() else p.unlink()

    def policy_weights(self, policy: int, resume_step: int | None, max_async_level: int) -> Path | None:
        """Where ``policy``'s weights are: the run's ``weights/step_N``, else (resuming at ``resume_step``) the
        trainer checkpoint's link; None while the trainer has not written them; ``ExchangeError`` when a resumed
        run needs a policy its checkpoint does not hold."""
        d = self.weights(policy)
        if d.is_dir():
            return d
        if resume_step is not None and policy <= resume_step:
            c = self.trainer_ckpt(resume_step) / "weights" / f"step_{policy}"
            if c.is_dir():
                return c
            raise ExchangeError(
                f"policy {policy}: no weights directory at {d} nor at {c} (resuming at step {resume_step} with "
                f"max_async_level = {max_async_level} needs the trainer checkpoint's policies "
                f"{sampling_policy(resume_step, max_async_level)}..{resume_step})"
            )
        return None

    def prune_weights(self, keep_from: int) -> None:
        """Delete ``weights/step_N`` for ``N < keep_from`` (a checkpoint keeps its own hard links)."""
        d = self.root / "weights"
        for p in d.glob("step_*") if d.is_dir() else ():
            n = p.name[5:]
            if n.isdigit() and int(n) < keep_from:
                shutil.rmtree(p, ignore_errors=True)

    def link_weights_into(self, ckpt: Path, policies: range) -> None:
        """Hard links (a copy across file systems) of ``weights/step_N`` for ``policies`` under ``ckpt/weights``."""
        for n in policies:
            src = self.weights(n)
            dst = ckpt / "weights" / f"step_{n}"
            if not src.is_dir() or dst.exists():
                continue
            try:
                shutil.copytree(src, dst, copy_function=os.link)
            except OSError:
                shutil.rmtree(dst, ignore_errors=True)
                shutil.copytree(src, dst)

    # -- orchestrator progress -----------------------------------------------------------------------

    def write_progress(self, step: int, progress: dict[str, Any]) -> Path:
        path = self.orchestrator_ckpt(step)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(progress, indent=1))
        tmp.replace(path)
        return path

    def read_progress(self, step: int) -> dict[str, Any]:
        path = self.orchestrator_ckpt(step)
        if not path.is_file():
            have = sorted(p.name for p in path.parent.parent.glob("step_*")) if path.parent.parent.is_dir() else []
            raise ExchangeError(f"no orchestrator checkpoint for step {step} at {path}; checkpoints: {have or 'none'}")
        return dict(json.loads(path.read_text()))


def wait_for(ready: Callable[[], bool], what: str, timeout_s: float, poll_s: float = 0.2) -> None:
    """Poll ``ready()`` until true; ``ExchangeError`` naming ``what`` after ``timeout_s`` (0 = wait forever)."""
    deadline = time.monotonic() + timeout_s if timeout_s else None
    while not ready():
        if deadline is not None and time.monotonic() > deadline:
            raise ExchangeError(f"waited {timeout_s:.0f} s for {what}")
        time.sleep(poll_s)


__all__ = ["Batch", "ExchangeError", "RunDir", "sampling_policy", "wait_for"]
