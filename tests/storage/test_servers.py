"""Smoke tests for the local protocol servers in tests/support/servers.py.

Each server starts once per session; the whole file takes a few seconds.
"""

from __future__ import annotations

import os
import urllib.request

import fsspec
import pytest

from tests.support import servers

# The server fixtures come from conftest.py, so each server starts once per session.

OBJECT_STORES = ["s3", "gcs", "azure"]


@pytest.fixture(params=OBJECT_STORES)
def store(request: pytest.FixtureRequest) -> servers.Backend:
    backend: servers.Backend = request.getfixturevalue(f"{request.param}_server")
    backend.reset()
    return backend


def test_backend_shape(store: servers.Backend) -> None:
    assert store.url_root.startswith(f"{store.protocol}://")
    assert store.name in OBJECT_STORES
    assert store.local_dir is None
    assert store.url("a", "b/") == store.url_root + "/a/b"
    assert store.url_root.split("://", 1)[1].startswith("treestore-test-")
    # started within the time budget and recorded
    assert 0 < servers.STARTUP_SECONDS[store.name] < 60


def test_pipe_cat_range_ls_rm(store: servers.Backend) -> None:
    fs = store.filesystem()
    path = store.url("dir", "obj.bin")
    data = b"0123456789"
    fs.pipe_file(path, data)

    assert fs.cat_file(path) == data
    assert fs.cat_file(path, start=2, end=5) == b"234"
    assert fs.cat_file(path, start=0, end=1) == b"0"  # Range: bytes=0-0
    assert fs.cat_file(path, start=7) == b"789"

    # fsspec.open with the same storage_options
    with fsspec.open(path, "rb", **store.storage_options) as f:
        f.seek(4)
        assert f.read(3) == b"456"

    info = fs.info(path)
    assert info["size"] == len(data)
    assert info["type"] == "file"
    names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(store.url("dir"), detail=False)]
    assert names == ["obj.bin"]
    top = fs.ls(store.url_root, detail=True)
    assert [(e["name"].rstrip("/").rsplit("/", 1)[-1], e["type"]) for e in top] == [("dir", "directory")]

    fs.rm(path)
    fs.invalidate_cache()
    assert not fs.exists(path)
    with pytest.raises(FileNotFoundError):
        fs.cat_file(path)


def test_reset_empties_bucket(store: servers.Backend) -> None:
    fs = store.filesystem()
    fs.pipe_file(store.url("a"), b"a")
    fs.pipe_file(store.url("sub", "b"), b"b")
    assert len(fs.ls(store.url_root)) == 2
    store.reset()
    # reset() invalidates cached listings of existing instances too
    assert fs.ls(store.url_root) == []
    assert fs.exists(store.url_root)  # the bucket is back, empty
    fs.pipe_file(store.url("c"), b"c")
    assert fs.cat_file(store.url("c")) == b"c"


def test_each_store_isolated_from_fixture_instances(store: servers.Backend) -> None:
    # reset() at fixture set-up leaves nothing from the previous test behind
    assert store.filesystem().ls(store.url_root) == []


# ---------------------------------------------------------------- HTTP


def _write(backend: servers.Backend, rel: str, data: bytes) -> None:
    assert backend.local_dir is not None
    p = os.path.join(backend.local_dir, rel)
    os.makedirs(os.path.dirname(p), exist_ok=True)
    with open(p, "wb") as f:
        f.write(data)


def _raw(url: str, method: str = "GET", headers: dict | None = None):
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with opener.open(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, dict(e.headers), e.read()


def test_http_cat_and_ranges(http_backend: servers.Backend) -> None:
    assert http_backend.local_dir and os.path.isdir(http_backend.local_dir)
    data = bytes(range(256)) * 4
    _write(http_backend, "ckpt/data.bin", data)
    fs = http_backend.filesystem()
    url = http_backend.url("ckpt", "data.bin")

    assert fs.cat_file(url) == data
    assert fs.cat_file(url, start=0, end=1) == data[:1]  # bytes=0-0
    assert fs.cat_file(url, start=10, end=20) == data[10:20]
    assert fs.cat_file(url, start=1000) == data[1000:]
    assert fs.cat_file(url, start=-5) == data[-5:]  # suffix range bytes=-5
    assert fs.info(url)["size"] == len(data)
    with fsspec.open(url, "rb", **http_backend.storage_options) as f:
        f.seek(512)
        assert f.read(4) == data[512:516]


def test_http_raw_range_semantics(http_backend: servers.Backend) -> None:
    _write(http_backend, "f", b"abcdef")
    url = http_backend.url("f")
    assert _raw(url)[0::2] == (200, b"abcdef")
    status, headers, body = _raw(url, headers={"Range": "bytes=0-0"})
    assert (status, body, headers["Content-Range"]) == (206, b"a", "bytes 0-0/6")
    status, headers, body = _raw(url, headers={"Range": "bytes=-2"})
    assert (status, body, headers["Content-Range"]) == (206, b"ef", "bytes 4-5/6")
    status, headers, body = _raw(url, headers={"Range": "bytes=4-100"})
    assert (status, body) == (206, b"ef")
    status, headers, _ = _raw(url, headers={"Range": "bytes=6-"})
    assert (status, headers["Content-Range"]) == (416, "bytes */6")
    status, headers, body = _raw(url, method="HEAD")
    assert (status, headers["Content-Length"], body) == (200, "6", b"")
    assert headers["Accept-Ranges"] == "bytes"
    assert _raw(http_backend.url("missing"))[0] == 404
    assert _raw(http_backend.url("..", "etc", "passwd"))[0] == 404


def test_http_ls(http_backend: servers.Backend) -> None:
    _write(http_backend, "a.bin", b"1")
    _write(http_backend, "sub dir/b.bin", b"22")
    _write(http_backend, "sub dir/deeper/c.bin", b"333")
    fs = http_backend.filesystem()
    top = {(e["name"], e["type"]) for e in fs.ls(http_backend.url_root + "/", detail=True)}
    root = http_backend.url_root
    assert top == {(f"{root}/a.bin", "file"), (f"{root}/sub%20dir/", "directory")}
    sub = fs.ls(f"{root}/sub%20dir/", detail=False)
    assert sub == [f"{root}/sub%20dir/b.bin", f"{root}/sub%20dir/deeper/"]
    assert fs.cat_file(f"{root}/sub%20dir/deeper/c.bin") == b"333"


def test_http_reset(http_backend: servers.Backend) -> None:
    assert http_backend.local_dir is not None
    _write(http_backend, "x/y", b"y")
    http_backend.reset()
    assert os.listdir(http_backend.local_dir) == []
    assert http_backend.filesystem().ls(http_backend.url_root + "/") == []
    assert _raw(http_backend.url("x", "y"))[0] == 404


def test_context_manager_stops_server(tmp_path) -> None:
    before = set(servers._LIVE)
    with servers.http_static_server(tmp_path) as b:
        (tmp_path / "z").write_bytes(b"zz")
        assert b.local_dir == str(tmp_path)
        assert b.filesystem().cat_file(b.url("z")) == b"zz"
        (pid,) = set(servers._LIVE) - before
        proc = servers._LIVE[pid]
    assert pid not in servers._LIVE
    assert proc.returncode is not None  # reaped
    with pytest.raises(OSError):
        _raw(b.url("z"))
