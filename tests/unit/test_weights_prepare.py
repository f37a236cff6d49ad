"""server.weights.Weights.prepare: the checkpoint check before an update pauses anything (issue 36), gated on the
engine's capabilities, and its fallback when the served checkpoint cannot be read from the bridge."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from safetensors.numpy import save_file

from core.errors import InvalidArgument, Unimplemented
from core.types import Capability, EngineInfo
from server.weights import Weights

SERVED = {"model.embed_tokens.weight": np.zeros((10, 4), np.float32), "model.norm.weight": np.ones((4,), np.float32)}


class _Replica:
    """What Weights.prepare reads of an engine: its info (no generation happens here)."""

    def __init__(self, info: EngineInfo) -> None:
        self.info = info


def weights(base: Path, capabilities: set[Capability]) -> Weights:
    info = EngineInfo("embedded", "m", 10, 16, (0,), capabilities=frozenset(capabilities), base_weights=str(base))
    return Weights(cast(Any, [_Replica(info)]), mark=lambda *_: None)


def checkpoint(path: Path, tensors: dict[str, np.ndarray]) -> str:
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)


async def test_prepare_checks_against_the_served_checkpoint_and_returns_the_digest(tmp_path: Path) -> None:
    base = checkpoint(tmp_path / "base", SERVED)
    w = weights(Path(base), {Capability.WEIGHT_UPDATES, Capability.LOCAL_CHECKPOINTS})
    good = await w.prepare(checkpoint(tmp_path / "good", {**SERVED, "model.norm.weight": np.zeros(4, np.float32)}))
    assert good is not None and good.digest.startswith("xxh3-128:")
    with pytest.raises(InvalidArgument, match=r"model\.norm\.weight has shape \[3\]"):
        await w.prepare(checkpoint(tmp_path / "bad", {**SERVED, "model.norm.weight": np.ones(3, np.float32)}))


async def test_without_a_readable_served_checkpoint_only_completeness_is_checked(tmp_path: Path) -> None:
    w = weights(tmp_path / "elsewhere", {Capability.WEIGHT_UPDATES, Capability.LOCAL_CHECKPOINTS})
    other = checkpoint(tmp_path / "other", {"x": np.ones(3, np.float32)})  # complete, but no way to compare
    assert (await w.prepare(other)) is not None
    (Path(other) / "model.safetensors").write_bytes(b"\x10\x00\x00\x00")
    with pytest.raises(InvalidArgument, match="not a complete safetensors file"):
        await w.prepare(other)


async def test_engines_that_load_elsewhere_are_not_checked_and_engines_without_updates_refuse(tmp_path: Path) -> None:
    assert (await weights(tmp_path, {Capability.WEIGHT_UPDATES}).prepare(str(tmp_path / "missing"))) is None
    with pytest.raises(Unimplemented, match="cannot load new weights"):
        await weights(tmp_path, {Capability.LOCAL_CHECKPOINTS}).prepare(str(tmp_path))
