"""``sql-qa``: answer questions about the bundled company database with read-only SQL.

Tool: ``sql_query(query)`` runs one read-only statement (``SqliteReadOnly``). The grader
compares the final answer with the task's reference (the ``exact`` grader).
"""

from __future__ import annotations

from collections.abc import Mapping

from core.toolcall import format_call
from envhub.base import Task, ToolEnvironment
from envhub.config import EnvHubConfig
from envhub.connectors.sql import SqliteReadOnly
from envhub.envs._data import BUNDLED_DB, load_tasks
from envhub.rewards import Shaping
from envhub.types import JSON, ToolResult, string_tool

SQL_TOOL = string_tool(
    "sql_query",
    "Run one read-only SQL (SQLite) SELECT statement against the company database; returns rows.",
    query="One SQL SELECT statement.",
)


class SqlQaEnv(ToolEnvironment):
    name = "sql-qa"
    sandbox_policy = "default"  # its tools run in process (no code is sandboxed); declared for the hub's audit

    def __init__(self, db: SqliteReadOnly, tasks: tuple[Task, ...], rubric: Shaping | None = None) -> None:
        super().__init__(tasks, rubric)
        self.db = db
        self.system_prompt = (
            "You answer questions about a company database by calling the sql_query tool, then give the final "
            "answer as <answer>...</answer>. To call a tool, write "
            f"{format_call('sql_query', {'query': '...'})}.\nSchema:\n" + db.schema()
        )
        self.add_tool(SQL_TOOL, self._sql)

    async def _sql(self, args: Mapping[str, JSON]) -> ToolResult:
        return ToolResult("sql_query", await self.db.query(str(args["query"])))

    async def close(self) -> None:
        self.db.close()


def make(config: EnvHubConfig) -> SqlQaEnv:
    db = SqliteReadOnly(config.sql_qa_db or BUNDLED_DB, config.sql)
    return SqlQaEnv(db, load_tasks("sql_qa", config.tasks_dir))
