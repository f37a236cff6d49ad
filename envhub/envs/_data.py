"""Where the ready environments' bundled data lives, and how tasks are loaded."""

from __future__ import annotations

import json
from pathlib import Path

from envhub.base import Task

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples" / "envhub"
BUNDLED_DB = EXAMPLES_DIR / "company.sqlite"
SITE_DIR = EXAMPLES_DIR / "site"


def load_tasks(name: str, tasks_dir: str = "") -> tuple[Task, ...]:
    """Tasks from ``<tasks_dir or examples/envhub/tasks>/<name>.json`` (a list of task_id/question/reference)."""
    directory = Path(tasks_dir) if tasks_dir else EXAMPLES_DIR / "tasks"
    rows = json.loads((directory / f"{name}.json").read_text())
    return tuple(Task(task_id=r["task_id"], question=r["question"], reference=r["reference"]) for r in rows)
