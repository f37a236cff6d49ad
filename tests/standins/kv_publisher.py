"""A KV-event publisher speaking vLLM's documented ZMQ protocol (``vllm/distributed/kv_events.py``).

PUB socket: ``[topic, seq (8 B big-endian), payload]`` per batch, batches numbered from 0; ROUTER replay socket:
a request ``[b"", start seq]`` is answered with every buffered batch from ``start`` on, then the end marker
(seq -1). ``encode_batch(..., arrays=True)`` gives SGLang's encoding (tagged arrays), the default vLLM 0.32's
(maps). Fault switches: ``skip`` numbers a batch without sending it live (a dropped message), ``restart``
numbers from 0 again, ``buffer`` bounds what replay can return.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence

import zmq

from cache.kv_events import END_SEQ, Event, encode_batch


class StandinPublisher:
    def __init__(self, arrays: bool = False, buffer: int = 10_000, topic: str = "kv-events") -> None:
        self.arrays = arrays
        self.topic = topic.encode()
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        rport = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self.seq = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[Event], skip: bool = False) -> int:
        """Number and buffer one batch; send it unless ``skip`` (then only replay has it). Returns its seq."""
        payload = encode_batch(events, time.time(), arrays=self.arrays)
        with self._lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
            if not skip:
                self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def restart(self) -> None:
        """As a restarted engine: numbering from 0, nothing to replay."""
        with self._lock:
            self.seq = 0
            self.buffer.clear()

    def _serve_replay(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            client, _, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            with self._lock:
                items = [(s, p) for s, p in self.buffer if s >= first]
            for s, p in items:
                self.router.send_multipart([client, b"", self.topic, s.to_bytes(8, "big"), p])
            self.router.send_multipart([client, b"", b"", END_SEQ.to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()
