"""A directory served over HTTP on localhost for the tests of remote data (a thread of
this process; fsspec's HTTP filesystem reads it as it reads any web server)."""

from __future__ import annotations

import contextlib
import functools
import http.server
import threading


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    requests: list = []

    def log_message(self, format, *args):  # noqa: A002  (the base class's name)
        type(self).requests.append(self.path)


@contextlib.contextmanager
def serve_directory(path: str):
    """Yields (base URL, list of the paths requested so far)."""
    handler = type("Handler", (_QuietHandler,), {"requests": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=path))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler.requests
    finally:
        server.shutdown()
        server.server_close()
