"""A bridge worker's place (server.fleet.workers.WorkerSlot): who owns an episode id, and each worker's settings."""

from __future__ import annotations

from server.config import load_settings
from server.fleet.workers import WorkerSlot

SLOT = WorkerSlot(1, ("unix:/tmp/x/w0.sock", "unix:/tmp/x/w1.sock", "unix:/tmp/x/w2.sock"))


def test_an_episode_id_names_its_worker() -> None:
    assert SLOT.id_prefix == "ep-w1-"
    assert SLOT.owner_of("ep-w0-0123abcd") == 0
    assert SLOT.owner_of("ep-w2-0123abcd") == 2
    # Not a worker's id (a single bridge's, another fleet's, garbage) or a worker that does not exist: served here.
    for episode_id in ("ep-0123abcd", "", "ep-w", "ep-wx-01", "ep-w3-01", "ep-w1", "ep-w-1-01", "grp-w0-01"):
        assert SLOT.owner_of(episode_id) is None, episode_id


def test_each_worker_gets_its_metrics_port_fleet_name_and_only_worker_0_the_http_port() -> None:
    settings = load_settings(
        metrics={"port": 9300}, http={"port": 8000}, fleet={"bridge_id": "node-a"}, server={"workers": 3}
    )
    mine = SLOT.settings_for(settings)
    assert (mine.metrics.port, mine.http.port, mine.fleet.bridge_id) == (9301, 0, "node-a-w1")
    first = WorkerSlot(0, SLOT.addresses).settings_for(settings)
    assert (first.metrics.port, first.http.port, first.fleet.bridge_id) == (9300, 8000, "node-a-w0")
    off = SLOT.settings_for(load_settings(metrics={"port": 0}))
    assert off.metrics.port == 0 and off.fleet.bridge_id == ""  # off stays off; no name keeps the default
    assert settings.metrics.port == 9300  # the parent's settings are not changed
