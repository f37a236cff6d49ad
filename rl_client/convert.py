"""Proto messages to and from the client's types (``rl_client.types``): what ``AsyncBridgeClient`` sends and reads."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from proto.primerl.v1 import primerl_pb2 as pb
from rl_client.types import (
    FINISH_REASONS,
    EnvStatus,
    Message,
    Prompt,
    Sampling,
    Trajectory,
    TurnInfo,
    TurnResult,
    Usage,
)


def sampling_params(s: Sampling | Mapping[str, Any] | None) -> pb.SamplingParams:
    """The proto message, field by field by name (``Sampling`` checks the names; the proto has the same ones)."""
    if not s:
        return pb.SamplingParams()
    return pb.SamplingParams(**(s if isinstance(s, Sampling) else Sampling(s)))


def messages_pb(items: Sequence[Message] | Sequence[Mapping[str, str]]) -> pb.Messages:
    out = pb.Messages()
    for m in items:
        if isinstance(m, Message):
            out.messages.add(role=m.role, content=m.content, name=m.name)
        else:
            out.messages.add(role=m["role"], content=m["content"], name=m.get("name", ""))
    return out


def is_token_ids(items: Prompt) -> bool:
    return all(isinstance(x, (int, np.integer)) for x in items)


def usage(u: pb.Usage) -> Usage:
    return Usage(u.prompt_tokens, u.cached_tokens, u.generated_tokens)


def turn_result(
    ids: list[int],
    logprobs: list[float],
    origins: list[str],
    done: pb.TurnDone,
    raw: list[float] | None = None,
    kept: list[float] | None = None,
) -> TurnResult:
    return TurnResult(
        token_ids=np.asarray(ids, dtype=np.int32),
        logprobs=np.asarray(logprobs, dtype=np.float32),
        origins=origins,
        text=done.text,
        finish_reason=FINISH_REASONS[done.finish_reason],
        usage=usage(done.usage),
        policy_version=done.policy_version,
        turn_index=done.turn_index,
        raw_logprobs=np.asarray(raw, dtype=np.float32) if raw else None,
        kept_logmass=np.asarray(kept, dtype=np.float32) if kept else None,
        env=env_status(done.env) if done.HasField("env") else None,
    )


def env_status(e: pb.EnvStatus) -> EnvStatus:
    reward = e.reward if e.HasField("reward") else None
    return EnvStatus(e.done, reward, e.reason, e.tool_calls, e.turns, e.truncated, e.error)


def trajectory(t: pb.Trajectory) -> Trajectory:
    return Trajectory(
        episode_id=t.episode_id,
        group_id=t.group_id,
        group_index=t.group_index,
        model=t.model,
        token_ids=np.asarray(t.token_ids, dtype=np.int32),
        logprobs=np.asarray(t.logprobs, dtype=np.float32),
        loss_mask=np.asarray(t.loss_mask, dtype=np.bool_),
        origins=np.asarray(t.origins, dtype=np.int8),
        policy_versions=np.asarray(t.policy_versions, dtype=np.int64),
        prompt_length=t.prompt_length,
        turns=[
            TurnInfo(
                x.observation_start,
                x.generation_start,
                x.end,
                FINISH_REASONS[x.finish_reason],
                usage(x.usage),
                x.policy_version,
                x.latency_ms,
                x.ttft_ms,
            )
            for x in t.turns
        ],
        rewards=list(t.rewards),
        turn_rewards=list(t.turn_rewards),
        metadata=dict(t.metadata),
        duration_ms=t.duration_ms,
        raw_logprobs=np.asarray(t.raw_logprobs, dtype=np.float32) if t.raw_logprobs else None,
        kept_logmass=np.asarray(t.kept_logmass, dtype=np.float32) if t.kept_logmass else None,
        adapter=t.adapter,
    )
