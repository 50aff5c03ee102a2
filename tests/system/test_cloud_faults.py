"""A storage server that goes away in the middle of a save (S3, moto).

1. Through a TCP proxy in front of the session's moto server: the proxy drops every connection and
   refuses new ones half-way through a save, then comes back. The save fails fast with a
   StorageError; nothing of it is visible; the earlier checkpoint loads; gc (once the dead save's
   lock is stale) removes its orphaned chunks; the same save, retried, succeeds.
2. A dedicated moto server killed with SIGKILL half-way through a save: the save fails with a
   StorageError within a bounded time, and so does the next call (no hang).
3. An upload that stalls mid-body (no client timeout covers writes) is cancelled at its deadline
   and retried, then fails with a StorageError instead of hanging.

Clients are told to fail fast (1 s connect, 2 s read timeouts, no botocore or s3fs retries);
treestore's own retries (4 attempts, backoff 0.05 s x 4) still apply.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from fsspec.asyn import AsyncFileSystem

import treestore
from tests.support import servers
from tests.support.helpers import assert_tree_equal
from treestore._engine import locks as _locks
from treestore._format import paths as _paths
from treestore._storage.cloud import ObjectStorage

FAIL_FAST = {
    "config_kwargs": {"connect_timeout": 1, "read_timeout": 2, "retries": {"total_max_attempts": 1}},
}
OPTIONS = treestore.SaveOptions(chunk_size=64 * 1024, threads=4)
BOUND = 20.0  # seconds from the failure to the save's error


class Proxy:
    """A TCP forwarder from a free 127.0.0.1 port to ``upstream``.

    ``cut()`` closes every open connection and makes new ones close at once (the port stays
    bound, so clients see resets, not a different server); ``restore()`` forwards again.
    """

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.up = threading.Event()
        self.up.set()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((servers.HOST, 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="proxy-accept").start()

    @property
    def url(self) -> str:
        return f"http://{servers.HOST}:{self.port}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self.up.is_set():
                _close(client, reset=True)
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                _close(client)
                continue
            server.settimeout(None)
            with self._lock:
                self._conns |= {client, server}
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                _close(s)
                with self._lock:
                    self._conns.discard(s)

    def cut(self) -> None:
        self.up.clear()
        with self._lock:
            conns, self._conns = self._conns, set()
        for s in conns:
            _close(s, reset=True)

    def restore(self) -> None:
        self.up.set()

    def close(self) -> None:
        self._closed = True
        self.cut()
        _close(self._listener)


def _close(s: socket.socket, *, reset: bool = False) -> None:
    # shutdown() first: it wakes a pump thread blocked in recv() on this socket (close() alone
    # would not, and the connection would stay open while it waits).
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    if reset:  # then close with an RST: the peer's next read or write fails at once
        with contextlib.suppress(OSError):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        s.close()


def big_tree() -> dict[str, Any]:
    rng = np.random.default_rng(3)
    return {"w": rng.standard_normal(1_500_000).astype(np.float32), "step": 7}  # 6 MB, 92 chunks


def save_in_background(
    store: treestore.Store, tree: Any, name: str, after_writes: int, then: Callable[[], None]
) -> tuple[threading.Thread, dict[str, Any]]:
    """Start ``store.save`` in a thread; call ``then()`` once ``after_writes`` chunks are written.
    Returns the thread and a dict that gets ``error``/``result`` and ``failed_after`` (seconds
    from ``then()`` to the save's end)."""
    out: dict[str, Any] = {}
    written = threading.Event()
    count = [0]
    lock = threading.Lock()
    write = store._storage.write

    def counting(path: str, buffers: Any) -> None:
        write(path, buffers)
        if path.startswith(_paths.CHUNKS):
            with lock:
                count[0] += 1
                if count[0] == after_writes:
                    written.set()

    store._storage.write = counting  # type: ignore[method-assign]

    def run() -> None:
        try:
            out["result"] = store.save(tree, name, options=OPTIONS)
        except BaseException as exc:
            out["error"] = exc
        out["ended"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert written.wait(60), "the save never got going"
    out["cut"] = time.monotonic()
    then()
    thread.join(BOUND + 30)
    assert not thread.is_alive(), "the save hung after its server went away"
    out["failed_after"] = out["ended"] - out["cut"]
    return thread, out


@pytest.fixture(autouse=True)
def fail_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    """s3fs retries each request 5 times itself (a class attribute, not an option): make it 1, so
    the time to fail is treestore's own retrying. Uploads stalled mid-body (which no client timeout
    covers) are cancelled after 3 s instead of 60."""
    s3fs = pytest.importorskip("s3fs")
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    monkeypatch.setenv("TREESTORE_UPLOAD_TIMEOUT", "3")


@pytest.fixture
def proxy(s3_backend: servers.Backend) -> Iterator[Proxy]:
    host, port = s3_backend.storage_options["endpoint_url"].rsplit("//", 1)[1].split(":")
    p = Proxy((host, int(port)))
    yield p
    p.close()


@pytest.mark.timeout(90)
def test_connection_cut_mid_save(s3_backend: servers.Backend, proxy: Proxy) -> None:
    url = s3_backend.url("faults")
    opts = {**s3_backend.storage_options, **FAIL_FAST, "endpoint_url": proxy.url}
    first = {"w": np.arange(1000, dtype=np.float32), "step": 1}
    treestore.Store(url, storage_options=opts).save(first, "first", options=OPTIONS)

    tree = big_tree()
    _, out = save_in_background(treestore.Store(url, storage_options=opts), tree, "second", 10, proxy.cut)
    error = out.get("error")
    assert isinstance(error, treestore.StorageError), out
    assert url in str(error) and "failed" in str(error)
    assert out["failed_after"] < BOUND, f"the save took {out['failed_after']:.1f} s to fail"

    # While the server is unreachable every call fails fast and clearly.
    with pytest.raises(treestore.StorageError):
        treestore.Store(url, storage_options=opts).list()

    proxy.restore()
    store = treestore.Store(url, storage_options=opts)
    assert [c.name for c in store.list()] == ["first"]  # nothing of the failed save is visible
    assert not store.exists("second")
    assert_tree_equal(store.load("first"), first)
    orphans = len(store._storage.list(_paths.CHUNKS)) - 1
    assert orphans >= 10  # chunks of the failed save: unreferenced, harmless
    # The dead save's lock keeps other processes' gc away until it is stale (an hour by default);
    # this process knows that save is over. Forget that, to see what another process sees ...
    _locks._abandoned.clear()
    with pytest.raises(treestore.errors.StoreBusyError):
        store.gc(grace=0)
    # ... and once it is, gc removes exactly the orphans.
    time.sleep(0.6)
    report = store.gc(grace=0, stale_after=0.5)
    assert report.chunks_removed == orphans and report.locks_removed >= 1
    assert_tree_equal(store.load("first"), first)

    result = store.save(tree, "second", options=OPTIONS)  # the retry succeeds
    assert result.chunks_written == 92
    assert_tree_equal(store.load("second"), tree)
    assert [c.name for c in store.list()] == ["first", "second"]


@contextlib.contextmanager
def dedicated_moto() -> Iterator[tuple[subprocess.Popen[bytes], servers.Backend]]:
    """A moto server of our own (so it can be killed) with one bucket."""
    port = servers.free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", servers.HOST, "-p", str(port)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"},
        start_new_session=True,
    )
    try:
        endpoint = f"http://{servers.HOST}:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                status, _ = servers._http("PUT", f"{endpoint}/faults-bucket", timeout=2)
                if status == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("moto did not start")
            time.sleep(0.1)
        yield (
            proc,
            servers.Backend(
                "s3://faults-bucket",
                {
                    "endpoint_url": endpoint,
                    "key": "testing",
                    "secret": "testing",
                    "client_kwargs": {"region_name": "us-east-1"},
                },
                "s3",
                reset=lambda: None,
            ),
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.mark.timeout(90)
def test_server_killed_mid_save() -> None:
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    with dedicated_moto() as (proc, backend):
        url = backend.url("faults")
        opts = {**backend.storage_options, **FAIL_FAST}
        treestore.save(url, {"x": np.ones(10)}, "first", storage_options=opts)

        def kill() -> None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

        _, out = save_in_background(
            treestore.Store(url, storage_options=opts), big_tree(), "second", 10, kill
        )
        error = out.get("error")
        assert isinstance(error, treestore.StorageError), out
        assert url in str(error)
        assert out["failed_after"] < BOUND, f"the save took {out['failed_after']:.1f} s to fail"
        t0 = time.monotonic()
        with pytest.raises(treestore.StorageError):
            treestore.load(url, "first", storage_options=opts)
        assert time.monotonic() - t0 < BOUND


class _StalledFileSystem(AsyncFileSystem):
    """An async filesystem whose uploads never finish, like a connection that stopped mid-body
    (no client timeout covers that: they time out reads, not writes)."""

    protocol = "stalled"
    uploads = 0

    async def _pipe_file(self, path: str, data: bytes, **kwargs: Any) -> None:
        type(self).uploads += 1
        await asyncio.sleep(3600)


def test_stalled_upload_is_cancelled_and_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREESTORE_UPLOAD_TIMEOUT", "0.2")
    storage = ObjectStorage(_StalledFileSystem(skip_instance_cache=True), "bucket/store", "stalled://x")
    t0 = time.monotonic()
    with pytest.raises(treestore.StorageError, match="writing stalled://x/chunks/ab/cd failed"):
        storage.write("chunks/ab/cd", [b"x" * 1000])
    assert _StalledFileSystem.uploads == 4  # each attempt cancelled at its deadline, then retried
    assert time.monotonic() - t0 < 10
    with pytest.raises(treestore.StorageError):
        storage.write_new("checkpoints/a", b"record")
