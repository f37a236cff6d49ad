r"""The eval task registry: YAML files of tasks, with include paths.

A registry file::

    include: [more_tasks.yaml]          # relative to this file; loaded first, names must stay unique
    tasks:
      - name: calculator                # unique id
        description: ...
        generator: grpo.tasks:make_problems   # MODULE:FUNCTION(n, seed) -> problems (.question, .answer)
        # or: dataset: data/arith.jsonl       # JSON lines {"question", "reference"} (relative to this file)
        env: calculator                 # the episode loop (``evals.runner.ENVS``)
        grader: grpo-arithmetic         # a registered grader id (``envhub.graders``; eval's own in eval/graders.py)
        answer_regex: 'Answer:\s*(.+)'  # optional: the final answer is this group of the last turn's text
        metrics: [mean, pass]           # mean score; pass = share of samples scoring >= 1.0
        samples: 8                      # problems per run (the first n of the dataset / generator)
        seed: 1000                      # generator seed; sample i samples with seed + i
        sampling: {temperature: 0.0, max_tokens: 32, answer_max_tokens: 8}

Every error names the file and the field (``tasks.yaml: tasks.1.grader: ...``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from core.errors import InvalidArgument

SHIPPED = Path(__file__).with_name("tasks.yaml")
_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(0.0, ge=0, le=5)
    max_tokens: int = Field(32, ge=1, le=4096, description="max_tokens of the first turn")
    answer_max_tokens: int = Field(8, ge=1, le=4096, description="max_tokens of the answer turn")


class EvalTask(BaseModel):
    """One registered task."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=100, pattern=r"^[a-z0-9][a-z0-9._-]*$")
    description: str = ""
    generator: str | None = Field(None, description="MODULE:FUNCTION(n, seed) -> problems")
    dataset: str | None = Field(None, description="JSON lines file of {question, reference}")
    env: Literal["calculator"] = "calculator"
    grader: str = Field(min_length=1)
    answer_regex: str | None = None
    metrics: tuple[Literal["mean", "pass"], ...] = ("mean", "pass")
    samples: int = Field(8, ge=1, le=100_000)
    seed: int = Field(0, ge=0, lt=2**32)
    sampling: Sampling = Sampling()

    @field_validator("generator")
    @classmethod
    def _ref(cls, v: str | None) -> str | None:
        if v is not None and not _REF.match(v):
            raise ValueError(f"{v!r} is not MODULE:FUNCTION")
        return v

    @field_validator("answer_regex")
    @classmethod
    def _regex(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                if re.compile(v).groups < 1:
                    raise ValueError("needs one group: the answer")
            except re.error as exc:
                raise ValueError(f"not a regular expression: {exc}") from None
        return v

    @model_validator(mode="after")
    def _one_source(self) -> EvalTask:
        if (self.generator is None) == (self.dataset is None):
            raise ValueError("a task has exactly one of generator and dataset")
        return self


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include: list[str] = []
    tasks: list[EvalTask] = []


def _fields(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'file'}: {e['msg']}" for e in exc.errors())


def load_registry(path: str | Path = SHIPPED, _seen: tuple[Path, ...] = ()) -> dict[str, EvalTask]:
    """Tasks by name from ``path`` and its includes; a dataset path becomes absolute."""
    p = Path(path).resolve()
    if p in _seen:
        raise InvalidArgument(f"{p.name}: include: includes itself ({' -> '.join(x.name for x in (*_seen, p))})")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except OSError as exc:
        raise InvalidArgument(f"{path}: cannot read the task file ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise InvalidArgument(f"{p.name}: not YAML ({exc})") from None
    if not isinstance(data, dict):
        raise InvalidArgument(f"{p.name}: a task file is a mapping (include, tasks)")
    try:
        parsed = _File.model_validate(data)
    except ValidationError as exc:
        raise InvalidArgument(f"{p.name}: {_fields(exc)}") from None
    tasks: dict[str, EvalTask] = {}
    for inc in parsed.include:
        tasks.update(load_registry(p.parent / inc, (*_seen, p)))
    for i, task in enumerate(parsed.tasks):
        if task.name in tasks:
            raise InvalidArgument(f"{p.name}: tasks.{i}.name: {task.name!r} is registered twice")
        if task.dataset is not None:
            dataset = (p.parent / task.dataset).resolve()
            if not dataset.is_file():
                raise InvalidArgument(f"{p.name}: tasks.{i}.dataset: no file {dataset}")
            task = task.model_copy(update={"dataset": str(dataset)})
        tasks[task.name] = task
    return tasks


def select(tasks: dict[str, EvalTask], names: list[str]) -> list[EvalTask]:
    """The named tasks in the order given (all of them when ``names`` is empty)."""
    unknown = [n for n in names if n not in tasks]
    if unknown:
        raise InvalidArgument(f"task: unknown {', '.join(map(repr, unknown))}; registered: {', '.join(sorted(tasks))}")
    return [tasks[n] for n in names] if names else list(tasks.values())


def as_json(task: EvalTask) -> dict[str, Any]:
    return task.model_dump(mode="json")
