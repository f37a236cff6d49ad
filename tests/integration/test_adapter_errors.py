"""LoRA adapter requests that cannot be served get a status that says why, and change nothing (toy engine: it serves
no adapters, like TensorRT-LLM here). Serving them is tests/integration/test_lora_vllm.py's."""

from __future__ import annotations

from typing import Any

import pytest

from rl_client.errors import BridgeError


async def _code(call: Any) -> tuple[str, str]:
    with pytest.raises(BridgeError) as err:
        await call
    return err.value.code.name, err.value.details


async def test_adapter_requests_on_an_engine_without_lora(bridge: Any) -> None:
    _, client = bridge
    code, details = await _code(client.start_episode([5, 6, 7], adapter="math"))
    assert code == "INVALID_ARGUMENT" and "unknown adapter 'math' (loaded: none)" in details
    code, details = await _code(client.score_tokens([5, 6, 7], 1, adapter="math"))
    assert code == "INVALID_ARGUMENT" and "unknown adapter 'math'" in details
    code, details = await _code(client.update_weights("/nowhere", adapter="math v2"))
    assert code == "INVALID_ARGUMENT" and "adapter name 'math v2' is not valid" in details
    code, details = await _code(client.update_weights("/nowhere", adapter="math"))
    assert code == "UNIMPLEMENTED" and "cannot serve LoRA adapters" in details
    code, details = await _code(client.update_weights("/nowhere", adapter="math", policy_version=-1))
    assert code == "INVALID_ARGUMENT"
    info = (await client.server_info()).models[0]
    assert dict(info.adapters) == {} and info.policy_version == 0
    started = await client.start_episode([5, 6, 7], sampling={"max_tokens": 3})  # the base model serves on
    traj = await client.end_episode(started.episode_id)
    assert traj.adapter == ""
