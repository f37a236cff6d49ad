"""KV bytes per token from config.json, vLLM-style block counts, weights (acceptance 1)."""

from __future__ import annotations

import pytest

from placement.mig.memory import GiB, ModelArch, bundled_configs, dtype_bytes, kv_budget, load_config_json

KiB = 1024


def arch(name: str) -> ModelArch:
    return ModelArch.from_config(load_config_json(name))


@pytest.mark.parametrize(
    ("name", "kib"),
    [
        ("llama-3.1-8b", 128),
        ("qwen2.5-7b", 56),
        ("qwen2.5-1.5b", 28),
        ("llama-3.1-70b", 320),
        ("deepseek-v3", 68.625),  # MLA: (512 + 64) x 61 layers x 2 bytes
    ],
)
def test_kv_bytes_per_token_match_the_reference(name: str, kib: float) -> None:
    assert arch(name).kv_bytes_per_token(kv_dtype_bytes=2) == kib * KiB


def test_fp8_kv_halves_and_tensor_parallelism_splits_kv_heads_but_not_mla() -> None:
    llama70 = arch("llama-3.1-70b")
    assert llama70.kv_bytes_per_token(1) == 160 * KiB
    assert llama70.kv_bytes_per_token(2, tp=2) == 160 * KiB
    assert llama70.kv_bytes_per_token(2, tp=16) == 40 * KiB  # fewer kv heads than ranks: replicated
    ds = arch("deepseek-v3")
    assert ds.kv_bytes_per_token(2, tp=8) == ds.kv_bytes_per_token(2)


@pytest.mark.parametrize(
    ("name", "billions", "tol"),
    [
        ("llama-3.1-8b", 8.03, 0.01),
        ("qwen2.5-7b", 7.62, 0.01),
        ("llama-3.1-70b", 70.6, 0.01),
        ("deepseek-v3", 671, 0.01),
    ],
)
def test_parameter_counts_match_the_published_sizes(name: str, billions: float, tol: float) -> None:
    assert arch(name).num_params() / 1e9 == pytest.approx(billions, rel=tol)


def test_moe_active_parameters_and_quantised_weights() -> None:
    ds = arch("deepseek-v3")
    assert ds.active_params() / 1e9 == pytest.approx(37, rel=0.03)  # "37B activated"
    assert ds.native_weight_dtype == "fp8"
    q = arch("qwen2.5-7b")
    bf16 = q.weights_bytes("bf16")
    assert bf16 / GiB == pytest.approx(14.2, abs=0.05)  # the reference's 14.2 GiB
    assert q.weights_bytes("fp8") < 0.6 * bf16
    assert q.weights_bytes("int4") < q.weights_bytes("fp8")
    assert q.weights_bytes("bf16", tp=2) == bf16 // 2


def test_vllm_block_count_on_an_h200_1g_35gb_slice_follows_the_formula() -> None:
    """Reference B4 worked example: 0.9 x 32.5 GiB - 14.2 GiB - ~1.5 GiB = ~13.5 GiB = ~250k tokens."""
    q = arch("qwen2.5-7b")
    memory = 33280 * 2**20  # 32.5 GiB as NVML reports the slice
    act = int(1.5 * GiB)
    b = kv_budget(
        q,
        memory,
        weight_dtype="bf16",
        kv_dtype="bf16",
        gpu_memory_utilization=0.9,
        block_size=16,
        max_model_len=32768,
        activation_bytes=act,
    )
    page = 2 * 16 * 4 * 128 * 2  # coef x block_size x kv_heads x head_size x dtype
    assert b.page_size_bytes == page
    available = int(memory * 0.9) - q.weights_bytes("bf16") - act
    assert b.available_kv_bytes == available
    assert b.num_blocks == available // page // 28
    assert b.kv_tokens == b.num_blocks * 16
    assert 240_000 <= b.kv_tokens <= 260_000
    assert b.max_concurrent_seqs == (b.num_blocks * 28) // (28 * 32768 // 16)
    flags = b.engine_flags(max_num_seqs=256)
    assert flags[flags.index("--kv-cache-memory-bytes") + 1] == str(b.num_blocks * page * 28)
    assert flags[flags.index("--max-num-seqs") + 1] == str(b.max_concurrent_seqs)
    assert flags[flags.index("--gpu-memory-utilization") + 1] == "0.9"


def test_mla_page_has_one_latent_per_token() -> None:
    ds = arch("deepseek-v3")
    assert ds.page_size_bytes(block_size=64) == 64 * 1 * 576 * 2


def test_sliding_window_caps_the_kv_of_one_sequence() -> None:
    mistral, llama = arch("mistral-7b-v0.1"), arch("llama-3.1-8b")
    assert mistral.kv_bytes_per_token() == llama.kv_bytes_per_token()  # same per-token shape
    assert mistral.blocks_per_sequence(32768, 16) == 32 * 4096 // 16  # window of 4096 tokens
    assert llama.blocks_per_sequence(32768, 16) == 32 * 32768 // 16
    # Qwen2.5 declares a window but use_sliding_window is false: no cap.
    assert arch("qwen2.5-7b").sliding_layers == 0
    hybrid = ModelArch.from_config(
        {
            **load_config_json("llama-3.1-8b"),
            "sliding_window": 1024,
            "layer_types": ["sliding_attention", "full_attention"] * 16,
        }
    )
    assert hybrid.blocks_per_sequence(8192, 16) == 16 * 512 + 16 * 64


def test_a_model_too_big_for_the_device_has_no_kv() -> None:
    b = kv_budget(
        arch("llama-3.1-70b"),
        80 * GiB,
        weight_dtype="bf16",
        kv_dtype="bf16",
        gpu_memory_utilization=0.9,
        block_size=16,
        max_model_len=8192,
        activation_bytes=GiB,
    )
    assert b.available_kv_bytes < 0 and b.num_blocks == 0 and not b.fits


def test_missing_config_field_is_named() -> None:
    cfg = load_config_json("llama-3.1-8b")
    del cfg["num_hidden_layers"]
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelArch.from_config(cfg)
    with pytest.raises(ValueError, match="int3"):
        dtype_bytes("int3")


def test_bundled_configs_carry_a_source_note() -> None:
    names = bundled_configs()
    assert {"llama-3.1-8b", "qwen2.5-7b", "llama-3.1-70b", "deepseek-v3"} <= set(names)
    for n in names:
        assert "config.json" in load_config_json(n)["_source"]
