"""Helpers for harnesses that speak HTTP to the bridge's front door (OpenAI SDK, verifiers, agents).

    from rl_client.http import open_session, fetch_trajectory
    s = open_session("http://bridge:8000", token="TENANT-TOKEN", sampling={"temperature": 0.7})
    agent = openai.OpenAI(base_url=s.base_url, api_key=s.api_key)   # every call lands in this session
    ...                                                              # run the harness unchanged
    traj = fetch_trajectory(s)                                       # token_ids, logprobs, loss_mask, ...

A session's key is a Bearer token scoped to that one session, so a harness can be handed it without the
tenant's token. Errors are ``BridgeHTTPError`` with the OpenAI error JSON's message and HTTP status.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx


class BridgeHTTPError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class HttpSession:
    id: str
    api_key: str  # Bearer token for this session only
    base_url: str  # OpenAI base URL (".../v1")
    root: str  # the front door's root URL


def _check(r: httpx.Response) -> Any:
    if r.status_code >= 400:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text
        raise BridgeHTTPError(r.status_code, message)
    return r.json()


def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def open_session(
    root: str,
    token: str | None = None,
    *,
    group_size: int = 1,
    sampling: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    session_id: str | None = None,
    metadata: Mapping[str, str] | None = None,
    timeout: float = 30.0,
) -> HttpSession:
    """Open a session (``POST /v1/sessions``); returns its id, key and the OpenAI base URL for a harness."""
    body: dict[str, Any] = {
        "group_size": group_size,
        "sampling": dict(sampling or {}),
        "metadata": dict(metadata or {}),
    }
    if tools:
        body["tools"] = list(tools)
    if session_id:
        body["session_id"] = session_id
    root = root.rstrip("/")
    data = _check(httpx.post(f"{root}/v1/sessions", json=body, headers=_headers(token), timeout=timeout))
    return HttpSession(data["id"], data["api_key"], f"{root}/v1", root)


def fetch_trajectory(session: HttpSession, timeout: float = 30.0) -> dict[str, Any]:
    """The session's trajectory (``token_ids``, ``logprobs`` with null where not sampled, ``loss_mask``, ...)."""
    url = f"{session.root}/v1/sessions/{session.id}/trajectory"
    return dict(_check(httpx.get(url, headers=_headers(session.api_key), timeout=timeout)))


def end_session(
    session: HttpSession, rewards: Sequence[float] = (), *, discard: bool = False, timeout: float = 30.0
) -> dict[str, Any]:
    """End the session with its rewards; returns the final trajectory."""
    url = f"{session.root}/v1/sessions/{session.id}/end"
    body = {"rewards": list(rewards), "discard": discard}
    return dict(_check(httpx.post(url, json=body, headers=_headers(session.api_key), timeout=timeout)))
