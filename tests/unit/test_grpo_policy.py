"""grpo.policy and grpo.losses on a tiny random Llama: the shared-prompt group forward (completions in buckets of
similar length) gives the same logprobs and gradients as G independent full forwards; the exported weights hold
every parameter, the tied lm_head as a copy (vLLM's in-place reload needs it), and the model's config."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from grpo.losses import aggregate, clipped_surrogate, kl_k3, value_loss  # noqa: E402
from grpo.policy import group_forward, length_buckets, save_for_bridge  # noqa: E402


def tiny_model() -> object:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    return transformers.LlamaForCausalLM(cfg).float()


def full_logprobs(model: object, prompt: list[int], comp: list[int], temperature: float) -> object:
    ids = torch.tensor([prompt + comp])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature  # type: ignore[operator]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(comp)[:, None]).squeeze(-1)


def test_length_buckets_split_where_padding_costs_more_than_a_forward() -> None:
    # one bucket: splitting [1] off saves 7 padded positions, less than a forward's overhead
    assert length_buckets([5, 1, 8]) == [[1, 0, 2]]
    # a calculator group: 337 positions computed in four buckets instead of 872 padded to 109
    lengths = [16, 11, 32, 10, 109, 12, 66, 65]
    buckets = length_buckets(lengths)
    assert buckets == [[3, 1, 5, 0], [2], [7, 6], [4]]
    assert sum(len(b) * max(lengths[i] for i in b) for b in buckets) == 337
    assert length_buckets([40] * 8) == [list(range(8))]
    assert sorted(i for b in length_buckets([3, 90, 2, 47, 46, 1]) for i in b) == list(range(6))


@pytest.mark.slow  # ~20 s on a loaded 2-core machine (first model build)
@pytest.mark.parametrize(("temperature", "lengths"), [(1.0, (5, 1, 8)), (0.7, (5, 1, 8)), (1.0, (2, 41, 3, 40))])
def test_group_forward_equals_independent_full_forwards(temperature: float, lengths: tuple[int, ...]) -> None:
    """One bucket, and (2, 41, 3, 40) in two: the order given, padded to the longest, either way."""
    model = tiny_model()
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 97, 9).tolist()
    comps = [rng.integers(0, 97, n).tolist() for n in lengths]
    assert len(length_buckets(list(lengths))) == (1 if len(lengths) == 3 else 2)
    fwd = group_forward(model, prompt, [np.array(c) for c in comps], with_hidden=True, temperature=temperature)
    g, width = len(lengths), max(lengths)
    assert fwd.logprobs.shape == (g, width) and fwd.hidden is not None and fwd.hidden.shape == (g, width, 32)
    assert fwd.mask.sum(1).tolist() == list(lengths)
    weights = torch.tensor([0.3, -1.0, 2.0, 0.5][:g])
    (fwd.logprobs * fwd.mask * weights[:, None]).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}  # type: ignore[attr-defined]
    model.zero_grad()  # type: ignore[attr-defined]
    total = 0
    for i, c in enumerate(comps):
        ref = full_logprobs(model, prompt, c, temperature)
        torch.testing.assert_close(fwd.logprobs[i, : len(c)].detach(), ref.detach(), rtol=1e-5, atol=1e-5)
        total = total + ref.sum() * weights[i]
    total.backward()  # type: ignore[union-attr]
    for n, p in model.named_parameters():  # type: ignore[attr-defined]
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_save_for_bridge_writes_every_parameter_the_tied_head_as_a_copy_and_the_config(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    model = tiny_model()
    d = save_for_bridge(model, tmp_path / "w")
    state = load_file(str(d / "model.safetensors"))
    own = model.state_dict()  # type: ignore[attr-defined]
    assert set(state) == set(own)
    assert all(torch.equal(state[k], own[k]) for k in own)
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "model.safetensors"]


def test_losses_clip_aggregate_and_kl() -> None:
    lp = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    old = torch.log(torch.tensor([[0.25, 0.5, 0.5], [0.5, 0.5, 0.9]]))  # ratios 2, 1, 1 / 1, 1, 0.556
    adv_ = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    loss, st = clipped_surrogate(lp, old, adv_, mask, mode="token_mean")
    # row 0: min(2*1, 1.2*1) = 1.2, 1 -> -(1.2 + 1); row 1: -min(-1, -1), ..., -min(-.556, -.8) = .8
    expected = (-(1.2 + 1.0) + (1.0 + 1.0 + 0.8)) / 5
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert st["clip_frac"] == pytest.approx(2 / 5)
    per_tok = torch.tensor([[1.0, 3.0, 100.0], [2.0, 2.0, 2.0]])
    assert float(aggregate(per_tok, mask, "seq_mean")) == pytest.approx((2.0 + 2.0) / 2)
    assert float(aggregate(per_tok, mask, "token_mean")) == pytest.approx(10.0 / 5)
    assert float(aggregate(per_tok, mask, "constant", norm_tokens=10)) == pytest.approx(10.0 / 20)
    assert float(aggregate(per_tok, torch.zeros_like(mask), "seq_mean")) == 0.0
    assert float(kl_k3(lp, lp).abs().max()) == 0.0 and float(kl_k3(lp, old).min()) >= 0.0
    v = torch.tensor([[0.0, 1.0]])
    assert float(value_loss(v, v, torch.tensor([[1.0, 1.0]]), torch.tensor([[True, True]]))) == pytest.approx(0.25)


def test_masked_positions_holding_nan_never_reach_the_loss_or_gradient() -> None:
    # the bridge reports NaN logprobs for prompt and env tokens; padding holds anything
    lp = torch.tensor([[-1.0, -2.0, -30.0, -0.5]], requires_grad=True)
    old = torch.tensor([[float("nan"), -2.0, float("-inf"), float("nan")]])
    mask = torch.tensor([[False, True, False, False]])
    adv_ = torch.tensor([[float("inf"), 1.0, 1.0, float("nan")]])
    for mode in ("seq_mean", "token_mean", "constant"):
        loss, _ = clipped_surrogate(lp, old, adv_, mask, mode=mode)  # type: ignore[arg-type]
        (grad,) = torch.autograd.grad(loss, lp)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        assert grad[0, 0] == grad[0, 2] == grad[0, 3] == 0.0 and grad[0, 1] != 0.0


def test_the_invariant_forward_refuses_an_architecture_it_does_not_implement() -> None:
    from engines.embedded.invariant import check_supported

    model = tiny_model()
    check_supported(model)  # a Llama
    model.config.model_type = "qwen3"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"implements \['llama'\] models; this one is 'qwen3'"):
        check_supported(model)


def test_invariant_group_forward_matches_the_default_forward_and_carries_gradients() -> None:
    from grpo.policy import invariant_group_forward

    model = tiny_model()
    prompt = list(range(3, 14))  # 11 tokens: the prompt's last chunk is recomputed per completion
    comps = [np.arange(20, 37), np.arange(30, 33), np.arange(40, 41)]
    a = invariant_group_forward(model, prompt, comps, temperature=0.8)
    b = group_forward(model, prompt, comps, temperature=0.8)
    assert a.logprobs.dtype == torch.float64 and torch.equal(a.mask, b.mask)
    torch.testing.assert_close(a.logprobs[a.mask].float(), b.logprobs[b.mask], atol=1e-5, rtol=0)
    assert torch.equal(a.logprobs, a.logprobs.float().double())  # the trajectory's float32 precision
    a.logprobs[a.mask].sum().backward()
    assert all(p.grad is not None for p in model.parameters())  # type: ignore[attr-defined]
