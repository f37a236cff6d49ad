"""Request bodies of the HTTP front door as pydantic models (validation errors become 400s naming the field).

Unknown keys are accepted and ignored, as vLLM's ``OpenAIBaseModel`` does (clients send vendor fields);
known keys are type-checked. Sampling fields keep the names the wire uses (``max_tokens``,
``max_completion_tokens``, vLLM's ``top_k`` with -1 = off); ``server.http.runner`` turns them into the
bridge's ``SamplingOverrides``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

# What ``/v1/completions`` takes as ``prompt``, as openapi.json documents it: text or ids, non-empty; the batch
# forms with exactly one prompt. The route checks it itself (400s that say "one prompt per call", "empty").
_IDS = {"type": "array", "items": {"type": "integer"}, "minItems": 1}
PROMPT_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        _IDS,
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
        {"type": "array", "items": _IDS, "minItems": 1, "maxItems": 1},
    ],
    "description": "Text or token ids; the batch forms hold one prompt (a session is one history).",
}
SEED = Field(None, ge=0, lt=2**63, description="Seed (the bridge takes seeds in [0, 2**63)).")


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Open):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class Sampling(_Open):
    """Sampling fields shared by the OpenAI routes (vLLM's extensions included)."""

    temperature: float | None = Field(None, ge=0, description="Softmax temperature; 0 is greedy.")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus mass.")
    top_k: int | None = Field(None, ge=-1, description="Top-k cut; 0 or -1 disables it (vLLM).")
    min_p: float | None = Field(None, ge=0, le=1, description="Min-p filter (engines that support it).")
    max_tokens: int | None = Field(None, ge=1, description="Tokens sampled at most.")
    seed: int | None = SEED
    stop: str | list[str] | None = Field(None, description="Stop strings (the text ends before the match).")
    stop_token_ids: list[int] | None = Field(None, description="Token ids that end the turn (vLLM).")
    ignore_eos: bool | None = None
    n: int = Field(1, ge=1, description="Choices; n > 1 samples a GRPO group (one prompt prefill).")
    presence_penalty: float | None = Field(None, description="Only 0 is supported.")
    frequency_penalty: float | None = Field(None, description="Only 0 is supported.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = Field(False, description="vLLM: return prompt_token_ids and choices[i].token_ids.")
    return_tokens_as_token_ids: bool = Field(False, description="vLLM: logprob tokens as 'token_id:<id>'.")
    model: str | None = None


class FunctionDef(_Open):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Open):
    type: Literal["function"] = "function"
    function: FunctionDef


class ToolCallFunction(_Open):
    name: str
    arguments: str = "{}"


class ToolCallIn(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class TextPart(_Open):
    type: str = "text"
    text: str = ""


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class ChatBody(Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name for max_tokens.")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None


class CompletionBody(Sampling):
    """``POST /v1/completions`` (one prompt: text or token ids)."""

    prompt: Annotated[str | list[int] | list[str] | list[list[int]], WithJsonSchema(PROMPT_SCHEMA)]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class GenerateBody(_Open):
    """``POST /inference/v1/generate`` (vLLM's token route, as prime-rl and verifiers call it)."""

    token_ids: list[int] = Field(min_length=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    model: str | None = None
    request_id: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    priority: int = 0


class SessionBody(_Open):
    """``POST /v1/sessions``."""

    session_id: str | None = Field(None, min_length=1, max_length=128, description="Id to use (else a fresh one).")
    group_size: int = Field(1, ge=1, description="Episodes sampled per call (a GRPO group).")
    sampling: dict[str, Any] = Field(default_factory=dict, description="Sampling defaults (bridge field names).")
    tools: list[Tool] | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class EndBody(_Open):
    """``POST /v1/sessions/{id}/end``: rewards (one per group member for a group session)."""

    rewards: list[float] = Field(default_factory=list)
    turn_rewards: list[float] = Field(default_factory=list)
    discard: bool = False


class UpdateWeightsBody(_Open):
    weight_dir: str = Field(min_length=1, description="Directory of the new checkpoint (safetensors).")
    policy_version: int = Field(0, ge=0, description="New version (0: current + 1).")
    keep_kv: bool = False
    probe_token_ids: list[int] = Field(
        default_factory=list,
        description="A probe each replica scores after loading (see UpdateWeightsRequest); empty: a fixed probe.",
    )
    probe_logprobs: list[float] = Field(
        default_factory=list,
        description="The caller's logprobs of probe_token_ids[1:] under the new weights; empty: replicas agree.",
    )
    probe_tolerance: float = Field(0.0, ge=0, description="Largest |logprob difference| allowed (0: 0.02).")
    adapter: str = Field(
        "",
        description="Load weight_dir (a peft LoRA directory) as this adapter's next version instead of new base "
        "weights; the old version serves until the new one is proven. Episodes name it as their model.",
    )


class PauseBody(_Open):
    mode: Literal["keep", "abort", "wait"] = "keep"


# -- query strings (the inspector's routes) ---------------------------------------------------------------------


class InspectQuery(BaseModel):
    """``GET /v1/inspect/episodes``: filters (all optional, combined with AND) and a limit. Unknown keys are a 400."""

    model_config = ConfigDict(extra="forbid")

    tenant: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        description="Episodes of this tenant (another tenant's: admin tenants only).",
    )
    model: str | None = Field(None, min_length=1, max_length=128, description="Episodes of this model.")
    status: Literal["open", "running", "idle", "ended", "discarded"] | None = Field(
        None, description="open = running or idle (a Step in progress, or none)."
    )
    session_id: str | None = Field(
        None, min_length=1, max_length=128, description="Episodes of this HTTP session (its branches too)."
    )
    request_id: str | None = Field(
        None, min_length=1, max_length=128, description="Episodes a call with this x-request-id started or stepped."
    )
    group: str | None = Field(
        None, min_length=1, max_length=128, description="Members of this GRPO group (its group_id)."
    )
    limit: int = Field(200, ge=1, le=5000, description="At most this many episodes, newest first (open ones first).")


class EventsQuery(BaseModel):
    """``GET /v1/inspect/events``."""

    model_config = ConfigDict(extra="forbid")

    last_event_id: str | None = Field(
        None, max_length=64, description="Resume after this event id (as the Last-Event-ID header does)."
    )
