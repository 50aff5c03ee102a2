"""A tiny read-only static file server for tests (run as a subprocess).

    python tests/support/http_static_server.py --host 127.0.0.1 --port PORT --root DIR

Serves the files under DIR on GET and HEAD, with byte-range support
(``bytes=A-B``, ``bytes=A-``, suffix ``bytes=-N``; 206 + Content-Range, 416 when
unsatisfiable), and HTML directory listings whose ``<a href>`` links fsspec's
``HTTPFileSystem.ls`` understands (directories end in ``/``). Files are read on
every request, so a test may rewrite DIR while the server runs. ``GET /`` on an
empty DIR returns an empty listing, which is also the readiness probe.

Importing this module has no side effects (pytest imports it for doctests).
"""

from __future__ import annotations

import argparse
import html
import os
import re
import sys
from email.utils import formatdate
from pathlib import Path
from urllib.parse import quote, unquote

_RANGE_RE = re.compile(r"^\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*$")


def parse_range(header: str, size: int) -> tuple[int, int] | str | None:
    """Parse a single-range ``Range`` header against a file of ``size`` bytes.

    Returns ``(start, stop)`` (stop exclusive), ``None`` to serve the whole file
    (header absent, malformed or multi-range: RFC 9110 lets a server ignore it),
    or ``"unsatisfiable"``.

    >>> parse_range("bytes=0-0", 10)
    (0, 1)
    >>> parse_range("bytes=2-", 10)
    (2, 10)
    >>> parse_range("bytes=-3", 10)
    (7, 10)
    >>> parse_range("bytes=-30", 10)
    (0, 10)
    >>> parse_range("bytes=5-100", 10)
    (5, 10)
    >>> parse_range("bytes=10-", 10)
    'unsatisfiable'
    >>> parse_range("bytes=-0", 10)
    'unsatisfiable'
    >>> parse_range("bytes=0-1,4-5", 10) is None
    True
    """
    if not header:
        return None
    m = _RANGE_RE.match(header)
    if m is None:
        return None
    first, last = m.group(1), m.group(2)
    if first == "" and last == "":
        return None
    if first == "":  # suffix range: the last N bytes
        n = int(last)
        if n == 0 or size == 0:
            return "unsatisfiable"
        return (max(0, size - n), size)
    start = int(first)
    if last != "" and int(last) < start:
        return None  # invalid range spec: ignore the header
    if start >= size:
        return "unsatisfiable"
    stop = size if last == "" else min(int(last) + 1, size)
    return (start, stop)


def _listing(rel: str, directory: Path) -> bytes:
    base = "/" + rel.strip("/")
    if not base.endswith("/"):
        base += "/"
    items = []
    for entry in sorted(directory.iterdir(), key=lambda p: p.name):
        name = entry.name + ("/" if entry.is_dir() else "")
        href = quote(base + name)
        items.append(f'<li><a href="{html.escape(href, quote=True)}">{html.escape(name)}</a></li>')
    title = html.escape(base)
    body = (
        f"<!DOCTYPE html>\n<html><head><title>Index of {title}</title></head>\n"
        f"<body><h1>Index of {title}</h1>\n<ul>\n" + "\n".join(items) + "\n</ul></body></html>\n"
    )
    return body.encode()


def make_app(root: str):
    from aiohttp import web

    root_path = Path(root).resolve()

    async def handle(request: web.Request) -> web.StreamResponse:
        rel = unquote(request.rel_url.raw_path)
        target = (root_path / rel.lstrip("/")).resolve()
        if target != root_path and root_path not in target.parents:
            raise web.HTTPNotFound()
        if target.is_dir():
            body = _listing(rel, target)
            return web.Response(body=body, content_type="text/html", charset="utf-8")
        try:
            st = target.stat()
            f = open(target, "rb")  # noqa: SIM115 - closed below
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise web.HTTPNotFound() from None
        with f:
            size = st.st_size
            headers = {
                "Accept-Ranges": "bytes",
                "Last-Modified": formatdate(st.st_mtime, usegmt=True),
                "Content-Type": "application/octet-stream",
            }
            rng = parse_range(request.headers.get("Range", ""), size)
            if rng == "unsatisfiable":
                headers["Content-Range"] = f"bytes */{size}"
                return web.Response(status=416, headers=headers)
            if rng is None:
                status, start, stop = 200, 0, size
            else:
                assert isinstance(rng, tuple)
                status, (start, stop) = 206, rng
                headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
            f.seek(start)
            data = f.read(stop - start)
        # Content-Length comes from the body, also on HEAD (aiohttp drops the body).
        return web.Response(status=status, body=data, headers=headers)

    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", handle)  # HEAD is served from GET
    app.router.add_route("HEAD", "/{tail:.*}", handle)
    return app


def main(argv: list[str] | None = None) -> int:
    from aiohttp import web

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--root", required=True)
    args = parser.parse_args(argv)
    if not os.path.isdir(args.root):
        print(f"root {args.root!r} is not a directory", file=sys.stderr)
        return 2
    web.run_app(
        make_app(args.root),
        host=args.host,
        port=args.port,
        print=None,
        access_log=None,
        handle_signals=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
