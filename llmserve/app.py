"""The LLMServeEnv server: openenv-core's ``create_app`` plus ``/tasks``, ``/grader``, ``/baseline``.

``uvicorn llmserve.app:app --port 7860`` or ``primerl llmserve serve``. openenv-core gives
``/reset``, ``/step``, ``/state`` (stateless over HTTP), ``/ws`` (stateful sessions), ``/metadata``,
``/health``, ``/schema`` and ``/mcp`` (and ``/web``, with ``GET /demo`` pointing there, when
``ENABLE_WEB_INTERFACE=true``). Errors: an unknown task -> 422 listing the tasks; a step on a
finished episode -> 409; a log that does not grade -> 422; an error of the tree (``core.errors``) -> its
class's HTTP status (the one map every app uses). Bodies are ``{"detail": message}`` (plus ``tasks`` for an
unknown task).

``GET /baseline`` grades random and heuristic on seeds 0-2 of every task (deterministic);
``GET /baseline?use_openai=true`` adds the ``llm`` agent's rows (``llmserve/llm.py``: a chat model
at ``$OPENAI_BASE_URL``, e.g. this project's bridge front door), each with its parse and fallback counts.
Without a usable endpoint it answers with a message naming the variable, its URL or the package, never a
partial table: 400 when this server is not set up for it (the variable unset, ``openai`` not installed: the
request cannot run in the server's current state, gRPC's FAILED_PRECONDITION), 502 when the endpoint is
unreachable or fails.
"""

from __future__ import annotations

import os
from typing import Any

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, RedirectResponse
from openenv.core.env_server.http_server import create_app
from pydantic import BaseModel, Field

from core.errors import PrimeRLError
from core.errors_http import json_error
from envhub.openenv_guard import ActionTypeGuard
from llmserve.agents import make_agent
from llmserve.env import EpisodeArchive, EpisodeFinishedError, EpisodeNotStartedError, LLMServeEnvironment
from llmserve.grader import EpisodeLogError, grade, run_agent
from llmserve.llm import LLMAgent, LLMConfig, LLMEndpointError, LLMNotConfiguredError
from llmserve.models import EpisodeLog, ServeAction, ServeObservation
from llmserve.tasks import TASKS, UnknownTaskError

MAX_SESSIONS = 64
BASELINE_SEEDS = (0, 1, 2)


class GraderRequest(BaseModel):
    """Grade a finished episode by id (the latest finished one when empty) or an explicit log."""

    episode_id: str | None = Field(default=None, description="a finished episode of this server")
    episode_log: EpisodeLog | None = Field(default=None, description="an episode log to replay and grade")


def _tasks() -> dict[str, Any]:
    return {
        "tasks": [
            {
                "task_id": t.task_id,
                "difficulty": t.difficulty,
                "description": t.description,
                "episode_length": t.episode_length,
                "window_s": t.window_s,
            }
            for t in TASKS.values()
        ],
        "action_schema": ServeAction.model_json_schema(),
    }


def _baseline() -> dict[str, Any]:
    rows = []
    for task_id in TASKS:
        for name in ("random", "heuristic"):
            scores = [grade(run_agent(make_agent(name, s), task_id, s)).score for s in BASELINE_SEEDS]
            rows.append({"task_id": task_id, "agent": name, "seeds": list(BASELINE_SEEDS), "scores": scores})
    return {"baseline": rows}


def _llm_baseline() -> list[dict[str, Any]]:
    """The ``llm`` agent on the same tasks and seeds; an agent per task, so each row counts its own windows."""
    rows = []
    for task_id in TASKS:
        agent = LLMAgent(LLMConfig.from_env())
        scores = [grade(run_agent(agent, task_id, s)).score for s in BASELINE_SEEDS]
        stats = agent.stats
        rows.append(
            {
                "task_id": task_id, "agent": "llm", "seeds": list(BASELINE_SEEDS), "scores": scores,
                "model": stats.model, "windows": stats.windows, "parsed": stats.parsed,
                "fell_back": stats.fell_back, "summary": stats.summary(),
            }
        )  # fmt: skip
    return rows


def web_enabled() -> bool:
    """The switch openenv-core's ``create_app`` reads to mount its Gradio interface at ``/web``."""
    return os.getenv("ENABLE_WEB_INTERFACE", "false").lower() in ("true", "1", "yes")


def build_app(archive: EpisodeArchive | None = None) -> FastAPI:
    archive = archive or EpisodeArchive()
    app = create_app(
        lambda: LLMServeEnvironment(archive), ServeAction, ServeObservation, env_name="llmserve",
        max_concurrent_envs=MAX_SESSIONS,
    )  # fmt: skip

    async def unknown_task(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(exc), "tasks": list(TASKS)}, status_code=422)

    async def finished(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    async def coded(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, PrimeRLError)
        return json_error(exc, {"detail": exc.message})

    app.add_exception_handler(UnknownTaskError, unknown_task)
    app.add_exception_handler(EpisodeFinishedError, finished)
    app.add_exception_handler(EpisodeNotStartedError, finished)
    app.add_exception_handler(PrimeRLError, coded)
    app.add_middleware(ActionTypeGuard)  # openenv-core 0.3.0 answers 500 to an object or array action.type

    @app.get("/tasks", tags=["LLMServeEnv"])
    def tasks() -> dict[str, Any]:
        return _tasks()

    @app.post("/grader", tags=["LLMServeEnv"])
    def grader(req: GraderRequest | None = None) -> dict[str, Any]:
        req = req or GraderRequest()
        log = req.episode_log or archive.get(req.episode_id)
        if log is None:
            raise HTTPException(404, f"no finished episode {req.episode_id or ''}".strip())
        try:
            g = grade(log)
        except (EpisodeLogError, UnknownTaskError) as exc:
            raise HTTPException(422, str(exc)) from exc
        return {**g.__dict__}

    @app.get("/demo", tags=["LLMServeEnv"], response_model=None)
    def demo() -> RedirectResponse | JSONResponse:
        """openenv-core's web interface (``/web``), served when ``ENABLE_WEB_INTERFACE=true`` (the Space sets it)."""
        if not web_enabled():
            return JSONResponse(
                {"detail": "the web interface is off: start the server with ENABLE_WEB_INTERFACE=true"}, 404
            )
        return RedirectResponse("/web/")

    @app.get("/baseline", tags=["LLMServeEnv"], response_model=None)
    def baseline(
        use_openai: bool = Query(False, description="also run the llm agent against $OPENAI_BASE_URL"),
    ) -> dict[str, Any] | JSONResponse:
        if not use_openai:
            return _baseline()
        try:
            llm_rows = _llm_baseline()
        except LLMNotConfiguredError as exc:
            return JSONResponse({"detail": str(exc)}, status_code=400)
        except LLMEndpointError as exc:  # the chat endpoint is down or failing: a bad gateway, not our fault
            return JSONResponse({"detail": str(exc)}, status_code=502)
        return {"baseline": _baseline()["baseline"] + llm_rows}

    return app


app = build_app()
