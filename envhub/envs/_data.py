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


def load_tasks(name: str, tasks_dir: str = "") -> tuple[Task, ...]:
    """Tasks from ``<tasks_dir or envhub/data/tasks>/<name>.json`` (a list of task_id/question/reference)."""
    directory = Path(tasks_dir) if tasks_dir else TASKS_DIR
    rows = json.loads((directory / f"{name}.json").read_text())
    return tuple(Task(task_id=r["task_id"], question=r["question"], reference=r["reference"]) for r in rows)
