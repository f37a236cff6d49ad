"""Cost coefficients, quantization tiers and the hardware the simulator prices.

Engine step time uses the DistServe form (``../shared/reference/ecosystem_contracts.md``):

* prefill of a batch of prompts: ``a + b*sum(len) + c*sum(len^2)`` ms;
* one decode iteration: ``a + b*sum(ctx_tokens) + c*batch`` ms, plus ``d`` ms when the iteration runs more than
  one sequence (``decode_multi``). DistServe's GPU form has no such term (``d = 0`` in the published set); on a
  CPU it is the largest effect there is: torch runs a one-row decode as matrix-vector products (weights streamed
  once) and two or more rows as GEMMs that pack the weights first, so SmolLM2-135M's decode costs ~56 ms for
  one sequence and ~100 ms flat for 2 to 8 (``bench/llmserve_fit.py``; ``torch.mm`` alone shows the same step).

Two coefficient sets are planned. ``DISTSERVE_A100_OPT13B`` is the published one: DistServe's
simulator profile of OPT-13B on one A100-80GB SXM (tp=1, pp=1), ``simdistserve/estimators``
(``profiler-a100-80g.distserve.json`` / ``fit_params``): prefill intercept 18.89 ms, 0.0948 ms per
prompt token, 4.03e-6 ms per squared prompt token; decode intercept 19.88 ms, 6.11e-4 ms per context
token, 0.0682 ms per sequence. ``embedded_smollm2_cpu()`` is fitted by ``bench/llmserve_fit.py`` from
measurements of this project's embedded engine (SmolLM2-135M on torch CPU: the forwards the engine runs,
held-out shapes checked) and ships as ``data/coeffs_embedded_smollm2_cpu.json``; real mode's engine is
what it describes.

Quantization tiers change weight bytes (``placement.mig.memory.DTYPE_BYTES``: fp16 2, int8 1, int4
0.53 bytes per weight), step time (decode is memory-bound and speeds up with fewer weight bytes;
prefill is compute-bound and pays a dequantisation cost at INT4) and a documented quality penalty:
the fraction of each generated token's value lost, in the range of published perplexity/accuracy
drops of W8A16 (LLM.int8, ~0-1%) and W4A16 (AWQ/GPTQ, ~2-5%) weight-only quantization.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache
from pathlib import Path


@dataclass(frozen=True)
class CostCoefficients:
    """DistServe-form step-time model in milliseconds."""

    name: str
    source: str
    prefill_a: float
    prefill_b: float
    prefill_c: float
    decode_a: float
    decode_b: float
    decode_c: float
    decode_multi: float = 0.0  # extra ms of an iteration over two or more sequences (see the module docstring)

    def prefill_ms(self, lens: list[int]) -> float:
        if not lens:
            return 0.0
        return self.prefill_a + self.prefill_b * sum(lens) + self.prefill_c * sum(n * n for n in lens)

    def decode_ms(self, ctx_tokens: float, batch: float) -> float:
        if batch <= 0:
            return 0.0
        multi = self.decode_multi if batch > 1 else 0.0
        return self.decode_a + self.decode_b * ctx_tokens + self.decode_c * batch + multi


DISTSERVE_A100_OPT13B = CostCoefficients(
    name="distserve-a100-80g-opt-13b",
    source="DistServe (OSDI'24) simdistserve profile, OPT-13B, 1x A100-80GB SXM, tp=1 pp=1",
    prefill_a=18.891,
    prefill_b=0.0948,
    prefill_c=4.03e-6,
    decode_a=19.878,
    decode_b=6.11e-4,
    decode_c=0.0682,
)

COEFFS_FILE = Path(__file__).with_name("data") / "coeffs_embedded_smollm2_cpu.json"


def load_coefficients(path: Path) -> CostCoefficients:
    """A fitted coefficient set (``bench/llmserve_fit.py``'s output; its measurements ride along, unused)."""
    raw = json.loads(path.read_text())
    return CostCoefficients(**{k: v for k, v in raw.items() if k in CostCoefficients.__dataclass_fields__})


@lru_cache(maxsize=1)
def embedded_smollm2_cpu() -> CostCoefficients:
    """The set fitted to the embedded engine (read on first use)."""
    return load_coefficients(COEFFS_FILE)


# OPT-13B in the config.json fields placement's memory model reads. OPT's MLP has two matrices of
# 5120 x 20480; placement counts llama's three, so intermediate_size = 2/3 x 20480 keeps the
# parameter count (12.9 B) and hence the weight bytes right.
OPT_13B_CONFIG: dict[str, object] = {
    "model_type": "opt",
    "num_hidden_layers": 40,
    "hidden_size": 5120,
    "num_attention_heads": 40,
    "num_key_value_heads": 40,
    "vocab_size": 50272,
    "intermediate_size": 13653,
    "tie_word_embeddings": True,
    "torch_dtype": "float16",
    "max_position_embeddings": 2048,
}


class QuantTier(StrEnum):
    FP16 = "FP16"
    INT8 = "INT8"
    INT4 = "INT4"


@dataclass(frozen=True)
class TierModel:
    """What a quantization tier changes."""

    weight_dtype: str
    prefill_scale: float
    decode_scale: float
    quality_penalty: float


TIERS: dict[QuantTier, TierModel] = {
    QuantTier.FP16: TierModel("fp16", prefill_scale=1.0, decode_scale=1.0, quality_penalty=0.0),
    QuantTier.INT8: TierModel("int8", prefill_scale=0.95, decode_scale=0.70, quality_penalty=0.01),
    QuantTier.INT4: TierModel("int4", prefill_scale=1.10, decode_scale=0.55, quality_penalty=0.04),
}


@dataclass(frozen=True)
class Hardware:
    """The GPU a task runs on."""

    name: str
    memory_gib: float
    price_per_hour: float  # USD, on-demand list price order of magnitude; cost is relative anyway
    kv_transfer_gb_s: float  # prefill -> decode KV transfer when the phases are split


A100_80G = Hardware("A100-80GB", memory_gib=80.0, price_per_hour=4.0, kv_transfer_gb_s=25.0)
A100_40G = Hardware("A100-40GB", memory_gib=40.0, price_per_hour=3.0, kv_transfer_gb_s=25.0)
# By name, as the task table (``data/tasks.json``) names a task's GPU.
HARDWARE = {h.name: h for h in (A100_80G, A100_40G)}
