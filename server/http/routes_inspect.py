"""The live inspector's routes: episodes, one episode token by token, the fleet, live events, and the page.

- ``GET /v1/inspect/episodes``: open and recently ended episodes, newest first (filters: ``InspectQuery``);
- ``GET /v1/inspect/episodes/{episode_id}``: its trajectory (the content of ``EndEpisode``) with each token's
  text, its turns (replica, latency, cached tokens), its group's members and its session's branches;
- ``GET /v1/inspect/fleet``: bridges, replicas (health, load, version, drained/removed, cache hit rate), the
  policy version and the last weight updates (admin tenants when auth is on);
- ``GET /v1/inspect/events``: server-sent events (``Accept: text/event-stream``; ``retry:`` and ``id:`` set, so a
  client reconnects and resumes with ``Last-Event-ID``); without that Accept, the recent events as JSON;
- ``GET /ui``: the page (``server/inspector/static``), which reads only these routes.

With persistence on, ended episodes no longer in this bridge's memory (a restart, another bridge on the same
Redis) are read from Redis (``server.inspector.store``), bounded by its timeout; when Redis does not answer, the
routes answer from memory and the list says ``"persisted": "unavailable"``.

Auth is every route's: a tenant sees its own episodes; an admin tenant (or anyone, with auth off) every tenant's.
Another tenant's episode is unknown (404), as another tenant's session is. A session key cannot open the inspector.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from core.errors import NotFound, PermissionDenied
from server.episodes import Episode
from server.http.context import FrontDoor
from server.http.errors import error_for_validation, error_response
from server.http.models import EventsQuery, InspectQuery
from server.http.sessions import trajectory_json
from server.inspector import EpisodeLog
from server.inspector.events import EventHub, Subscriber, sse
from server.inspector.log import load_ended, summarize
from server.persistence import PersistenceUnavailable

PAGE_FILES = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css"}
PAGE_HEADERS = {
    "cache-control": "no-cache",
    "x-content-type-options": "nosniff",
    "content-security-policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'",
}
Q = TypeVar("Q", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class Viewer:
    tenant: str
    every_tenant: bool  # an admin tenant, or auth off


def _log(door: FrontDoor) -> EpisodeLog:
    log = door.bridge.inspector
    if not log.enabled:
        raise NotFound("the inspector is off on this bridge (inspector.enabled = false)")
    return log


def _viewer(request: Request, door: FrontDoor) -> Viewer:
    caller = door.caller(request)
    if caller.session is not None:
        raise PermissionDenied("a session key cannot open the inspector; use a tenant token")
    return Viewer(caller.tenant, not door.auth_on or caller.tenant in door.admins)


def _query(request: Request, model: type[Q]) -> Q:
    try:
        return model.model_validate(dict(request.query_params))
    except ValidationError as exc:
        raise error_for_validation(exc) from None


def _open_status(ep: Episode) -> str:
    return "running" if ep.busy else "idle"


def _matches(row: dict[str, Any], q: InspectQuery) -> bool:
    status = row["status"]
    if q.status is not None and status != q.status and not (q.status == "open" and status in ("running", "idle")):
        return False
    if q.request_id is not None:
        rid = q.request_id
        if not any(r == rid or r.startswith(rid + ".") for r in row["request_ids"]):
            return False
    return all(
        want is None or row[key] == want
        for key, want in (("tenant", q.tenant), ("model", q.model), ("session_id", q.session_id), ("group_id", q.group))
    )


def _rows(door: FrontDoor, log: EpisodeLog, viewer: Viewer, q: InspectQuery) -> Iterator[dict[str, Any]]:
    """The episodes the viewer may see that match ``q``: open ones (newest first), then ended ones (newest first)."""
    mine = None if viewer.every_tenant else viewer.tenant
    live = [ep for ep in door.bridge.store if mine is None or ep.tenant == mine]
    live.sort(key=lambda ep: ep.created, reverse=True)
    for ep in live:
        row = summarize(ep, _open_status(ep), log.live_info(ep.id))
        if _matches(row, q):
            yield row
    for _, entry in log.ended_entries():
        if mine is None or entry.tenant == mine:
            row = _summary(entry.summary)
            if _matches(row, q):
                yield row


def _summary(data: bytes) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(data)
    return out


async def episodes(request: Request, door: FrontDoor) -> Response:
    log = _log(door)
    viewer = _viewer(request, door)
    q = _query(request, InspectQuery)
    if q.tenant is not None and not viewer.every_tenant and q.tenant != viewer.tenant:
        raise PermissionDenied(f"tenant {viewer.tenant!r} may not see tenant {q.tenant!r}'s episodes (admin only)")
    rows = []
    for row in _rows(door, log, viewer, q):
        rows.append(row)
        if len(rows) >= q.limit:
            break
    persisted = await _persisted_rows(door, log, viewer, q, rows)
    config = log.config
    kept = {"ended": log.ended_count, "bytes": log.ended_bytes, "evicted": log.evicted,
            "max_ended_episodes": config.max_ended_episodes, "max_ended_bytes": config.max_ended_bytes,
            "persist_dropped": log.store.dropped if log.store is not None else 0}  # fmt: skip
    admin = not door.auth_on or viewer.tenant in door.admins
    who = {"auth": door.auth_on, "tenant": viewer.tenant, "every_tenant": viewer.every_tenant, "admin": admin}
    bridge = {"model": door.bridge.info.model, "policy_version": door.bridge.policy_version}
    return JSONResponse({"episodes": rows, **who, **bridge, "kept": kept, "persisted": persisted})


async def _persisted_rows(
    door: FrontDoor, log: EpisodeLog, viewer: Viewer, q: InspectQuery, rows: list[dict[str, Any]]
) -> str:
    """Fill ``rows`` up to ``q.limit`` with ended episodes only Redis keeps (ended ones re-sorted newest first);
    returns ``"off"`` (no persistence), ``"on"`` or ``"unavailable"`` (Redis did not answer: memory only)."""
    store = log.store
    if store is None:
        return "off"
    if len(rows) >= q.limit:
        return "on"
    known = {ep.id for ep in door.bridge.store} | {episode_id for episode_id, _ in log.ended_entries()}
    mine = None if viewer.every_tenant else viewer.tenant
    try:
        more = await store.recent(mine, known, q.limit - len(rows), lambda row: _matches(row, q))
    except PersistenceUnavailable:
        return "unavailable"
    if more:
        live = [r for r in rows if "ended_at" not in r]
        ended = sorted([r for r in rows if "ended_at" in r] + more, key=lambda r: r["ended_at"], reverse=True)
        rows[:] = live + ended
    return "on"


async def _find(door: FrontDoor, log: EpisodeLog, viewer: Viewer, episode_id: str) -> tuple[dict[str, Any], Episode]:
    ep = door.bridge.store.peek(episode_id)
    if ep is not None and (viewer.every_tenant or ep.tenant == viewer.tenant):
        return summarize(ep, _open_status(ep), log.live_info(ep.id)), ep
    entry = log.ended_entry(episode_id)
    unknown = f"episode {episode_id!r} is not known to the inspector (or belongs to another tenant)"
    if entry is None and ep is None and log.store is not None:
        try:
            entry = await log.store.get(episode_id)
        except PersistenceUnavailable:
            raise NotFound(f"{unknown}; Redis does not answer, so only this bridge's memory was searched") from None
    if entry is not None and (viewer.every_tenant or entry.tenant == viewer.tenant):
        return load_ended(entry)
    raise NotFound(unknown)


def _token_texts(door: FrontDoor, ids: list[int]) -> list[str]:
    tok = door.bridge.tokenizer
    if tok is None:
        return [f"<{i}>" for i in ids]
    hf = getattr(tok, "hf_tokenizer", None)
    if hf is not None:  # one call in Rust instead of one per token
        texts: list[str] = hf.batch_decode([[i] for i in ids])
        return texts
    return [tok.decode([i]) for i in ids]


def _related(door: FrontDoor, log: EpisodeLog, ep: Episode, key: str, value: str) -> list[dict[str, Any]]:
    """Every episode of ``ep``'s tenant whose summary ``key`` is ``value`` (open and kept), ordered."""
    rows = [
        summarize(o, _open_status(o), log.live_info(o.id))
        for o in door.bridge.store
        if o.tenant == ep.tenant and (o.group_id if key == "group_id" else o.metadata.get("http.session")) == value
    ]
    for _, entry in log.ended_entries():
        if entry.tenant == ep.tenant:
            row = _summary(entry.summary)
            if row[key] == value:
                rows.append(row)
    order = "group_index" if key == "group_id" else "branch"
    return sorted(rows, key=lambda r: (r[order] or 0, r["started_at"]))


async def episode(request: Request, door: FrontDoor) -> Response:
    log = _log(door)
    viewer = _viewer(request, door)
    summary, ep = await _find(door, log, viewer, request.path_params["episode_id"])
    rewards, turn_rewards = tuple(summary.get("rewards", ())), tuple(summary.get("turn_rewards", ()))
    body = trajectory_json(ep, rewards, turn_rewards, summary.get("duration_ms"))
    replicas = summary["turn_replicas"]
    for turn in body["turns"]:
        turn["replica"] = replicas[turn["index"]] if turn["index"] < len(replicas) else None
    body["tenant"] = ep.tenant
    body["summary"] = summary
    body["token_text"] = _token_texts(door, ep.token_ids)
    body["group"] = _related(door, log, ep, "group_id", ep.group_id)
    session = summary["session_id"]
    body["session"] = None
    if session:
        common = ep.metadata.get("http.fork_common_tokens")
        body["session"] = {
            "id": session,
            "branch": summary["branch"],
            "fork_common_tokens": int(common) if common and common.isdigit() else None,
            "branches": _related(door, log, ep, "session_id", session),
        }
    return JSONResponse(body)


async def fleet(request: Request, door: FrontDoor) -> Response:
    log = _log(door)
    door.admin(request, "the inspector's fleet view")
    bridge = door.bridge
    health = bridge.router.replicas
    replicas = [
        {
            "index": i,
            "name": e.info.replica,
            "engine": e.info.engine,
            "healthy": health.healthy[i] if i < len(health.healthy) else False,
            "engine_health": door.metrics.engine_health.get(e.info.replica),
            "load_tokens": health.load[i] if i < len(health.load) else 0,
            "fleet_load_tokens": health.view()[i] if i < len(health.load) else 0,
            "policy_version": e.policy_version,
            "state": bridge.replicas.withdrawn.get(i, "removed" if i in bridge.weights.removed else "active"),
            "cache": log.replica_cache(i),
        }
        for i, e in enumerate(bridge.engines)
    ]
    peers = [asdict(b) for b in await bridge.fleet.bridges()] if bridge.fleet is not None else []
    local = {"id": "this bridge", "address": str(request.base_url).rstrip("/"), "models": [bridge.info.model],
             "load": bridge.inflight, "seen": time.time()}  # fmt: skip
    updates = list(log.updates)
    return JSONResponse(
        {
            "model": bridge.info.model,
            "engine": bridge.info.engine,
            "policy_version": bridge.policy_version,
            "fleet_version": bridge.fleet.version if bridge.fleet is not None else None,
            "paused": bridge.paused,
            "paused_since": log.paused_since,
            "inflight_steps": bridge.inflight,
            "open_episodes": len(bridge.store),
            "bridges": peers or [local],
            "replicas": replicas,
            "last_weight_update": updates[-1] if updates else None,
            "weight_updates": updates,
        }
    )


async def events(request: Request, door: FrontDoor) -> Response:
    log = _log(door)
    viewer = _viewer(request, door)
    q = _query(request, EventsQuery)
    scope = None if viewer.every_tenant else viewer.tenant
    last = request.headers.get("last-event-id") or q.last_event_id or ""
    hub = log.hub
    if "text/event-stream" not in request.headers.get("accept", ""):
        missed = hub.since(last, scope) if last else hub.since(f"{hub.boot}-0", scope)
        shown = [{"id": hub.event_id(e), "type": e.kind, "data": e.data} for e in missed or ()]
        return JSONResponse({"boot": hub.boot, "reset": missed is None, "events": shown})
    sub = hub.subscribe(scope)  # before reading the ring: nothing is published between the two (no await)
    missed = hub.since(last, scope) if last else []
    headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
    stream = _stream(hub, sub, missed, door, log)
    return StreamingResponse(stream, media_type="text/event-stream", headers=headers)


async def _stream(
    hub: EventHub, sub: Subscriber, missed: list[Any] | None, door: FrontDoor, log: EpisodeLog
) -> AsyncIterator[str]:
    try:
        yield f"retry: {log.config.retry_ms}\n\n"
        hello = {"boot": hub.boot, "policy_version": door.bridge.policy_version, "reset": missed is None}
        yield sse(None, "hello", hello)
        for e in missed or ():
            yield sse(hub.event_id(e), e.kind, e.data)
        while not sub.closed:
            batch = await sub.wait(log.config.heartbeat_s)
            if dropped := sub.take_dropped():  # this page read too slowly: it refetches what it lost
                yield sse(None, "lagged", {"dropped": dropped})
            if not batch and not sub.closed:
                yield ": ping\n\n"
            for e in batch:
                yield sse(hub.event_id(e), e.kind, e.data)
    finally:
        hub.unsubscribe(sub)


# -- the page -----------------------------------------------------------------------------------------------------

_PAGE_CACHE: dict[str, bytes] = {}


def _page_file(name: str) -> bytes:
    if name not in _PAGE_CACHE:
        _PAGE_CACHE[name] = (resources.files("server.inspector") / "static" / name).read_bytes()
    return _PAGE_CACHE[name]


async def page(request: Request) -> Response:
    """``/ui`` and ``/ui/<file>``: the inspector's page (static files shipped in the package)."""
    name = request.path_params.get("name", "index.html")
    if name not in PAGE_FILES:
        return error_response(NotFound(f"/ui/{name}: no such file of the inspector page"))
    return Response(_page_file(name), media_type=PAGE_FILES[name], headers=PAGE_HEADERS)
