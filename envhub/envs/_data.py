"""Where the ready environments' bundled data lives, and how tasks are loaded.

The data (``company.sqlite``, ``tasks/<env>.json``, the test shop ``site/``) ships inside the package as
``envhub/data`` (package data in ``pyproject.toml``) and is located with ``importlib.resources``, so a
non-editable install finds it; nothing is read from the repository's ``examples/``.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.resources
import json
from pathlib import Path

from core.errors import FailedPrecondition
from envhub.base import Task


def _data_dir() -> Path:
    root = importlib.resources.files("envhub") / "data"
    if isinstance(root, Path):  # an ordinary (editable or wheel) install: the files are on disk
        return root
    # A zipped install: SQLite needs a real file, so extract the tree once for the life of the process.
    stack = contextlib.ExitStack()
    atexit.register(stack.close)
    return stack.enter_context(importlib.resources.as_file(root))


DATA_DIR = _data_dir()
BUNDLED_DB = DATA_DIR / "company.sqlite"
SITE_DIR = DATA_DIR / "site"
TASKS_DIR = DATA_DIR / "tasks"


class TaskFileError(FailedPrecondition):
    """A task file the operator configured is missing or malformed: the environment cannot start (not the
    caller's bad input, so FAILED_PRECONDITION); the message names the file, and the task and field when known."""


def load_tasks(name: str, tasks_dir: str = "") -> tuple[Task, ...]:
    """Tasks from ``<tasks_dir or envhub/data/tasks>/<name>.json`` (a list of task_id/question/reference)."""
    path = (Path(tasks_dir) if tasks_dir else TASKS_DIR) / f"{name}.json"
    try:
        rows = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:  # missing/unreadable, not JSON, not UTF-8
        raise TaskFileError(f"task file {path}: cannot be read as JSON: {exc}") from None
    if not isinstance(rows, list):
        raise TaskFileError(f"task file {path}: must be a JSON list of {{{', '.join(_TASK_FIELDS)}}} objects")
    for i, r in enumerate(rows):
        bad = [k for k in _TASK_FIELDS if not isinstance(r, dict) or not isinstance(r.get(k), str)]
        if bad:
            raise TaskFileError(f"task file {path}: task [{i}]: {', '.join(bad)}: missing or not a string")
    return tuple(Task(task_id=r["task_id"], question=r["question"], reference=r["reference"]) for r in rows)


_TASK_FIELDS = ("task_id", "question", "reference")
