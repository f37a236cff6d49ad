"""Build the bundled SQLite database of the ``sql-qa`` environment (deterministic).

Run ``python scripts/build_envhub_db.py`` to regenerate ``envhub/data/company.sqlite`` (package data); the
tasks in ``envhub/data/tasks/sql_qa.json`` hold answers computed from exactly these rows.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

DEPARTMENTS = [(1, "Research", "Zurich"), (2, "Sales", "Lisbon"), (3, "Support", "Lisbon"), (4, "Finance", "Oslo")]
EMPLOYEES = [
    (1, "Ada Lovelace", 1, 9100, "2019-03-01"),
    (2, "Alan Turing", 1, 8800, "2020-07-15"),
    (3, "Grace Hopper", 1, 9500, "2018-01-10"),
    (4, "Linus Pauling", 2, 6100, "2021-05-20"),
    (5, "Marie Curie", 2, 7200, "2017-11-02"),
    (6, "Niels Bohr", 3, 5300, "2022-02-14"),
    (7, "Emmy Noether", 3, 5600, "2020-09-30"),
    (8, "Carl Gauss", 4, 8000, "2016-06-06"),
    (9, "Ada Yonath", 4, 7700, "2023-01-09"),
    (10, "Rosalind Franklin", 2, 6900, "2021-12-01"),
]
PROJECTS = [
    (1, "Atlas", 1, 250000),
    (2, "Beacon", 2, 90000),
    (3, "Comet", 1, 120000),
    (4, "Delta", 3, 40000),
    (5, "Echo", 4, 60000),
]
ASSIGNMENTS = [(1, 1), (2, 1), (3, 3), (4, 2), (5, 2), (6, 4), (7, 4), (8, 5), (9, 5), (10, 2), (1, 3), (3, 1)]


def build(path: Path) -> None:
    path.unlink(missing_ok=True)
    conn = sqlite3.connect(path)
    conn.executescript(
        """
        CREATE TABLE departments (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL);
        CREATE TABLE employees (
            id INTEGER PRIMARY KEY, name TEXT NOT NULL,
            department_id INTEGER NOT NULL REFERENCES departments(id),
            salary INTEGER NOT NULL, hired TEXT NOT NULL);
        CREATE TABLE projects (
            id INTEGER PRIMARY KEY, name TEXT NOT NULL,
            department_id INTEGER NOT NULL REFERENCES departments(id), budget INTEGER NOT NULL);
        CREATE TABLE assignments (
            employee_id INTEGER NOT NULL REFERENCES employees(id),
            project_id INTEGER NOT NULL REFERENCES projects(id), PRIMARY KEY (employee_id, project_id));
        """
    )
    conn.executemany("INSERT INTO departments VALUES (?, ?, ?)", DEPARTMENTS)
    conn.executemany("INSERT INTO employees VALUES (?, ?, ?, ?, ?)", EMPLOYEES)
    conn.executemany("INSERT INTO projects VALUES (?, ?, ?, ?)", PROJECTS)
    conn.executemany("INSERT INTO assignments VALUES (?, ?)", ASSIGNMENTS)
    conn.commit()
    conn.execute("VACUUM")
    conn.close()


if __name__ == "__main__":
    build(Path(__file__).resolve().parents[1] / "envhub" / "data" / "company.sqlite")
