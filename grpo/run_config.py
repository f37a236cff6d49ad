"""Config sections the RL entry points share (``primerl rl``, ``orchestrator``), and the held-out evaluation.

``TaskSection`` builds the training environment, ``EvalSection`` the held-out problems (another seed, training
problems removed) that :func:`evaluate_policy` grades greedily through the bridge.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from grpo.rollout import RolloutConfig, RolloutManager
from grpo.tasks import ArithmeticEnvironment, make_problems


class BridgeSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target: str = Field("", description="host:port of a running bridge; empty starts one as a child process.")
    engine: str = Field("embedded", description="Engine of the child bridge.")
    args: list[str] = Field(default_factory=list, description="Extra `primerl serve` arguments for the child.")


class TaskSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Literal["arithmetic"] = Field("arithmetic", description="The task: arithmetic through a calculator tool.")
    problems: int = Field(4096, ge=1, description="Training problems (cycled through in order).")
    max_operand: int = Field(60, ge=2, description="Operands are drawn from [2, max_operand].")
    ops: str = Field("+-", min_length=1, description="Operators to draw from (any of + - *).")
    operands: int = Field(2, ge=2, le=4, description="Operands per problem.")
    seed: int = Field(0, ge=0, description="Seed of the training problems.")


class EvalSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    problems: int = Field(0, ge=0, description="Held-out problems evaluated before and after training (0 = off).")
    seed: int = Field(10_000, ge=0, description="Seed of the held-out problems (distinct from the training seed).")


def task_environment(task: TaskSection) -> ArithmeticEnvironment:
    """The training environment of ``task`` (its problems, cycled through in order)."""
    t = task
    return ArithmeticEnvironment(make_problems(t.problems, t.seed, t.max_operand, ops=t.ops, operands=t.operands))


def evaluate_policy(
    inference: Any, task: TaskSection, ev: EvalSection, rollout: RolloutConfig, train_set: Collection[str] = ()
) -> dict[str, float]:
    """Greedy exact-answer rate and mean reward of the bridge's current policy on ``ev.problems`` held-out
    problems (those also in ``train_set`` removed, unless that leaves none)."""
    t = task
    held_out = make_problems(ev.problems, ev.seed, t.max_operand, ops=t.ops, operands=t.operands)
    held_out = [p for p in held_out if p.question not in train_set] or held_out
    rc = rollout.model_copy(update={"num_prompts": len(held_out), "group_size": 1, "temperature": 0.0})
    rc.max_concurrent = max(rc.max_concurrent, 8)  # greedy grading needs no bit-reproducible batching
    batch = RolloutManager(inference, ArithmeticEnvironment(held_out), rc).collect(0)
    correct = [b.state.info.get("components", {}).get("correct", 0.0) for b in batch]
    return {
        "problems": float(len(batch)),
        "correct": sum(correct) / len(batch),
        "reward": sum(b.reward for b in batch) / len(batch),
    }


__all__ = ["BridgeSection", "EvalSection", "TaskSection", "evaluate_policy", "task_environment"]
