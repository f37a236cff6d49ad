"""Env hub: the tool environments, their connectors, the server-side tool loop, graders and reward shapers.

Layout::

    types.py      ToolSpec, ToolCall, FinalAnswer, ToolResult, StepResult, EnvState ...
    base.py       Environment protocol; ToolEnvironment (tasks, tools, trace, grading)
    registry.py   make_env(name, config): sql-qa, code-math, web-lookup, web-browse (+ register())
    loop.py       ToolLoop: the server-side tool loop the bridge drives per turn
    grammar.py    grammar_for: an env's tool schemas as a ``core.grammar.ToolGrammar`` (the speculation layer's input)
    graders.py    the one reward system: Grader protocol, Rubric (weighted sum/mean, group modes),
                  answer graders registered by name (exact)
    rewards.py    env shaping terms (success, format, step, cost, tool-trace) over a RewardContext
    openenv.py    OpenEnv HTTP facade (create_app) and client (OpenEnvClient)
    config.py     EnvHubConfig (``[envhub]``: sandbox, sql, http, browser, loop)
    connectors/   sql (SQLite, PostgreSQL), http (SSRF-safe), browser (Playwright)
    envs/         the ready environments; data/ their fixtures

Beside it, not in it: the code sandbox (``sandbox/``: policies, runner, seccomp, escape suite), the verifier
service (``verifier/``), the eval registry (``evals/``) and LLMServeEnv (``llmserve/``). The env hub imports
only ``core`` and ``sandbox``; never grpo, rl_client, proto or server (pyproject.toml's import contracts).

Importing the package imports neither Playwright, psycopg nor Starlette.
"""

from core.grammar import ToolGrammar
from core.toolcall import parse_tool_calls
from envhub.base import Environment, Task, ToolEnvironment
from envhub.config import EnvHubConfig
from envhub.graders import (
    Answer,
    FnGrader,
    Grader,
    Mode,
    Rubric,
    Scored,
    get_grader,
    grade_exact,
    grader_names,
    pareto_fronts,
    register_grader,
)
from envhub.grammar import grammar_for
from envhub.loop import LoopDecision, ToolLoop
from envhub.registry import make_env, names, register
from envhub.types import EnvState, FinalAnswer, ResetResult, StepResult, ToolCall, ToolResult, ToolSpec

__all__ = [
    "Answer",
    "EnvHubConfig",
    "EnvState",
    "Environment",
    "FinalAnswer",
    "FnGrader",
    "Grader",
    "LoopDecision",
    "Mode",
    "ResetResult",
    "Rubric",
    "Scored",
    "StepResult",
    "Task",
    "ToolCall",
    "ToolEnvironment",
    "ToolGrammar",
    "ToolLoop",
    "ToolResult",
    "ToolSpec",
    "get_grader",
    "grade_exact",
    "grader_names",
    "grammar_for",
    "make_env",
    "names",
    "pareto_fronts",
    "parse_tool_calls",
    "register",
    "register_grader",
]
