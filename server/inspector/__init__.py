"""The live inspector: a bounded record of the bridge's episodes, weight updates and replicas, and its events.

``EpisodeLog`` (``log.py``) is what the bridge calls; ``EventHub`` (``events.py``) fans its events out to live
pages; ``EndedStore`` (``store.py``) keeps ended episodes in Redis too when persistence is on; the HTTP routes
(``server.http.routes_inspect``) and the page (``static/``, served at ``/ui``) read it.
"""

from server.inspector.config import InspectorConfig
from server.inspector.events import EventHub, Subscriber
from server.inspector.log import EpisodeLog
from server.inspector.store import EndedStore

__all__ = ["EndedStore", "EpisodeLog", "EventHub", "InspectorConfig", "Subscriber"]
