"""``trtllm``: adapter for TensorRT-LLM's ``trtllm-serve`` ``/v1/completions``, token ids in and out.

Wire format (``../shared/reference/engine_api_contracts.md`` §3): request validation is
strict (``extra="forbid"``), so only fields the server knows are sent, ``model`` is
required, and there is no ``cache_salt``/``return_token_ids``. Generated ids come back in
``choices[0].token_ids`` only with ``"detokenize": false``. ``logprobs: 0`` returns nothing,
so ``logprobs: 1`` is sent. Streams carry deltas, then a usage chunk, then ``[DONE]``.

Invariants
----------
* Every accepted sampling knob is sent explicitly, with an explicit ``max_tokens``
  (TRT-LLM's default is unbounded).
* ``-9999.0`` (TRT-LLM's clamp of -inf) is read as -inf; ``top_logprobs`` is not used
  (it may be ``[]``, unaligned with the tokens).
* Cached prompt tokens come from ``usage.prompt_tokens_details.cached_tokens`` (always sent).
* Weight updates are UNIMPLEMENTED: ``/update_weights`` takes CUDA IPC handles (same node
  only), not a checkpoint directory. Without updates the policy version never changes, so
  the missing ``cache_salt`` cannot mix KV of different weights.
* Abort = dropping the connection (trtllm-serve polls for disconnects).
"""

from __future__ import annotations

from typing import Any, ClassVar

from core.errors import Unimplemented
from core.types import GenerateRequest, WeightUpdate
from engines.http.openai_compat import OpenAICompletionsEngine


class TrtllmEngine(OpenAICompletionsEngine):
    """One trtllm-serve server (see module docstring)."""

    engine_name: ClassVar[str] = "trtllm"
    generate_path: ClassVar[str] = "/v1/completions"
    missing_ids_hint: ClassVar[str] = "the server ignored detokenize=false"

    def build_payload(self, request: GenerateRequest, salt: str) -> dict[str, Any]:
        return {
            **self.completions_payload(request),
            "top_k": request.params.top_k,  # 0 disables top-k in TRT-LLM
            "logprobs": 1,
            "detokenize": False,
        }

    async def update_weights(self, update: WeightUpdate) -> None:
        raise Unimplemented(
            f"{self.label} cannot load weights from a directory: trtllm-serve's /update_weights takes CUDA IPC "
            "handles from a process on the same node; restart trtllm-serve on the new checkpoint instead"
        )
