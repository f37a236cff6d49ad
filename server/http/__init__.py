"""The HTTP front door: vLLM's token route, OpenAI routes, sessions and admin, over the same bridge as gRPC.

Every generation call goes through ``server.http.runner`` to ``Bridge.start_episode`` /
``Bridge.prepare_step`` -> ``StepHandle.updates`` -> ``StepHandle.close``: the one Step path gRPC uses.
Modules: ``app`` (Starlette app, uvicorn server), ``context`` (auth, bodies, sessions of a request),
``runner`` (a call on a session: extend or fork, drive the Steps), ``sessions`` (registry, trajectory
JSON), ``routes_tokens`` / ``routes_openai`` / ``routes_sessions`` (the routes), ``render`` (OpenAI chat
shapes), ``params`` (sampling fields), ``sse`` (event streams), ``errors`` (error -> HTTP status and
OpenAI error JSON, the one map), ``openapi``.
"""

from server.http.app import HttpFrontDoor, create_app

__all__ = ["HttpFrontDoor", "create_app"]
