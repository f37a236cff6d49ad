"""Trainer-side forward passes for a GRPO group that shares one prompt, and weight export for UpdateWeights.

``group_forward`` runs the prompt once (with gradients) and the G completions on top of its KV, expanded
to G rows: the same logprobs and the same gradient as G full forwards, for one prompt's compute instead of
G (the trainer-side twin of the engine's shared group prefill). Completions run in buckets of similar length,
right-padded within a bucket, so padding only ever follows the real tokens of a row and changes nothing the mask
selects.

``save_for_bridge`` writes the model's parameters as ``model.safetensors`` under their HF names, ``lm_head.weight``
as a copy even when it is tied to the embeddings (safetensors refuses shared tensors, and vLLM's in-place reload
keeps a tied head's old values when the checkpoint has none), and the model's ``config.json``: what the embedded
engine's ``update_weights`` loads, and a directory a vLLM replica can reload.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch


@dataclass
class GroupForward:
    logprobs: torch.Tensor  # [G, L] logprob of each completion token under the current weights
    hidden: torch.Tensor | None  # [G, L, H] hidden state that predicted each token (when asked)
    mask: torch.Tensor  # [G, L] real (non-padding) positions


def pad_right(rows: Sequence[npt.ArrayLike], value: float, dtype: torch.dtype) -> torch.Tensor:
    width = max(1, max(len(np.asarray(r)) for r in rows))
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, r in enumerate(rows):
        a = torch.as_tensor(np.asarray(r))
        out[i, : a.shape[0]] = a.to(dtype)
    return out


# What one more forward over the prompt's KV costs, in padded completion positions: a bucket of length-sorted
# completions is split off when it saves more padding than this (30 layers of Python and an attention over the
# prompt per forward; ~7 positions' compute measured on SmolLM2, a margin on top).
BUCKET_OVERHEAD = 16


def length_buckets(lengths: Sequence[int], overhead: int = BUCKET_OVERHEAD) -> list[list[int]]:
    """Indices of ``lengths`` in buckets of similar length (sorted, contiguous), minimising the padded positions
    (bucket size x its longest) plus ``overhead`` per bucket. A GRPO group's completions range from a one-turn
    answer to a three-turn tool loop (11 to 112 tokens in one group of the calculator task): padded to the longest,
    over half the rows computed nothing."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    best = [0] * (n + 1)  # best[j]: cheapest cover of the j shortest
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = lengths[order[j - 1]]
        best[j], cut[j] = min((best[i] + (j - i) * longest + overhead, i) for i in range(j))
    out, j = [], n
    while j:
        out.append(order[cut[j] : j])
        j = cut[j]
    return out[::-1]


def group_forward(
    model: Any,
    prompt_ids: Sequence[int],
    completions: Sequence[npt.ArrayLike],
    with_hidden: bool = False,
    temperature: float = 1.0,
) -> GroupForward:
    """Logprobs (and optionally hidden states) of G completions that share ``prompt_ids``.

    ``temperature`` must be the sampling temperature: the bridge reports logprobs of the tempered
    distribution the token was drawn from, and the ratio is only 1 on-policy when both sides match.
    The completions run in buckets of similar length (:func:`length_buckets`), each on the prompt's KV; the result
    is in the order given, right-padded to the longest.
    """
    from transformers.cache_utils import DynamicCache

    from engines.embedded.kvcache import forward_with_cache, output_cache

    rows = [np.asarray(c) for c in completions]
    prompt = torch.as_tensor(np.asarray(prompt_ids, dtype=np.int64))[None]
    # Only the prompt's last position is scored (it predicts each completion's first token): the LM head over the
    # other positions was a [P, vocab] product forward and two backward, ~12 % of a step's compute, all thrown away.
    out = model(input_ids=prompt, use_cache=True, output_hidden_states=with_hidden, logits_to_keep=1)
    first_logits = out.logits[:, -1:].float()
    prompt_kv = _kv(output_cache(out))
    width = max(1, max(len(r) for r in rows))
    logprobs: list[torch.Tensor | None] = [None] * len(rows)
    hiddens: list[torch.Tensor | None] = [None] * len(rows)
    for bucket in length_buckets([len(r) for r in rows]):
        g = len(bucket)
        cache = DynamicCache(ddp_cache_data=[(k.expand(g, -1, -1, -1), v.expand(g, -1, -1, -1)) for k, v in prompt_kv])
        ids = pad_right([rows[i] for i in bucket], 0, torch.long)
        comp = forward_with_cache(model, cache, input_ids=ids, use_cache=True, output_hidden_states=with_hidden)
        logits = torch.cat([first_logits.expand(g, -1, -1), comp.logits[:, :-1].float()], dim=1)  # j predicts j
        lp = torch.log_softmax(logits / temperature, dim=-1).gather(-1, ids[..., None]).squeeze(-1)
        lp = torch.nn.functional.pad(lp, (0, width - lp.shape[1]))
        for row, i in enumerate(bucket):
            logprobs[i] = lp[row]
        if with_hidden:
            h = torch.cat([out.hidden_states[-1][:, -1:].expand(g, -1, -1), comp.hidden_states[-1][:, :-1]], dim=1)
            h = torch.nn.functional.pad(h, (0, 0, 0, width - h.shape[1]))
            for row, i in enumerate(bucket):
                hiddens[i] = h[row]
    mask = pad_right([np.ones(len(r), dtype=bool) for r in rows], 0, torch.bool)
    hidden = torch.stack(hiddens) if with_hidden else None  # type: ignore[arg-type]
    return GroupForward(torch.stack(logprobs), hidden, mask)  # type: ignore[arg-type]


def invariant_group_forward(
    model: Any,
    prompt_ids: Sequence[int],
    completions: Sequence[npt.ArrayLike],
    with_hidden: bool = False,
    temperature: float = 1.0,
) -> GroupForward:
    """``group_forward`` through ``engines.embedded.invariant``: the same fixed-shape chunks and the same float64
    logprob function as an embedded engine in ``batch_invariant`` mode, so on-policy logprobs agree bit for bit.

    The prompt's whole chunks run once and each completion continues from a copy of their KV (the chunk holding
    the prompt's last token is recomputed per completion, as the engine recomputes a partly filled chunk);
    ``logprobs`` are float64 tensors holding float32 values (the trajectory's precision).
    """
    from engines.embedded.invariant import CHUNK, InvariantCache, check_supported, forward_rows, token_logprobs

    check_supported(model)
    prompt = [int(t) for t in prompt_ids]
    shared = len(prompt) - 1 - (len(prompt) - 1) % CHUNK  # whole chunks before the row predicting token 0
    base = InvariantCache()
    if shared:
        forward_rows(model, prompt[:shared], base)
    rows, hiddens = [], []
    for comp in completions:
        c = [int(t) for t in np.asarray(comp)]
        logits, hid = forward_rows(model, prompt + c, base.fork(), rows_from=len(prompt) - 1, hidden=with_hidden)
        lp = token_logprobs(logits, c, temperature)
        # Trajectories carry logprobs as float32: round to the record's precision, gradient straight through, so
        # the on-policy ratio is exactly 1 and the mismatch monitor reads exactly 0.
        rows.append(lp + (lp.float().double() - lp).detach())
        if hid is not None:
            hiddens.append(hid[: len(c)])
    width = max(1, max(len(r) for r in rows))
    logprobs = torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows])
    mask = pad_right([np.ones(len(r), dtype=bool) for r in rows], 0, torch.bool)
    hidden = None
    if with_hidden:
        hidden = torch.stack([torch.nn.functional.pad(h, (0, 0, 0, width - len(h))) for h in hiddens])
    return GroupForward(logprobs, hidden, mask)


def _kv(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def save_for_bridge(model: Any, directory: str | Path) -> Path:
    """Write the weights for ``UpdateWeights`` (atomically replaced file) and return the directory."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    if "lm_head.weight" in model.state_dict():  # a copy even when tied (safetensors refuses shared tensors): vLLM's
        # in-place reload leaves a tied lm_head at its old values when the checkpoint has none (bench/mismatch.py)
        state["lm_head.weight"] = model.state_dict()["lm_head.weight"].detach().clone().contiguous()
    tmp = d / "model.safetensors.tmp"
    save_file(state, str(tmp))
    tmp.replace(d / "model.safetensors")
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_file"):  # a vLLM replica reloads only a dir with config.json
        tmp_json = d / "config.json.tmp"
        config.to_json_file(str(tmp_json))
        tmp_json.replace(d / "config.json")
    return d


__all__ = ["GroupForward", "group_forward", "pad_right", "save_for_bridge"]
