"""peft LoRA adapters for SmolLM2, made here (no hub): the tests' and benchmarks' adapter directories, and what
transformers + peft computes with them (the reference a LoRA-serving engine must match)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rl_client import WeightProof, weight_proof

TARGETS = ["q_proj", "v_proj", "o_proj"]
STORY = (
    "The old lighthouse keeper climbed the stairs every evening to light the lamp. One night a storm rolled in from "
    "the sea, and the waves rose higher than he had ever seen. Far out on the water a small boat was struggling "
    "against the wind. He lit the lamp, wrapped himself in his coat and watched as the boat turned towards the "
    "light. By morning the storm had passed, and a young fisherman knocked on his door to thank him. The keeper "
    "smiled and said"
)  # 93 tokens: two full 32-token vLLM KV blocks and more


def make_adapter(model_dir: Path, out: Path, seed: int, rank: int = 8, targets: list[str] = TARGETS) -> Path:
    """A peft LoRA adapter (rank ``rank`` on ``targets``: the q, v and o projections) with seeded random weights,
    saved to ``out`` (peft starts B at zero: that adapter would be the base model)."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(str(out))
    return out


def with_adapter(model_dir: Path, adapter: Path | None) -> Any:
    """SmolLM2 in float32 with ``adapter`` applied by peft (None: the base model), in eval mode."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter))
    return model.eval()


def greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt`` (no EOS stop)."""
    import torch

    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(torch.argmax(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1])))
    return ids[len(prompt) :]


def adapter_proof(model_dir: Path, adapter: Path) -> WeightProof:
    """The caller's proof of an adapter version: the probe's logprobs under transformers + peft."""
    return weight_proof(with_adapter(model_dir, adapter))
