"""Memory model: weights, activation reserve and KV budget of one engine replica.

Everything is derived from a model's ``config.json`` fields (``ModelArch.from_config``) and
the memory of the device it runs on (a MIG slice's ``memorySizeMB`` or a whole GPU).

KV bytes per token (``../shared/reference/spec_mig_env.md`` B4):

* standard attention (MHA/GQA): ``2 x layers x kv_heads x head_dim x dtype_bytes``
  (K and V; divided across tensor-parallel ranks by kv heads);
* MLA (DeepSeek-V2/V3): one latent per layer, ``(kv_lora_rank + qk_rope_head_dim) x layers x
  dtype_bytes``, replicated on every rank;
* sliding-window layers hold at most ``window`` tokens of a sequence, so they cap the KV of
  one sequence, not the bytes per token.

The budget follows vLLM V1 (``gpu_worker.determine_available_memory``,
``kv_cache_utils.get_num_blocks``): ``requested = memory x gpu_memory_utilization``;
``available_kv = requested - (weights + activations + runtime)``;
``num_blocks = available_kv // page_size // num_layers`` with
``page_size = coef x block_size x kv_heads x head_size x dtype_bytes`` (coef 1 for MLA, else 2);
KV tokens = ``num_blocks x block_size``. The engine flags that realise a budget are
``--gpu-memory-utilization``, ``--kv-cache-memory-bytes`` and ``--max-num-seqs``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

GiB = 2**30

DTYPE_BYTES: dict[str, float] = {
    "float32": 4,
    "fp32": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
    # 4-bit weights carry one fp16 scale and zero per group of 128 (AWQ/GPTQ): 0.5 + 4/128.
    "int4": 0.5 + 4 / 128,
}


def dtype_bytes(name: str) -> float:
    try:
        return DTYPE_BYTES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} (known: {', '.join(sorted(DTYPE_BYTES))})") from None


@dataclass(frozen=True)
class ModelArch:
    """The architecture fields the memory and throughput models need."""

    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int
    tied_embeddings: bool
    torch_dtype: str
    attention_bias: bool = False
    # MLA (DeepSeek): a compressed latent per layer instead of K and V per head.
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # Sliding window: number of layers that attend to at most ``window`` tokens.
    window: int = 0
    sliding_layers: int = 0
    # Mixture of experts.
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    experts_per_tok: int = 0
    moe_intermediate: int = 0
    first_dense_layers: int = 0
    native_weight_dtype: str = ""  # e.g. "fp8" when the checkpoint is quantised

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> ModelArch:
        """Parse HF ``config.json`` fields; a missing required field raises ValueError naming it."""

        def need(key: str) -> Any:
            if key not in cfg:
                raise ValueError(f"config.json has no {key!r}")
            return cfg[key]

        layers = int(need("num_hidden_layers"))
        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        window = 0
        sliding = 0
        layer_types = cfg.get("layer_types")
        sw = cfg.get("sliding_window")
        if layer_types:  # newer HF configs (Gemma 2/3, Qwen3 hybrids) list each layer
            sliding = sum(1 for t in layer_types if t == "sliding_attention")
            window = int(sw or 0) if sliding else 0
        elif sw and cfg.get("model_type") in ("qwen2", "qwen2_moe", "qwen3"):
            if cfg.get("use_sliding_window"):  # Qwen: layers from max_window_layers on slide
                window = int(sw)
                sliding = max(0, layers - int(cfg.get("max_window_layers", layers)))
        elif sw:  # Mistral-style: every layer
            window, sliding = int(sw), layers
        if window and window >= int(cfg.get("max_position_embeddings", 0) or 0) > 0:
            window, sliding = 0, 0  # a window as long as the context changes nothing
        quant = (cfg.get("quantization_config") or {}).get("quant_method", "")
        return cls(
            model_type=str(cfg.get("model_type", "")),
            layers=layers,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            vocab=int(need("vocab_size")),
            intermediate=int(need("intermediate_size")),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type") in ("qwen2", "qwen2_moe"))),
            kv_lora_rank=int(cfg.get("kv_lora_rank") or 0),
            qk_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 0),
            q_lora_rank=int(cfg.get("q_lora_rank") or 0),
            qk_nope_head_dim=int(cfg.get("qk_nope_head_dim") or 0),
            v_head_dim=int(cfg.get("v_head_dim") or 0),
            window=window,
            sliding_layers=sliding,
            n_routed_experts=int(
                cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts") or 0
            ),
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
            moe_intermediate=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
            first_dense_layers=int(cfg.get("first_k_dense_replace") or 0),
            native_weight_dtype="fp8" if quant == "fp8" else "",
        )

    # ---- KV cache -------------------------------------------------------------------------

    def kv_heads_per_rank(self, tp: int = 1) -> int:
        """KV heads one rank caches: heads are split across ranks, replicated when fewer."""
        return 1 if self.mla else max(1, self.kv_heads // tp)

    def kv_head_size(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim if self.mla else self.head_dim

    def kv_bytes_per_token(self, kv_dtype_bytes: float = 2, tp: int = 1) -> int:
        """Bytes of KV cache one token occupies on one rank, over all layers."""
        coef = 1 if self.mla else 2
        return int(coef * self.layers * self.kv_heads_per_rank(tp) * self.kv_head_size() * kv_dtype_bytes)

    def page_size_bytes(self, block_size: int, kv_dtype_bytes: float = 2, tp: int = 1) -> int:
        """vLLM's per-layer page: coef x block_size x kv_heads x head_size x dtype."""
        coef = 1 if self.mla else 2
        return int(coef * block_size * self.kv_heads_per_rank(tp) * self.kv_head_size() * kv_dtype_bytes)

    def blocks_per_sequence(self, tokens: int, block_size: int) -> int:
        """Blocks (summed over layers, in units of one layer's page) one sequence of ``tokens`` holds."""
        full = math.ceil(tokens / block_size)
        held = math.ceil(min(tokens, self.window) / block_size) if self.sliding_layers else full
        return (self.layers - self.sliding_layers) * full + self.sliding_layers * held

    # ---- weights --------------------------------------------------------------------------

    def _attention_params(self) -> int:
        h = self.hidden
        if self.mla:
            q = (
                h * self.q_lora_rank
                + self.q_lora_rank
                + self.q_lora_rank * self.heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
            )
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
            kv += self.kv_lora_rank * self.heads * (self.qk_nope_head_dim + self.v_head_dim)
            o = self.heads * self.v_head_dim * h
            return q + kv + o
        q = h * self.heads * self.head_dim
        kv = 2 * h * self.kv_heads * self.head_dim
        o = self.heads * self.head_dim * h
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.attention_bias else 0
        return q + kv + o + bias

    def _mlp_params(self, active_only: bool) -> int:
        dense = 3 * self.hidden * self.intermediate
        if not self.n_routed_experts:
            return self.layers * dense
        expert = 3 * self.hidden * self.moe_intermediate
        routed = self.experts_per_tok if active_only else self.n_routed_experts
        moe = (routed + self.n_shared_experts) * expert + self.hidden * self.n_routed_experts
        return self.first_dense_layers * dense + (self.layers - self.first_dense_layers) * moe

    def linear_params(self, active_only: bool = False) -> int:
        """Parameters of the decoder's linear layers (the ones quantisation applies to)."""
        return self.layers * self._attention_params() + self._mlp_params(active_only)

    def other_params(self) -> int:
        """Embeddings, LM head and norms (kept in the compute dtype by quantisers)."""
        emb = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return emb + (2 * self.layers + 1) * self.hidden

    def num_params(self) -> int:
        return self.linear_params() + self.other_params()

    def active_params(self) -> int:
        """Parameters touched per token (MoE: routed experts per token + shared)."""
        return self.linear_params(active_only=True) + self.other_params()

    def weights_bytes(self, weight_dtype: str, tp: int = 1) -> int:
        """Weight bytes on one rank for ``weight_dtype`` (bf16, fp8, int4, ...)."""
        q = dtype_bytes(weight_dtype)
        base = min(2.0, dtype_bytes(self.torch_dtype))
        return int((self.linear_params() * q + self.other_params() * base) / tp)

    def activation_bytes(self, max_num_batched_tokens: int, max_num_seqs: int, tp: int = 1) -> int:
        """Peak activation estimate for vLLM's profiling run, plus a runtime reserve.

        Hidden states and MLP intermediates of one batched forward pass in bf16, fp32 logits
        for ``max_num_seqs`` samplers, and 0.5 GiB for CUDA graphs and non-torch allocations
        (the reference's worked example uses about 1.5 GiB for a 7B model; this gives 1.3).
        """
        inter = self.moe_intermediate * max(1, self.experts_per_tok) if self.n_routed_experts else self.intermediate
        per_token = (4 * self.hidden + 2 * inter / tp) * 2
        logits = max_num_seqs * self.vocab * 4
        return int(max_num_batched_tokens * per_token + logits + 0.5 * GiB)


def load_config_json(ref: str | Path, base: Path | None = None) -> dict[str, Any]:
    """A config.json by path (relative to ``base``) or a bundled name such as ``qwen2.5-7b``."""
    path = Path(ref)
    if base is not None and not path.is_absolute():
        path = base / path
    if path.suffix == ".json" and path.exists():
        data: dict[str, Any] = json.loads(path.read_text())
        return data
    bundled = resources.files("placement.mig") / "model_configs" / f"{ref}.json"
    if bundled.is_file():
        out: dict[str, Any] = json.loads(bundled.read_text())
        return out
    raise FileNotFoundError(f"{ref}: neither a config.json file nor a bundled config ({', '.join(bundled_configs())})")


def bundled_configs() -> list[str]:
    root = resources.files("placement.mig") / "model_configs"
    return sorted(p.name.removesuffix(".json") for p in root.iterdir() if p.name.endswith(".json"))


@dataclass(frozen=True)
class KvBudget:
    """What one engine replica on ``memory_bytes`` of device memory can hold."""

    memory_bytes: int
    gpu_memory_utilization: float
    weights_bytes: int
    activation_bytes: int
    available_kv_bytes: int  # may be negative: the model does not fit
    page_size_bytes: int
    num_blocks: int
    block_size: int
    kv_tokens: int
    max_model_len: int
    max_concurrent_seqs: int  # sequences of max_model_len tokens that fit at once
    kv_cache_bytes: int  # num_blocks x page_size x layers: the exact --kv-cache-memory-bytes

    @property
    def fits(self) -> bool:
        return self.max_concurrent_seqs >= 1

    def engine_flags(self, max_num_seqs: int, tp: int = 1) -> list[str]:
        """vLLM flags that realise this budget (``--kv-cache-memory-bytes`` wins over utilisation)."""
        flags = [
            "--gpu-memory-utilization",
            f"{self.gpu_memory_utilization:g}",
            "--kv-cache-memory-bytes",
            str(self.kv_cache_bytes),
            "--max-num-seqs",
            str(max(1, min(max_num_seqs, self.max_concurrent_seqs))),
            "--max-model-len",
            str(self.max_model_len),
            "--block-size",
            str(self.block_size),
        ]
        if tp > 1:
            flags += ["--tensor-parallel-size", str(tp)]
        return flags


def kv_budget(
    arch: ModelArch,
    memory_bytes: int,
    *,
    weight_dtype: str,
    kv_dtype: str,
    gpu_memory_utilization: float,
    block_size: int,
    max_model_len: int,
    activation_bytes: int,
    tp: int = 1,
) -> KvBudget:
    """The vLLM V1 budget for one rank with ``memory_bytes`` of device memory."""
    weights = arch.weights_bytes(weight_dtype, tp)
    requested = int(memory_bytes * gpu_memory_utilization)
    available = requested - weights - activation_bytes
    page = arch.page_size_bytes(block_size, dtype_bytes(kv_dtype), tp)
    blocks = max(0, available) // page // arch.layers
    per_seq_blocks = arch.blocks_per_sequence(max_model_len, block_size)
    concurrent = (blocks * arch.layers) // per_seq_blocks if per_seq_blocks else 0
    return KvBudget(
        memory_bytes=memory_bytes,
        gpu_memory_utilization=gpu_memory_utilization,
        weights_bytes=weights,
        activation_bytes=activation_bytes,
        available_kv_bytes=available,
        page_size_bytes=page,
        num_blocks=blocks,
        block_size=block_size,
        kv_tokens=blocks * block_size,
        max_model_len=max_model_len,
        max_concurrent_seqs=concurrent,
        kv_cache_bytes=blocks * page * arch.layers,
    )
