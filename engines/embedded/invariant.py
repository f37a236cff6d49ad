"""A batch-invariant forward for Llama-family models: the embedded engine's deterministic mode and the trainer's.

Why by hand: a stock forward's logits for a position depend on how the call was shaped. A decode step is a
one-row matrix product (BLAS picks a GEMV kernel), a prefill or a trainer's forward is a many-row one (a GEMM
with its own blocking), a batch left-pads rows and changes the kernel's M, and attention reduces over however
many keys the call holds. Each of those changes the order of floating-point reductions, so the engine's logprob
for a token and the trainer's recompute of it differ in the last bits (~1e-5 here), and they differ with the
batch a sequence happened to share. Batch invariance comes from making every reduction's shape a function of
the token's absolute position only:

* Sequences are never batched together: each runs its own forward.
* Positions are processed in chunks of ``CHUNK`` tokens aligned at absolute multiples of ``CHUNK`` (padded at
  the end). Every matrix product therefore has ``CHUNK`` rows, and position ``i`` always sits at row
  ``i % CHUNK`` of the chunk that starts at ``i - i % CHUNK``. Decoding one token recomputes its partly
  filled chunk; the keys and values it recomputes for earlier positions are bitwise the ones cached, since
  nothing a row computes depends on the rows after it.
* Attention for the chunk at ``p`` runs over exactly ``p + CHUNK`` keys (the cached ``[0, p)`` and the chunk's
  own), with later keys masked to an exact zero weight, so every query at a position sees the same reduction
  whether the rest of its chunk holds real tokens (the trainer) or padding (a decode step).
* Logprobs are taken by one function (``token_logprobs``, float64 log-softmax of one fp32 logit row), the
  same for the engine's record and the trainer's recompute.

What it costs: a decode step computes ``CHUNK`` rows instead of one and a batch of sequences runs one forward
each (``bench/mismatch.py`` measures tokens/s against the default mode). What it assumes: the same weights, the
same torch build and the same number of intra-op threads on both sides (a GEMM's thread split is a function of
its shape and the thread count).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

CHUNK = 8
ARCHITECTURES = frozenset({"llama"})  # what forward_rows implements (pre-norm, GQA, RoPE, gated MLP, no extras)


def check_supported(model: Any) -> None:
    """Raise ValueError unless ``forward_rows`` implements ``model``'s architecture."""
    kind = getattr(model.config, "model_type", "")
    if kind not in ARCHITECTURES:
        raise ValueError(
            f"the batch-invariant forward implements {sorted(ARCHITECTURES)} models; this one is {kind!r} "
            "(turn batch_invariant off for it)"
        )


class InvariantCache:
    """Keys and values per layer (``[1, kv_heads, T, head_dim]``) for positions ``[0, length)``.

    It offers what the engine's KV bookkeeping uses of a ``DynamicCache``: ``crop``, ``fork`` and ``nbytes``.
    """

    __slots__ = ("keys", "values")

    def __init__(self, keys: list[torch.Tensor] | None = None, values: list[torch.Tensor] | None = None) -> None:
        self.keys: list[torch.Tensor] = keys if keys is not None else []
        self.values: list[torch.Tensor] = values if values is not None else []

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[-2]) if self.keys else 0

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` positions; a negative count removes that many trailing ones
        (``DynamicCache.crop``'s convention)."""
        keep = self.length + max_length if max_length < 0 else max_length
        keep = max(0, min(keep, self.length))
        self.keys = [k[..., :keep, :] for k in self.keys]
        self.values = [v[..., :keep, :] for v in self.values]

    def fork(self) -> InvariantCache:
        return InvariantCache([k.clone() for k in self.keys], [v.clone() for v in self.values])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def _layer(
    layer: Any,
    h: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    past: tuple[torch.Tensor | None, torch.Tensor | None],
    p: int,
    real: int,
    mask: torch.Tensor,
    shape: tuple[int, int, int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoder layer over the chunk at ``p`` (``real`` of its rows are tokens), through transformers' own RoPE
    and eager attention: the new hidden state and the layer's keys and values for positions ``[0, p + real)``."""
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward

    n_heads, n_kv, head_dim = shape
    attn = layer.self_attn
    x = layer.input_layernorm(h)
    q = attn.q_proj(x).view(1, CHUNK, n_heads, head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(1, CHUNK, n_kv, head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(1, CHUNK, n_kv, head_dim).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, *rope)
    past_k, past_v = past
    if past_k is not None and past_v is not None and p > 0:
        k = torch.cat([past_k[..., :p, :], k], dim=2)
        v = torch.cat([past_v[..., :p, :], v], dim=2)
    out, _ = eager_attention_forward(attn, q, k, v, mask, scaling=attn.scaling)
    h = h + attn.o_proj(out.reshape(1, CHUNK, n_heads * head_dim))
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h, k[..., : p + real, :], v[..., : p + real, :]


def forward_rows(
    model: Any,
    ids: Sequence[int],
    cache: InvariantCache | None = None,
    *,
    rows_from: int | None = None,
    hidden: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Extend ``cache`` to cover ``ids`` and return the fp32 logits of positions ``[rows_from, len(ids))``.

    ``rows_from`` defaults to the first position the cache did not cover; it may not precede the aligned chunk
    that position falls in (only that chunk and later ones are computed). With ``hidden`` the final normed
    hidden state of the same positions comes back too (the value head's input). Runs under the caller's grad
    mode: the trainer back-propagates through it.
    """
    import torch

    cache = cache if cache is not None else InvariantCache()
    n, start = len(ids), cache.length
    if start > n:
        raise ValueError(f"the cache covers {start} positions, more than the {n} token ids given")
    rows_from = start if rows_from is None else rows_from
    first = start - start % CHUNK
    if not first <= rows_from <= n:
        raise ValueError(f"rows_from={rows_from} is outside the computed positions [{first}, {n}]")
    core = model.model
    layers = core.layers
    cfg = model.config
    n_heads = int(cfg.num_attention_heads)
    n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads)
    pad = int(getattr(cfg, "pad_token_id", None) or 0)
    shape = (n_heads, n_kv, head_dim)
    keys: list[torch.Tensor | None] = list(cache.keys) or [None] * len(layers)
    values: list[torch.Tensor | None] = list(cache.values) or [None] * len(layers)
    logits_out: list[torch.Tensor] = []
    hidden_out: list[torch.Tensor] = []
    device = core.embed_tokens.weight.device
    for p in range(first, n, CHUNK):
        real = min(CHUNK, n - p)
        chunk = torch.tensor([list(ids[p : p + real]) + [pad] * (CHUNK - real)], dtype=torch.long, device=device)
        positions = torch.arange(p, p + CHUNK, device=device)[None]
        # Query row r (absolute p + r) may see keys [0, p + r]; later keys get -inf, an exact zero weight.
        later = torch.arange(p + CHUNK, device=device)[None, :] > positions[0][:, None]
        h = core.embed_tokens(chunk)
        mask = torch.zeros(later.shape, dtype=h.dtype, device=device).masked_fill(later, float("-inf"))[None, None]
        rope = core.rotary_emb(h, positions)
        for li, layer in enumerate(layers):
            h, keys[li], values[li] = _layer(layer, h, rope, (keys[li], values[li]), p, real, mask, shape)
        lo, hi = max(rows_from, p) - p, real
        if lo < hi:
            normed = core.norm(h)
            logits_out.append(model.lm_head(normed)[0, lo:hi].float())
            if hidden:
                hidden_out.append(normed[0, lo:hi])
    cache.keys = [k for k in keys if k is not None]
    cache.values = [v for v in values if v is not None]
    vocab = int(model.lm_head.weight.shape[0])
    logits = torch.cat(logits_out) if logits_out else torch.zeros(0, vocab)
    hid = (torch.cat(hidden_out) if hidden_out else torch.zeros(0, int(cfg.hidden_size))) if hidden else None
    return logits, hid


def wire_temperature(temperature: float) -> float:
    """The temperature as the bridge's wire carries it (a protobuf ``float``): 0.8 arrives as 0.800000011920929.
    Both sides of the deterministic mode use this value, whichever way the request came in."""
    import numpy as np

    return float(np.float32(temperature))


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], temperature: float = 1.0) -> torch.Tensor:
    """float64 logprob of ``tokens[i]`` under row ``i`` of ``logits`` at ``temperature`` (0 reads as 1, greedy's
    raw distribution; rounded by ``wire_temperature``), one row at a time so that the engine's single row and the
    trainer's many give the same bits. Differentiable."""
    import torch

    if len(tokens) == 0:
        return torch.zeros(0, dtype=torch.float64)
    temperature = wire_temperature(temperature)
    out = []
    for i, token in enumerate(tokens):
        x = logits[i].to(torch.float64, copy=True)  # a fresh buffer either side, whatever the row's origin
        if temperature > 0 and temperature != 1.0:
            x = x / temperature
        out.append(torch.log_softmax(x, dim=-1)[int(token)])
    return torch.stack(out)


__all__ = [
    "ARCHITECTURES",
    "CHUNK",
    "InvariantCache",
    "check_supported",
    "forward_rows",
    "token_logprobs",
    "wire_temperature",
]
