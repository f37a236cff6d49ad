"""Serve the local test shop (``envhub/data/site``, the web-lookup env's data) on a loopback port.

A test fixture (not shipped with the package). Besides the static pages it answers
``/redirect?to=URL`` with a 302 to ``URL`` (for redirect re-validation tests) and
``/big`` with a large body (for size caps). It binds 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from envhub.envs._data import SITE_DIR


class _Handler(http.server.SimpleHTTPRequestHandler):
    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        if parts.path == "/redirect":
            target = parse_qs(parts.query).get("to", ["/"])[0]
            self.send_response(302)
            self.send_header("Location", target)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if parts.path == "/big":
            body = b"A" * (4 * 1024 * 1024)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            with contextlib.suppress(ConnectionResetError, BrokenPipeError):  # the size cap hangs up: expected
                self.wfile.write(body)
            return
        super().do_GET()

    def log_message(self, format: str, *args: object) -> None:  # quiet test output
        return None


@contextmanager
def serve_test_site(directory: Path = SITE_DIR) -> Iterator[str]:
    """Serve ``directory`` on 127.0.0.1 at a free port; yields the base URL (ending in '/')."""
    handler = functools.partial(_Handler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="envhub-test-site", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
