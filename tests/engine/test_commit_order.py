"""The commit order (SPEC.md §5.2): every chunk, then the manifest, then the commit record, each
made durable before the next. A save that fails or dies before its commit record is written
leaves no visible checkpoint, and what it wrote is unreferenced: gc removes it, and every
earlier checkpoint still loads.

Faults are injected by ``failwrite://``, fsspec's memory filesystem whose writes into one folder
of the store fail, and by a save in a child process that dies (``os._exit``) the moment it is
about to write its commit record.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem

import treestore
from tests.support.helpers import assert_tree_equal
from treestore._format import paths as _paths

OPTIONS = treestore.SaveOptions(chunk_size=64 * 1024, small_leaf=16 * 1024)


class FailingFileSystem(MemoryFileSystem):
    """fsspec's memory filesystem as ``failwrite://``: while ``fail_in`` names a folder of the
    store (``manifests``, ``checkpoints``), every write of an object in it raises OSError."""

    protocol = ("failwrite",)
    fail_in: ClassVar[str | None] = None

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.removeprefix("failwrite://"))

    def pipe_file(self, path, *args, **kwargs):
        folder = FailingFileSystem.fail_in
        if folder is not None and f"/{folder}/" in self._strip_protocol(path):
            raise OSError(f"injected fault: cannot write {path}")
        return super().pipe_file(path, *args, **kwargs)


fsspec.register_implementation("failwrite", FailingFileSystem, clobber=True)


@pytest.fixture
def failwrite():
    FailingFileSystem.fail_in = None
    yield f"failwrite://commit-order/{uuid.uuid4().hex}"
    FailingFileSystem.fail_in = None


def tree(v: int) -> dict[str, Any]:
    return {
        "w": np.arange(50_000, dtype=np.float32) + v,  # chunked
        "small": [np.full(3, v), np.int64(v)],  # packed
        "step": v,
    }


def objects(store: treestore.Store, folder: str) -> set[str]:
    return {o.path for o in store._storage.list(folder)}


@pytest.mark.parametrize("folder", ["manifests", "checkpoints"])
def test_a_save_that_fails_before_its_record_leaves_no_visible_checkpoint(failwrite, folder):
    """The write of the manifest, or of the commit record, fails: the save raises, the
    checkpoint is not listed and does not load, and the earlier one is untouched."""
    store = treestore.Store(failwrite)
    store.save(tree(0), "first", options=OPTIONS)
    FailingFileSystem.fail_in = folder
    with pytest.raises(treestore.StorageError, match="injected fault"):
        store.save(tree(1), "second", options=OPTIONS)
    FailingFileSystem.fail_in = None
    assert [c.name for c in store.list()] == ["first"]
    assert not store.exists("second")
    assert objects(store, _paths.CHECKPOINTS) == {_paths.record_path("first")}
    with pytest.raises(treestore.errors.CheckpointNotFoundError):
        store.load("second")
    assert_tree_equal(store.load("first"), tree(0))
    assert treestore.verify(failwrite).ok


def test_the_manifest_is_durable_before_the_record_is_written(failwrite):
    """The record's write fails: by then the manifest is written (the order of SPEC.md §5.2), and
    it is an unreferenced object, which gc removes with the save's chunks."""
    store = treestore.Store(failwrite)
    store.save(tree(0), "first", options=OPTIONS)
    manifests, chunks = objects(store, _paths.MANIFESTS), objects(store, _paths.CHUNKS)
    FailingFileSystem.fail_in = "checkpoints"
    with pytest.raises(treestore.StorageError, match="injected fault"):
        store.save(tree(1), "second", options=OPTIONS)
    FailingFileSystem.fail_in = None
    orphans = objects(store, _paths.MANIFESTS) - manifests
    assert len(orphans) == 1, "the manifest was not written before the commit record"
    assert store._storage.list(_paths.LOCKS) == []  # a failed save removes its lock
    report = store.gc(grace=0)
    assert report.manifests_removed == 1
    assert objects(store, _paths.MANIFESTS) == manifests
    assert objects(store, _paths.CHUNKS) == chunks
    assert_tree_equal(store.load("first"), tree(0))


def test_each_step_is_durable_before_the_next(tmp_path, monkeypatch):
    """The storage calls of one save, in order: chunks (each staged, then published on a thread
    of its own), sync, manifest, sync, commit record (put-if-absent), sync."""
    store = treestore.Store(str(tmp_path / "store"))
    storage = store._storage
    calls: list[str] = []
    lock = threading.Lock()

    def logged(name: str, fn: Any) -> Any:
        def call(path: str | None = None, *args: Any, **kwargs: Any) -> Any:
            folder = path.split("/", 1)[0] if path is not None else ""
            with lock:
                calls.append(f"{name} {folder}".strip())
            return fn(*args, **kwargs) if path is None else fn(path, *args, **kwargs)

        return call

    def stage(path: str, buffers: Any) -> Any:
        folder = path.split("/", 1)[0]
        staged = real_stage(path, buffers)
        publish = staged.publish

        def published() -> None:
            time.sleep(0.02)  # a slow disk: the commit must still wait for every chunk's name
            with lock:
                calls.append(f"publish {folder}")
            publish()

        with lock:
            calls.append(f"stage {folder}")
        monkeypatch.setattr(staged, "publish", published, raising=False)
        return staged

    real_stage = storage.stage
    monkeypatch.setattr(storage, "stage", stage)
    monkeypatch.setattr(storage, "write", logged("write", storage.write))
    monkeypatch.setattr(storage, "write_new", logged("write_new", storage.write_new))
    monkeypatch.setattr(storage, "sync", logged("sync", storage.sync))
    store.save(tree(0), "first", options=OPTIONS)
    steps = [
        c
        for c in calls
        if not c.endswith(_paths.LOCKS)
        and (c.endswith(_paths.CHUNKS) or c.split()[0] not in ("stage", "publish"))
    ]  # (a write stages and publishes its object too)
    chunk_steps = steps[: steps.index("sync")]
    assert chunk_steps.count("stage chunks") == chunk_steps.count("publish chunks") > 1, calls
    # collapse the chunks' calls
    steps = ["chunks", *steps[len(chunk_steps) :]]
    order = [c for i, c in enumerate(steps) if i == 0 or c != steps[i - 1]]
    assert order == [
        "chunks",
        "sync",
        f"write {_paths.MANIFESTS}",
        "sync",
        f"write_new {_paths.CHECKPOINTS}",
        "sync",
    ], calls


def test_a_new_folder_is_durable_in_its_parent_before_the_record(tmp_path, monkeypatch):
    """A save into a new store makes folders (the store's, its chunk folders, manifests): each
    one's name in its parent folder is fsynced before the commit record is written, else a crash
    could lose a folder of chunks the committed manifest names (fsyncing the folder itself makes
    only its own names durable)."""
    from treestore._storage import local as _local

    events: list[tuple[str, str]] = []
    real_fsync, real_write_new = _local._fsync, _local.LocalStorage.write_new

    def fsync(path: str) -> None:
        events.append(("fsync", os.path.normpath(path)))
        real_fsync(path)

    def write_new(self: Any, path: str, data: bytes) -> bool:
        if path.startswith(_paths.CHECKPOINTS + "/"):
            events.append(("record", path))
        return real_write_new(self, path, data)

    monkeypatch.setattr(_local, "_fsync", fsync)
    monkeypatch.setattr(_local.LocalStorage, "write_new", write_new)
    root = tmp_path / "new" / "store"
    treestore.save(str(root), tree(0), "first", options=OPTIONS)
    record = events.index(("record", f"{_paths.CHECKPOINTS}/first"))
    before = {path for kind, path in events[:record] if kind == "fsync"}
    made = [root.parent, root] + [p for p in root.rglob("*") if p.is_dir()]
    needed = [p for p in made if p.name != _paths.CHECKPOINTS]
    assert len(needed) > 3
    missing = [str(p.relative_to(tmp_path)) for p in needed if str(p.parent) not in before]
    assert not missing, f"folders whose names were not durable before the record: {missing}"
    after = {path for kind, path in events if kind == "fsync"}
    assert str(root) in after  # the checkpoints folder's name, by the time the save returns


KILLED_SAVE = """
import os, sys
import numpy as np
import treestore
from treestore._storage.local import LocalStorage

url = sys.argv[1]
treestore.save(url, {"w": np.arange(50_000, dtype=np.float32)}, "first")
write_new = LocalStorage.write_new

def die(self, path, data):
    if path.startswith("checkpoints/"):
        print("dying", flush=True)
        os._exit(9)  # killed between the manifest and the commit record
    return write_new(self, path, data)

LocalStorage.write_new = die
treestore.save(url, {"w": np.arange(50_000, dtype=np.float32) + 1}, "second")
"""


@pytest.mark.timeout(120)
def test_a_save_killed_before_its_record_leaves_an_unreferenced_manifest(tmp_path):
    """A process dies the moment it is about to write its commit record: nothing is visible,
    its manifest is written and unreferenced, its lock names a dead process, and gc removes
    the manifest and the chunks only it referenced."""
    url = str(tmp_path / "store")
    env = dict(os.environ)
    here = str(Path(treestore.__file__).resolve().parent.parent)  # the treestore under test
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(KILLED_SAVE), url],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert child.returncode == 9 and "dying" in child.stdout, child.stderr[-2000:]
    store = treestore.Store(url)
    assert [c.name for c in store.list()] == ["first"]
    assert not store.exists("second")
    live = store.manifest("first").chunk_digests()
    assert len(objects(store, _paths.MANIFESTS)) == 2, "the manifest was not written before the record"
    assert len(objects(store, _paths.LOCKS)) == 1  # the dead save's lock
    report = store.gc(grace=0)
    assert report.manifests_removed == 1 and report.chunks_removed > 0, report
    assert {_paths.chunk_path(d) for d in live} == objects(store, _paths.CHUNKS)
    assert objects(store, _paths.LOCKS) == set()
    np.testing.assert_array_equal(store.load("first")["w"], np.arange(50_000, dtype=np.float32))
    assert treestore.verify(url).ok


def _local_store_with_one_checkpoint(tmp_path: Path) -> tuple[treestore.Store, set[str]]:
    store = treestore.Store(str(tmp_path / "store"))
    store.save(tree(0), "first", options=OPTIONS)
    return store, objects(store, _paths.CHUNKS)


def _nothing_left(store: treestore.Store, chunks: set[str]) -> None:
    """After a failed save: only the first checkpoint, which loads, and no temporary file;
    chunk objects the save named are unreferenced (gc removes them)."""
    assert [c.name for c in store.list()] == ["first"]
    assert store._storage.temporaries("") == []
    assert_tree_equal(store.load("first"), tree(0))
    store.gc(grace=0)
    assert objects(store, _paths.CHUNKS) == chunks


@pytest.mark.parametrize("folder", [_paths.CHUNKS, _paths.MANIFESTS])
def test_a_local_object_that_cannot_take_its_name_fails_the_save_and_leaves_nothing(
    tmp_path, monkeypatch, folder
):
    """Chunks take their names on threads of their own (publishing): one that fails there fails
    the save, which removes every temporary file it made and commits nothing; so does a
    manifest that cannot take its name."""
    store, chunks = _local_store_with_one_checkpoint(tmp_path)
    real_replace = os.replace

    def replace(src: Any, dst: Any, **kw: Any) -> None:
        if f"/{folder}/" in os.fspath(dst):
            raise PermissionError(13, "injected fault", os.fspath(dst))
        real_replace(src, dst, **kw)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(treestore.StorageError, match="injected fault"):
        store.save(tree(1), "second", options=OPTIONS)
    monkeypatch.undo()
    _nothing_left(store, chunks)


def test_a_save_that_fails_while_chunks_wait_for_their_names_leaves_nothing(tmp_path, monkeypatch):
    """The disk is slow to name chunks, and encoding a later chunk fails: the chunks still
    waiting are never named and their temporary files are removed."""
    from treestore._engine.saving import chunk_writer as _write
    from treestore._storage import local as _local

    store, chunks = _local_store_with_one_checkpoint(tmp_path)
    real_publish, real_encode = _local._LocalStaged.publish, _write.encode
    encoded = 0

    def slow_publish(self: Any) -> None:
        time.sleep(0.05)
        real_publish(self)

    def encode(*args: Any, **kwargs: Any) -> Any:
        nonlocal encoded
        encoded += 1
        if encoded == 6:
            raise OSError("injected fault while encoding")
        return real_encode(*args, **kwargs)

    monkeypatch.setattr(_local._LocalStaged, "publish", slow_publish)
    monkeypatch.setattr(_write, "encode", encode)
    with pytest.raises(OSError, match="injected fault"):
        store.save(
            tree(1), "second", options=treestore.SaveOptions(chunk_size=16 * 1024, small_leaf=1024, threads=2)
        )
    assert encoded >= 6
    monkeypatch.undo()
    _nothing_left(store, chunks)


def test_chunks_still_waiting_when_one_cannot_take_its_name_are_removed(tmp_path, monkeypatch):
    """The first chunk's publishing fails once every chunk is staged, while the others wait
    their turn: the save fails, and the chunks that never got their turn leave no temporary
    file behind."""
    from treestore._storage import local as _local

    store, chunks = _local_store_with_one_checkpoint(tmp_path)
    real_publish = _local._LocalStaged.publish
    calls = 0
    lock = threading.Lock()

    def publish(self: Any) -> None:
        nonlocal calls
        if f"/{_paths.CHUNKS}/" not in self._full:  # a lock or a manifest
            real_publish(self)
            return
        with lock:
            calls += 1
            first = calls == 1
        if first:
            time.sleep(0.2)  # the save has staged every chunk and waits for their names
            self.discard()
            raise treestore.StorageError("injected fault: the disk refused a name")
        time.sleep(0.05)
        real_publish(self)

    monkeypatch.setattr(_local._LocalStaged, "publish", publish)
    with pytest.raises(treestore.StorageError, match="injected fault"):
        store.save(tree(1), "second", options=treestore.SaveOptions(chunk_size=8 * 1024, small_leaf=1024))
    monkeypatch.undo()
    assert 1 < calls < 25, calls  # some chunks were published, some never got their turn
    _nothing_left(store, chunks)


@pytest.mark.parametrize("damage", ["flipped", "truncated", "longer"])
def test_a_commit_replaces_a_damaged_object_under_its_manifests_name(tmp_path, damage):
    """A copy commits exactly the source's manifest bytes, so their object name is known ahead: an
    object already under that name whose bytes differ (damaged, cut short, or with bytes after
    them) is replaced, never trusted, and the copy loads."""
    from treestore._engine.reading import committed as _committed

    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    tree = {"w": np.arange(1000, dtype=np.float32), "b": np.ones(3)}
    treestore.save(src, tree, "a")
    storage = treestore.Store(src)._storage
    path = _paths.manifest_path(_committed.read_commit_record(storage, "a").manifest)
    good = storage.read(path)
    assert good is not None
    bad = {
        "flipped": good[:-8] + bytes([good[-8] ^ 0xFF]) + good[-7:],
        "truncated": good[: len(good) // 2],
        "longer": good + b"\0",
    }[damage]
    planted = Path(dst) / path
    planted.parent.mkdir(parents=True)
    planted.write_bytes(bad)
    treestore.copy(f"{src}#a", dst)
    assert planted.read_bytes() == good
    assert_tree_equal(treestore.load(dst, "a"), tree)
    assert treestore.verify(dst).ok
