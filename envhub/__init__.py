"""Env hub: environments, connectors, reward shapers and tool-schema grammars.

Layout::

    types.py      ToolSpec, ToolCall, FinalAnswer, ToolResult, StepResult, EnvState ...
    base.py       Environment protocol; ToolEnvironment (tasks, tools, trace, grading)
    registry.py   make_env(name, config): sql-qa, code-math, web-lookup (+ register())
    loop.py       ToolLoop: the server-side tool loop the bridge drives per turn
    grammar.py    ToolGrammar: an env's tool schemas for the speculation layer
    graders.py    the one reward system: Grader protocol, Rubric (weighted sum/mean, group modes),
                  answer graders registered by name (exact)
    rewards.py    env shaping terms (success, format, step, cost, tool-trace) over a RewardContext
    openenv.py    OpenEnv HTTP facade (create_app) and client (OpenEnvClient)
    connectors/   sql (SQLite, PostgreSQL), sandbox (bubblewrap), http (SSRF-safe), browser
    envs/         the ready environments
    policies/     declared sandbox policies (YAML, validated, digested): default, grader
    sandbox_check.py  the escape suite (``primerl sandbox check POLICY``)
    verifier/     the verifier service: signed verdicts in a tamper-evident log (``primerl verifier``)

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
