"""Building the HTTP engine replicas (``vllm``, ``sglang``, ``trtllm``) from the configuration.

The bridge must know the served model before any engine answers (vocabulary size, EOS ids, context window,
tokenizer for chat rendering): they are read from a local copy of the model's directory (``config.json``,
``generation_config.json``, the tokenizer files). ``make_remote_engines`` then makes one ``RemoteEngine`` per
``engine.urls`` entry, all sharing those facts and one tokenizer.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

from core.errors import InvalidArgument
from core.types import ModelFacts
from engines.base import Tokenizer
from engines.config import EngineConfig, RemoteEngineConfig
from engines.http.base import RemoteEngine, redact_url
from engines.http.edge import split_engine_url

log = logging.getLogger("primerl.engines")


def read_model_facts(model_dir: Path) -> ModelFacts:
    """Vocabulary size, EOS ids and position limit from ``config.json`` (+ ``generation_config.json``)."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read {model_dir / 'config.json'}: {exc}") from exc
    eos: list[int] = []
    for source in (config, _read_json_or_empty(model_dir / "generation_config.json")):
        value = source.get("eos_token_id")
        for tok in value if isinstance(value, list) else [value]:
            if isinstance(tok, int) and tok not in eos:
                eos.append(tok)
    vocab = config.get("vocab_size")
    if not isinstance(vocab, int) or vocab < 1:
        raise InvalidArgument(f"{model_dir / 'config.json'} has no valid vocab_size")
    return ModelFacts(str(model_dir), vocab, tuple(eos), int(config.get("max_position_embeddings") or 2048))


def _read_json_or_empty(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def load_tokenizer(model_dir: Path, eos_token_ids: tuple[int, ...]) -> Tokenizer | None:
    """The served model's tokenizer (for chat rendering), or None when transformers is missing."""
    try:
        from transformers import AutoTokenizer
    except ImportError:  # pragma: no cover - transformers is a runtime dependency
        log.warning("transformers is not installed: remote engines accept token ids only, not chat messages")
        return None
    from engines.chat import HFTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot load the tokenizer in {model_dir}: {exc}") from exc
    return HFTokenizer(hf, eos_token_ids)


async def make_remote_engines(config: EngineConfig) -> list[RemoteEngine]:
    """One adapter per ``engine.urls`` entry, sharing the model facts and tokenizer.

    The engines are contacted once here (served name, context window) but need not be up:
    an unreachable replica makes the bridge report NOT_SERVING with the reason.
    """
    from engines.http.sglang import SglangEngine
    from engines.http.trtllm import TrtllmEngine
    from engines.http.vllm import VllmEngine
    from engines.model_store import ModelStoreError, resolve_model_dir

    classes: dict[str, type[RemoteEngine]] = {"vllm": VllmEngine, "sglang": SglangEngine, "trtllm": TrtllmEngine}
    cls = classes[config.type]
    section: RemoteEngineConfig = getattr(config, config.type)
    if not config.urls:
        raise InvalidArgument(
            f"engine type {config.type!r} needs at least one replica URL (engine.urls / --engine-url)"
        )
    for url in config.urls:
        if not url.startswith(("http://", "https://")):
            raise InvalidArgument(f"engine URL {redact_url(url)!r} must start with http:// or https://")
        split_engine_url(url)  # a malformed KV-events fragment fails here, naming the replica
    source = section.tokenizer_dir or config.model or None
    try:
        model_dir = await asyncio.to_thread(resolve_model_dir, source)
    except ModelStoreError as exc:
        raise InvalidArgument(
            f"cannot find the tokenizer and config of the model served by {config.type}: {exc} "
            f"(set engine.{config.type}.tokenizer_dir to a local HF model directory)"
        ) from exc
    facts = read_model_facts(model_dir)
    tokenizer = await asyncio.to_thread(load_tokenizer, model_dir, facts.eos_token_ids)
    # `engine.model` may be a directory or .gguf (then the served name comes from the engine).
    model = "" if "/" in config.model or config.model.endswith(".gguf") else config.model
    engines = [
        cls(
            url,
            section,
            facts,
            model=model,
            tokenizer=tokenizer,
            request_timeout_s=config.request_timeout_s,
            replica=f"{config.type}-{i}",
        )
        for i, url in enumerate(config.urls)
    ]
    await asyncio.gather(*(e.start() for e in engines))
    return engines
