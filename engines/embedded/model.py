"""The embedded engine's model loading and the state its scheduler keeps per running sequence and batch."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from core.errors import EngineUnavailable
from core.types import FinishReason, GenerateRequest, TokenChunk
from engines.chat import HFTokenizer
from engines.config import EmbeddedConfig

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel
    from transformers.cache_utils import DynamicCache

log = logging.getLogger("engines.embedded.engine")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(slots=True, eq=False)
class Seq:
    """One running generation. ``ids`` is the whole history; the KV covers ``ids[:cached]``."""

    request: GenerateRequest
    queue: asyncio.Queue[TokenChunk | BaseException]
    rng: np.random.Generator
    budget: int
    stops: frozenset[int]
    ids: list[int]
    cache: DynamicCache | None = None
    cached: int = 0
    logits: torch.Tensor | None = None  # next-token logits after ``ids``, once computed
    deferred: int = 0  # leading fed tokens that are last turn's sampled token(s)
    reused: int = 0  # prompt tokens whose KV was reused (usage.cached_tokens)
    produced: int = 0
    in_batch: bool = False
    share_prompt: bool = False  # first member of a GRPO group: keep the prompt's KV for the others
    stop_requested: bool = False
    finish: FinishReason | None = None


@dataclass(slots=True)
class Batch:
    rows: list[Seq]
    cache: DynamicCache
    mask: torch.Tensor  # [B, T] 1 for real positions, 0 for left padding


@dataclass(slots=True)
class Loaded:
    model: PreTrainedModel
    tokenizer: HFTokenizer
    name: str
    max_model_len: int
    model_dir: str = ""  # the checkpoint directory it was loaded from


def load_model(config: EmbeddedConfig, model: str) -> Loaded:
    """Resolve (converting the bundled GGUF once if needed) and load the model. Blocking; seconds when cached."""
    import torch
    import transformers

    from engines.model_store import ModelStoreError, load_model_and_tokenizer, resolve_model_dir

    transformers.utils.logging.disable_progress_bar()
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    cache_dir = Path(config.model_cache).expanduser() if config.model_cache else None
    try:
        model_dir = resolve_model_dir(model or None, cache_dir=cache_dir, progress=lambda m: log.info("model: %s", m))
        hf_model, hf_tokenizer = load_model_and_tokenizer(model_dir)
    except ModelStoreError as exc:
        raise EngineUnavailable(f"embedded engine cannot load model {model or DEFAULT_MODEL_NAME!r}: {exc}") from exc
    eos = hf_model.config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    limit = int(getattr(hf_model.config, "max_position_embeddings", config.max_model_len))
    path = Path(model).expanduser() if model else None
    name = path.name if path is not None and path.exists() else (model or DEFAULT_MODEL_NAME)
    return Loaded(hf_model, HFTokenizer(hf_tokenizer, eos_ids), name, min(config.max_model_len, limit), str(model_dir))
