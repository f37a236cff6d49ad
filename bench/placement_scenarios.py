"""Synthetic fleets and demands for tests and ``bench/placement.py`` (seeded, reproducible; a fixture, not shipped).

``random_small`` draws the small instances on which the heuristic is compared with the ILP;
``mixed_small_models`` is many small models with modest demand (where MIG pays off);
``large_fleet`` is the 1,024-GPU scale test.
"""

from __future__ import annotations

import random

from placement.mig.config import DemandSpec, FleetFile, ModelsFile, ModelSpec, NodeSpec
from placement.mig.memory import ModelArch, load_config_json

SMALL_MODELS = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "llama-3.1-8b", "mistral-7b-v0.1")
_ARCHS: dict[str, ModelArch] = {}


def arch(name: str) -> ModelArch:
    if name not in _ARCHS:
        _ARCHS[name] = ModelArch.from_config(load_config_json(name))
    return _ARCHS[name]


def _models(specs: list[ModelSpec], configs: list[str]) -> tuple[ModelsFile, dict[str, ModelArch]]:
    return ModelsFile(models=specs), {s.name: arch(c) for s, c in zip(specs, configs, strict=True)}


def random_small(rng: random.Random) -> tuple[FleetFile, ModelsFile, dict[str, ModelArch]]:
    """1-2 nodes of 1-4 GPUs (A100-80GB, H100-80GB, H200), 2-5 models of up to 8B with random demand."""
    nodes = [
        NodeSpec(name=f"n{i}", gpu=rng.choice(["A100-80GB", "H100-80GB", "H200"]), count=rng.choice([1, 2, 4]))
        for i in range(rng.randint(1, 2))
    ]
    configs = [rng.choice(SMALL_MODELS) for _ in range(rng.randint(2, 5))]
    specs = [
        ModelSpec(
            name=f"m{i}-{c}",
            config=c,
            demand=DemandSpec(
                tokens_per_s=rng.choice([500, 1000, 2000, 5000, 10000, 20000, 40000]),
                context_len=rng.choice([2048, 4096, 8192, 16384]),
                itl_ms=rng.choice([None, None, 30.0, 60.0]),
            ),
            weight=rng.choice([1.0, 1.0, 2.0]),
        )
        for i, c in enumerate(configs)
    ]
    return FleetFile(nodes=nodes), *_models(specs, configs)


def mixed_small_models(
    gpus: int = 8, models: int = 24, tokens_per_s: float = 1500, gpu: str = "H100-80GB"
) -> tuple[FleetFile, ModelsFile, dict[str, ModelArch]]:
    """Many distinct small models (fine-tunes, reward/judge models) with modest demand each."""
    fleet = FleetFile(nodes=[NodeSpec(name=f"node{i}", gpu=gpu, count=8) for i in range(max(1, gpus // 8))])
    configs = [SMALL_MODELS[i % 4] for i in range(models)]  # 0.5B, 1.5B, 7B, 8B in turn
    specs = [
        ModelSpec(name=f"ft{i}-{c}", config=c, demand=DemandSpec(tokens_per_s=tokens_per_s, context_len=4096))
        for i, c in enumerate(configs)
    ]
    return fleet, *_models(specs, configs)


def large_fleet(
    gpus: int = 1024, models: int = 40, seed: int = 0
) -> tuple[FleetFile, ModelsFile, dict[str, ModelArch]]:
    """``gpus`` GPUs in 8-GPU nodes of three types, ``models`` models, demand near fleet capacity."""
    rng = random.Random(seed)
    types = ["A100-80GB", "H100-80GB", "H200"]
    fleet = FleetFile(nodes=[NodeSpec(name=f"node{i:04d}", gpu=types[i % 3], count=8) for i in range(gpus // 8)])
    configs = [rng.choice(SMALL_MODELS) for _ in range(models)]
    specs = [
        ModelSpec(
            name=f"m{i}-{c}",
            config=c,
            demand=DemandSpec(tokens_per_s=rng.uniform(2e3, 2e5), context_len=rng.choice([4096, 8192])),
        )
        for i, c in enumerate(configs)
    ]
    return fleet, *_models(specs, configs)
