"""Refusals of damaged or hostile input that other tests leave unreached (.ci/uncovered_raises.txt):
a source that fails mid-fetch, a part changed under a copy, a part lost under a multi-process
save, a destination that cannot take an export, and hostile trees and columns. Each names what
it expected and what it found, and leaves nothing behind."""

from __future__ import annotations

import collections
import http.server
import os
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import msgpack
import numpy as np
import pytest
import safetensors.numpy

import treestore
from tests.format.test_parts_merge import OPTIONS, _reparted, saved
from tests.support import hostile
from tests.support.jobs import prepared, rows, run_job
from treestore._engine.group.group_runtime import JaxRuntime
from treestore._engine.reading.committed import read_commit_record, read_manifest_bytes
from treestore._format.encoding import Bad
from treestore._format.manifest.codec import columns_from_fields, decode_any
from treestore._format.manifest.columns import ARRAY_FIELDS, Columns
from treestore._format.manifest.tree import check_nodes
from treestore._storage.registry import open_storage


# --- a source whose file cannot be fetched ------------------------------------------------------
class _Files(http.server.BaseHTTPRequestHandler):
    """Serves 64 bytes at every path (HEAD and GET), as a file server or a hub would."""

    def _head(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "64")
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()

    def do_HEAD(self) -> None:
        self._head()

    def do_GET(self) -> None:
        self._head()
        self.wfile.write(bytes(64))

    def log_message(self, *args: Any) -> None:  # quiet
        pass


def _serve(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """The base URL of a server of ``handler`` on 127.0.0.1, stopped when the test is done."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
def files_server() -> Iterator[str]:
    """The base URL of a :class:`_Files` server on 127.0.0.1."""
    yield from _serve(_Files)


def test_an_import_whose_fetch_fails_is_a_storage_error(files_server, tmp_path, monkeypatch):
    """The source has the file, but its copy cannot be made (a file name longer than the local
    filesystem allows): a StorageError naming the URL and what failed, no checkpoint, and no
    temporary folder left behind (in a temporary folder of this test's own: other tests, in
    other processes, import at the same time)."""
    url = f"{files_server}/{'w' * 300}"
    dst = str(tmp_path / "store")
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    before = set(Path(tempfile.gettempdir()).glob("treestore-import-*"))
    with pytest.raises(treestore.StorageError) as caught:
        treestore.import_file(url, f"{dst}#w")
    message = str(caught.value)
    assert message.startswith(f"reading {url} failed: OSError: "), message
    assert "File name too long" in message, message
    assert not Path(dst).exists() or treestore.Store(dst).list() == []
    assert set(Path(tempfile.gettempdir()).glob("treestore-import-*")) == before


class _Truncating(_Files):
    """Promises 64 bytes (HEAD and GET) and sends 10 before closing the connection: a server or
    proxy that fails mid-body."""

    def do_GET(self) -> None:
        self._head()
        self.wfile.write(bytes(10))
        self.wfile.flush()
        self.close_connection = True


@pytest.fixture
def truncating_server() -> Iterator[str]:
    """The base URL of a :class:`_Truncating` server on 127.0.0.1."""
    yield from _serve(_Truncating)


def test_an_import_whose_source_stops_mid_body_is_a_storage_error(truncating_server, tmp_path):
    """The HTTP client's own error for a body cut short (aiohttp's ClientPayloadError, no
    OSError) is a StorageError naming the URL; it escaped as the client's error."""
    url = f"{truncating_server}/w.safetensors"
    dst = str(tmp_path / "store")
    with pytest.raises(treestore.StorageError) as caught:
        treestore.import_file(url, f"{dst}#w")
    message = str(caught.value)
    assert message.startswith(f"reading {url} failed: "), message
    assert "payload" in message.lower() or "content length" in message.lower(), message
    assert not Path(dst).exists() or treestore.Store(dst).list() == []


def test_an_import_from_a_url_keeps_the_destination_s_refusal(tmp_path):
    """The source was read; the destination already holds the checkpoint: the error is the
    destination's CheckpointExistsError, as from a local file (it was a StorageError saying
    reading the source had failed), and the checkpoint there is left as it was."""
    fs = fsspec.filesystem("memory")
    src = f"/remote-src-{uuid.uuid4().hex}/w.safetensors"
    with fs.open(src, "wb") as f:
        f.write(safetensors.numpy.save({"x": np.ones(2, np.float32)}))
    dst = str(tmp_path / "store")
    treestore.save(dst, {"old": np.zeros(3)}, "w")
    with pytest.raises(treestore.errors.CheckpointExistsError) as caught:
        treestore.import_file(f"memory://{src}", f"{dst}#w")
    message = str(caught.value)
    assert message.startswith("checkpoint 'w' already exists in "), message
    assert "memory://" not in message, message
    assert list(treestore.load(dst, "w")) == ["old"]


# --- a part that changes under a copy ----------------------------------------------------------
def test_a_part_changed_while_it_is_copied_commits_nothing(store_url):
    """The copy reads and checks the parts, then copies the chunks; a part changed meanwhile (by
    a hostile or broken source) is caught when it is copied: ManifestDamagedError naming the
    checkpoint and the part, and no checkpoint at the destination."""
    saved(store_url)
    dst = f"memory://treestore-tests/copy-{uuid.uuid4().hex}"
    changed: list[int] = []

    def progress(done: int, total: int) -> None:
        if not changed:  # once, as the first chunk is done: after the parts were checked
            changed.append(done)
            _reparted(store_url, "job", 2, lambda d: d[:-1] + bytes([d[-1] ^ 1]), keep_digest=True)

    with pytest.raises(treestore.errors.ManifestDamagedError) as caught:
        treestore.copy(f"{store_url}#job", dst, progress=progress, threads=1)
    assert changed, "the copy reported no progress before copying the parts"
    message = str(caught.value)
    assert message.startswith("manifest of checkpoint 'job': its part "), message
    assert "does not match its digest" in message and caught.value.checkpoint == "job"
    assert treestore.Store(dst).list() == []


# --- a part lost under a multi-process save ------------------------------------------------------
class _LosesPartOf:
    """A storage on which the part that one process writes never arrives (a write acknowledged
    and lost)."""

    def __init__(self, storage: Any, thread: str) -> None:
        self._storage, self._thread = storage, thread
        self.lost: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._storage, name)

    def write(self, path: str, buffers: Any) -> None:
        if path.startswith("manifests/") and threading.current_thread().name == self._thread:
            self.lost.append(path)
            return
        self._storage.write(path, buffers)


def test_a_part_lost_before_the_primary_merges_fails_the_save(store_url):
    """With a sharded leaf of no elements the primary merges the parts to check them; a part
    that never arrived fails the save on every process, naming the process and the part, and
    nothing is committed."""
    tree = {"e": np.zeros((0, 4), np.float32), "v": np.arange(16, dtype=np.int32)}
    boxes = {"e": [[((0, 0), (0, 4))], [], [], []], "v": rows(16, 4)}
    storage = _LosesPartOf(open_storage(store_url), "process-1")
    results = run_job(storage, [prepared(tree, boxes, i) for i in range(4)], "job", options=OPTIONS)
    assert storage.lost, "process 1 wrote no part"
    assert isinstance(results[0], treestore.StorageError), results[0]
    message = str(results[0])
    assert message.startswith("multi-process save of checkpoint 'job' failed: "), message
    assert "process 1: its part" in message and "is missing" in message, message
    assert all(isinstance(r, treestore.StorageError) for r in results[1:]), results
    assert treestore.Store(store_url).list() == []


def test_jax_s_runtime_needs_jax_distributed_initialized():
    """A multi-process save synchronises through jax.distributed's client: without one, the
    runtime refuses to start, saying what to call."""
    with pytest.raises(treestore.StorageError) as caught:
        JaxRuntime()
    message = str(caught.value)
    assert "this is process 0 of 1, but jax.distributed is not initialized" in message, message
    assert "jax.distributed.initialize()" in message


# --- an export whose destination cannot take it ---------------------------------------------------
def test_an_orbax_export_that_cannot_be_put_in_place_keeps_the_old_folder(tmp_path):
    """The new orbax folder is complete, but moving the old one aside fails (a file holds the
    name it moves to): a StorageError naming the destination, the old folder as it was, the
    file untouched and no temporary folder left."""
    pytest.importorskip("orbax.checkpoint")
    url = f"memory://treestore-tests/{uuid.uuid4().hex}"
    treestore.save(url, {"w": np.ones(2)}, "c")
    out = tmp_path / "o"
    treestore.export_file(url, out, format="orbax")
    before = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    blocker = tmp_path / f".o.old-{os.getpid()}"
    blocker.write_bytes(b"not a folder")
    with pytest.raises(treestore.StorageError) as caught:
        treestore.export_file(url, out, format="orbax", overwrite=True)
    assert str(caught.value).startswith(f"cannot put the orbax checkpoint at {out}: "), str(caught.value)
    assert {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert blocker.read_bytes() == b"not a folder"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["o", blocker.name])


# --- hostile trees and columns -------------------------------------------------------------------
Pair = collections.namedtuple("Pair", "a b")


def test_a_namedtuple_node_without_a_str_name_is_refused(tmp_path):
    """A version-1 manifest whose namedtuple node names its type with a number: every reader
    refuses it as damaged, naming the field."""
    url = str(tmp_path / "store")
    treestore.save(url, {"p": Pair(np.arange(3.0), np.ones(2))}, "bad")

    def change(rec: dict[str, Any]) -> None:
        (node,) = [c for c in rec["tree"]["children"] if c["type"] == "namedtuple"]
        assert node["name"].endswith("Pair")
        node["name"] = 7

    hostile.mutate_manifest(url, "bad", change)
    for read in (lambda: treestore.load(url, "bad"), lambda: treestore.open(url, "bad").tree):
        with pytest.raises(treestore.errors.ManifestDamagedError) as caught:
            read()
        assert "field 'name' of a namedtuple node should be str" in str(caught.value), str(caught.value)
        assert caught.value.checkpoint == "bad"


def _columns(url: str, name: str) -> tuple[Columns, dict[str, Any]]:
    """The columns of checkpoint ``name`` and the fields ``columns_from_fields`` takes for them
    (what a reader decodes from the manifest's bytes)."""
    storage = open_storage(url)
    data = read_manifest_bytes(storage, read_commit_record(storage, name))
    columns = decode_any(data, name)
    assert isinstance(columns, Columns)
    rec = msgpack.unpackb(data, raw=False)
    skip = ("nodes", "node_leaves")  # the tree is passed on its own
    fields: dict[str, Any] = {k: np.frombuffer(rec[k], t) for k, t in ARRAY_FIELDS.items() if k not in skip}
    fields.update({key: rec[key] for key in ("name", "created", "metadata", "codec", "chunk_size", "values")})
    return columns, fields


def test_columns_assembled_from_hostile_fields_are_refused(tmp_path):
    """The columns a multi-process save assembles are checked as a reader checks a manifest: a
    field of the wrong dtype, or a tree of another leaf count, is refused naming the checkpoint
    and what it expected."""
    url = str(tmp_path / "store")
    treestore.save(url, {"a": np.arange(4.0), "b": np.ones((2, 3), np.int16), "n": 3}, "job")
    treestore.save(url, {"only": np.arange(2)}, "other")
    columns, fields = _columns(url, "job")
    again = columns_from_fields(fields, columns.nodes)  # as they are: accepted
    assert again.addresses == columns.addresses == ["a", "b", "n"]
    narrow = {**fields, "shapes": fields["shapes"].astype("<u4")}
    with pytest.raises(treestore.InvalidInputError) as caught:
        columns_from_fields(narrow, columns.nodes)
    assert str(caught.value) == (
        "checkpoint 'job': its manifest would not be readable: field 'shapes' has dtype uint32, not uint64"
    )
    assert caught.value.checkpoint == "job"
    other, _ = _columns(url, "other")
    with pytest.raises(treestore.InvalidInputError) as caught:
        columns_from_fields(fields, other.nodes)
    assert str(caught.value).endswith("would not be readable: the tree has 1 leaves, the columns 3")


def test_a_node_table_with_a_segment_that_is_not_str_is_refused(tmp_path):
    url = str(tmp_path / "store")
    treestore.save(url, {"a": np.arange(4.0), "b": 1}, "c")
    nodes = _columns(url, "c")[0].nodes
    assert (
        check_nodes(nodes.segments, nodes.table, nodes.names, nodes.leaves, 2).addresses()
        == nodes.addresses()
    )
    hostile_segments: Any = (*nodes.segments[:-1], 7)
    with pytest.raises(Bad, match=f"^segment {len(nodes.segments) - 1} should be str, found int$"):
        check_nodes(hostile_segments, nodes.table, nodes.names, nodes.leaves, 2)


# --- a process out of file descriptors -------------------------------------------------------------
OUT_OF_FILES = r"""
import os, resource, sys
from pathlib import Path
from treestore._api.interop import hf_shards, orbax_folders
from treestore.errors import TreestoreError

folder, shard = Path(sys.argv[1]), Path(sys.argv[2])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
held = []
try:
    while True:  # every descriptor taken: a stat still answers, an open does not
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
said = []
for check in (lambda: orbax_folders.check_orbax_files(folder), lambda: hf_shards._map(shard)):
    try:
        check()
        said.append("no error")
    except TreestoreError as exc:
        said.append(f"{type(exc).__name__}: {exc}")
for fd in held:
    os.close(fd)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
print("\n".join(said))
"""


def test_a_process_out_of_file_descriptors_refuses_what_it_cannot_open(tmp_path):
    """A folder that stats as a folder but cannot be listed, and a shard that cannot be mapped
    (here: the process has no file descriptor left), are refused naming the path and why."""
    folder = tmp_path / "orbax" / "item"
    folder.mkdir(parents=True)
    (folder / "_METADATA").write_text("{}")
    shard = tmp_path / "model-00001-of-00001.safetensors"
    shard.write_bytes(bytes(16))
    env = dict(os.environ)
    here = str(Path(treestore.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-c", OUT_OF_FILES, str(folder), str(shard)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"UnsupportedFormatError: {folder}: cannot list it: Too many open files",
        f"StorageError: cannot map {shard}: [Errno 24] Too many open files: '{shard}'",
    ], done.stdout
