"""``code-math``: compute answers to math questions by running Python in the sandbox.

Tool: ``run_python(code)`` runs the code in a fresh ``CodeSandbox`` process and returns
its exit status and capped output. The grader compares the final answer numerically with
the task's reference.
"""

from __future__ import annotations

from collections.abc import Mapping

from core.toolcall import format_call
from envhub.base import Task, ToolEnvironment
from envhub.config import EnvHubConfig
from envhub.envs._data import load_tasks
from envhub.rewards import Shaping
from envhub.types import JSON, ToolResult, string_tool
from sandbox.runner import CodeSandbox

PYTHON_TOOL = string_tool(
    "run_python",
    "Run a Python 3 program in an isolated sandbox (no network, no files outside /work); "
    "returns its exit status, stdout and stderr. Print what you need.",
    code="Python source code.",
)


class CodeMathEnv(ToolEnvironment):
    name = "code-math"
    sandbox_policy = "default"  # run_python's sandbox (sandbox/policies/default.yaml)
    system_prompt = (
        "Solve the math question. You may run Python with the run_python tool: write "
        f"{format_call('run_python', {'code': 'print(1 + 1)'})}. "
        "Give the final answer as <answer>NUMBER</answer>."
    )

    def __init__(self, sandbox: CodeSandbox, tasks: tuple[Task, ...], rubric: Shaping | None = None) -> None:
        super().__init__(tasks, rubric)
        self.sandbox = sandbox
        self.add_tool(PYTHON_TOOL, self._run)

    async def _run(self, args: Mapping[str, JSON]) -> ToolResult:
        result = await self.sandbox.run(str(args["code"]))
        kind = "" if result.ok else ("timeout" if result.timed_out else "runtime")
        return ToolResult("run_python", result.describe(), not result.ok, kind, result.elapsed_s)


def make(config: EnvHubConfig) -> CodeMathEnv:
    return CodeMathEnv(
        CodeSandbox(config.sandbox, CodeMathEnv.sandbox_policy), load_tasks("code_math", config.tasks_dir)
    )
