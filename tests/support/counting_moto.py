"""moto's S3 server, counting the bytes it serves (tests and benchmarks only).

    python tests/support/counting_moto.py HOST PORT

The same server as ``python -m moto.server -H HOST -p PORT``, its application wrapped in a WSGI
layer that counts every response body's bytes and every request. ``GET /treestore-count`` answers
``{"bytes": ..., "requests": ..., "gets": ..., "get_bytes": ...}`` (``gets`` and ``get_bytes``:
GET requests to objects, the reads of a restore) and ``POST /treestore-count/reset`` zeroes them;
neither is counted. Serves 127.0.0.1 only in the tests.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

COUNT_PATH = "/treestore-count"


class Counting:
    """A WSGI application counting what ``app`` serves."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.counts = {"bytes": 0, "requests": 0, "gets": 0, "get_bytes": 0}

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path.startswith(COUNT_PATH):
            with self.lock:
                if path.endswith("/reset") and environ.get("REQUEST_METHOD") == "POST":
                    self.counts = dict.fromkeys(self.counts, 0)
                body = json.dumps(self.counts).encode()
            headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
            start_response("200 OK", headers)
            return [body]
        # an object's GET: a path of two segments or more (bucket and key), no query but a range
        query = environ.get("QUERY_STRING", "")
        get = environ.get("REQUEST_METHOD") == "GET" and path.strip("/").count("/") >= 1 and not query
        with self.lock:
            self.counts["requests"] += 1
            self.counts["gets"] += get
        return self._counted(self.app(environ, start_response), get)

    def _counted(self, body: Iterable[bytes], get: bool) -> Iterator[bytes]:
        try:
            for chunk in body:
                with self.lock:
                    self.counts["bytes"] += len(chunk)
                    if get:
                        self.counts["get_bytes"] += len(chunk)
                yield chunk
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()


def main() -> None:
    host, port = sys.argv[1], int(sys.argv[2])
    os.environ.setdefault("MOTO_PORT", str(port))
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import run_simple

    app = DomainDispatcherApplication(create_backend_app)
    run_simple(host, port, Counting(app), threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()
