"""The benchmark table: agents x tasks on fixed held-out seeds, mean return and mean grade.

Seeds ``0 .. episodes-1`` by default: PPO trains on ``ppo.TRAIN_SEED_BASE`` and above, so these are
never seen in training. Every episode is graded by ``grader.grade`` (replay, random floor 0,
heuristic reference 0.5), so a table's grades are the ones ``/grader`` would give. The ``llm``
agent's cells also count its windows, parsed replies and heuristic fallbacks (``llm.LLMStats``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmserve.agents import make_agent
from llmserve.grader import grade, run_agent
from llmserve.llm import LLMStats
from llmserve.tasks import TASKS, get_task


@dataclass(frozen=True)
class Cell:
    agent: str
    task_id: str
    returns: list[float]
    grades: list[float]
    llm: LLMStats | None = None
    """The ``llm`` agent's parse and fallback counts over the cell's episodes."""

    @property
    def mean_return(self) -> float:
        return float(np.mean(self.returns))

    @property
    def mean_grade(self) -> float:
        return float(np.mean(self.grades))


def resolve_tasks(task: str) -> list[str]:
    if task == "all":
        return list(TASKS)
    get_task(task)  # unknown -> UnknownTaskError listing the tasks
    return [task]


def evaluate(agents: list[str], tasks: list[str], seeds: list[int], weights: str | None = None) -> list[Cell]:
    cells = []
    for task_id in tasks:
        for name in agents:
            returns, grades, llm = [], [], None
            for seed in seeds:
                agent = make_agent(name, seed, weights)
                g = grade(run_agent(agent, task_id, seed))
                returns.append(g.episode_return)
                grades.append(g.score)
                stats = getattr(agent, "stats", None)
                if isinstance(stats, LLMStats):
                    llm = stats if llm is None else llm + stats
            cells.append(Cell(name, task_id, returns, grades, llm))
    return cells


def table(cells: list[Cell]) -> str:
    """Markdown: one row per task and agent, with the margin of each agent's mean return over the next;
    below it, one line per ``llm`` cell with its parse and fallback counts."""
    lines = ["| task | agent | mean return | mean grade | margin (return) vs next |", "|---|---|---|---|---|"]
    for task_id in dict.fromkeys(c.task_id for c in cells):
        row = [c for c in cells if c.task_id == task_id]
        for i, c in enumerate(row):
            margin = f"{c.mean_return - row[i + 1].mean_return:+.3f} vs {row[i + 1].agent}" if i + 1 < len(row) else ""
            lines.append(f"| {task_id} | {c.agent} | {c.mean_return:.3f} | {c.mean_grade:.3f} | {margin} |")
    notes = [f"{c.task_id}: {c.llm.summary()} (model {c.llm.model})" for c in cells if c.llm is not None]
    return "\n".join(lines + (["", *notes] if notes else []))
