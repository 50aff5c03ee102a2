"""Hostile stores at the filesystem level: symlinks out of the store, FIFOs and folders where objects
should be, stray objects, and gc (a writer) run on such a store.

Readers must read nothing outside the store (the audit hook follows symlinks), never hang, and
gc must delete nothing but the objects it recognises, inside the store. On a memory store an
auditing filesystem records every path asked for.
"""

from __future__ import annotations

import contextlib
import os
import shutil
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
from treestore._format import paths as _paths

from ..support import hostile
from ._harness import check_readers

HOUR = 3600.0


def _old(path: Path, age: float = 2 * HOUR) -> None:
    t = time.time() - age
    os.utime(path, (t, t), follow_symlinks=False)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# --- symlinks out of the store ---------------------------------------------------------------------
@pytest.mark.timeout(30)
@pytest.mark.parametrize("what", ["chunk", "pack", "manifest", "record"])
def test_object_symlinked_to_a_file_outside(store, what):
    """The object is a symlink to a copy of itself outside the store: a reader must not follow it
    (the bytes would even verify), so it cannot be used to read other files."""
    if what == "chunk":
        path = store.chunk_file("w")
    elif what == "pack":
        path = store.chunk_file("small/a")
    elif what == "manifest":
        path = store.root / _paths.manifest_path(store.ref_record()["manifest"])
    else:
        path = store.root / _paths.record_path("bad")
    elsewhere = store.root.parent / "elsewhere"  # (not store.outside: that must stay untouched)
    elsewhere.mkdir()
    target = elsewhere / "copy"
    target.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(target)
    store.check()


@pytest.mark.timeout(30)
def test_chunk_symlinked_to_a_device(store):
    path = store.chunk_file("w")
    path.unlink()
    path.symlink_to("/dev/zero")
    store.check(ops=["load", "verify"], memory=16 * 2**20)


# --- special files: never block ----------------------------------------------------------------------
def _with_fifo(path: Path, fn: Any, timeout: float = 3.0) -> tuple[bool, Any]:
    """Run ``fn`` while ``path`` is a FIFO; (hung, result or exception). A hung reader is released
    by opening the FIFO's write end, so the test can report instead of hanging."""
    path.unlink()
    os.mkfifo(path)
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as exc:
            box.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    hung = t.is_alive()
    while t.is_alive():
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        t.join(0.1)
    return hung, box[0] if box else None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", ["chunk", "manifest", "record"])
def test_fifo_in_place_of_an_object(store, what):
    if what == "chunk":
        path = store.chunk_file("w")
    elif what == "manifest":
        path = store.root / _paths.manifest_path(store.ref_record()["manifest"])
    else:
        path = store.root / _paths.record_path("bad")
    hung, result = _with_fifo(path, lambda: treestore.load(store.url, "bad"))
    assert not hung, f"load blocked on a FIFO at {path.relative_to(store.root)}"
    assert isinstance(result, treestore.TreestoreError), result


@pytest.mark.timeout(30)
@pytest.mark.parametrize("what", ["chunk", "manifest", "record"])
def test_folder_in_place_of_an_object(store, what):
    if what == "chunk":
        path = store.chunk_file("w")
    elif what == "manifest":
        path = store.root / _paths.manifest_path(store.ref_record()["manifest"])
    else:
        path = store.root / _paths.record_path("bad")
    path.unlink()
    path.mkdir()
    (path / "x").write_bytes(b"x")
    out = store.check(ops=["load", "verify"] + (["list"] if what != "record" else []))
    assert out["load"].error is not None


# --- stray objects ----------------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_objects_nested_under_checkpoints(store):
    """checkpoints/ holds commit records directly; a nested object is not a checkpoint (it must
    neither break list() nor make a checkpoint appear twice)."""
    (store.root / "checkpoints" / "sub").mkdir()
    (store.root / "checkpoints" / "sub" / "stray").write_bytes(store.ref_bytes("bad"))
    (store.root / "checkpoints" / "sub" / "good").write_bytes(store.ref_bytes("good"))
    out = store.check(ops=["list", "latest", "load", "verify all"])
    assert out["list"].error is None, out["list"].error
    assert [c.name for c in out["list"].value] == ["good", "bad"]


@pytest.mark.timeout(30)
def test_stray_files_everywhere_are_ignored_by_readers(store):
    for rel in [
        "README",
        "chunks/README",
        "chunks/ab/notes.txt",
        "manifests/x",
        "locks/x",
        ".tmp-1",
        "chunks/.tmp-2",
    ]:
        (store.root / rel).parent.mkdir(parents=True, exist_ok=True)
        (store.root / rel).write_bytes(b"stray")
    store.check()


# --- gc on a hostile store -----------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_gc_deletes_nothing_outside_the_store_through_a_symlinked_folder(store):
    """locks/ is a symlink to a folder of the user's. gc removes stale locks: it must not remove
    the user's files (they are not locks, and not in the store)."""
    victim = store.outside
    for name in ["id_rsa", "save-123", "gc-" + uuid.uuid4().hex]:
        (victim / name).write_bytes(b"precious")
        _old(victim / name)
    before = _files(victim)
    locks = store.root / "locks"
    if locks.exists():
        locks.rmdir()
    locks.symlink_to(victim, target_is_directory=True)
    with contextlib.suppress(treestore.TreestoreError):  # (unguarded: the guard would stop gc
        treestore.Store(store.url).gc(grace=0)  # at its first write through the link)
    assert _files(victim) == before, "gc deleted or wrote files outside the store"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("folder", ["chunks", "manifests"])
def test_a_symlinked_object_folder_is_refused_and_gc_deletes_nothing_through_it(store, folder):
    """chunks/ (or manifests/) is a symlink to a folder outside the store holding the store's own
    objects and a file named like an unreferenced one. Listing it raises StorageError (never the
    outside folder's files), and gc, which deletes unreferenced objects it lists, deletes nothing
    there."""
    elsewhere = store.root.parent / f"elsewhere-{folder}"  # (not store.outside: see untouched())
    shutil.copytree(store.root / folder, elsewhere)
    h = "ab" + "cd" * 31
    decoy = elsewhere / "ab" / h if folder == "chunks" else elsewhere / h
    decoy.parent.mkdir(exist_ok=True)
    decoy.write_bytes(b"precious")
    _old(decoy)
    before = _files(elsewhere)
    shutil.rmtree(store.root / folder)
    (store.root / folder).symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(treestore.StorageError, match="outside the store"):
        treestore.Store(store.url)._storage.list(folder)
    try:
        report = treestore.Store(store.url).gc(grace=0)
    except treestore.StorageError:
        pass
    else:
        assert (report.chunks_removed, report.manifests_removed) == (0, 0), report
    assert decoy.exists(), "gc deleted a file outside the store"
    assert _files(elsewhere) == before, "gc deleted or wrote files outside the store"
    assert store.untouched()


@pytest.mark.timeout(30)
def test_gc_deletes_only_objects_it_recognises(store):
    """gc removes unreferenced chunks and manifests and stale lock objects; a file it does not
    recognise (not named like a chunk, manifest or lock) is not its to delete."""
    strays = ["chunks/ab/notes.txt", "manifests/README", "locks/README", "locks/save-but-not-a-lock"]
    for rel in strays:
        (store.root / rel).parent.mkdir(parents=True, exist_ok=True)
        (store.root / rel).write_bytes(b"mine")
        _old(store.root / rel)
    treestore.Store(store.url).gc(grace=0)
    left = [rel for rel in strays if not (store.root / rel).exists()]
    assert not left, f"gc deleted files it does not own: {left}"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("damage", ["garbage record", "missing manifest", "future version"])
def test_gc_on_a_damaged_store_deletes_nothing_and_reports(store, damage):
    """SPEC section 9: while any commit record or manifest cannot be read, gc deletes no chunk
    and no manifest (what the damaged checkpoint references is unknown); it does not raise, so
    one bad checkpoint does not stop a manager's retention, and its report names it."""
    orphan = store.root / "chunks" / "00" / ("00" * 32)
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(b"unreferenced")
    _old(orphan)
    if damage == "garbage record":
        store.write_ref(raw=b"\xc1garbage", name="good")
    elif damage == "missing manifest":
        (store.root / _paths.manifest_path(store.ref_record("good")["manifest"])).unlink()
    else:
        store.write_ref({**store.ref_record("good"), "version": 3}, name="good")
    before = _files(store.root)
    report = treestore.Store(store.url).gc(grace=0)
    assert report.damaged == ("good",)
    assert (report.chunks_removed, report.manifests_removed, report.bytes_freed) == (0, 0, 0)
    assert _files(store.root) == before


@pytest.mark.timeout(30)
@pytest.mark.parametrize("damage", ["garbage record", "missing manifest", "wrong name"])
def test_a_damaged_checkpoint_can_be_deleted(store, damage):
    """A damaged checkpoint keeps gc from freeing anything (above), so the user must be able to
    delete it; afterwards gc frees space again and the others still load."""
    if damage == "garbage record":
        store.write_ref(raw=b"\xc1garbage", name="good")
    elif damage == "missing manifest":
        (store.root / _paths.manifest_path(store.ref_record("good")["manifest"])).unlink()
    else:
        store.write_ref({**store.ref_record("bad"), "name": "other"}, name="good")
    s = treestore.Store(store.url)
    s.delete("good")
    assert not s.exists("good")
    assert s.gc(grace=0).damaged == ()
    s.load("bad")
    assert treestore.verify(store.url).ok


# --- a memory store, audited -------------------------------------------------------------------------
class AuditedMemory(MemoryFileSystem):
    """fsspec's memory filesystem under ``auditmem://``, recording every path it is asked for."""

    protocol = ("auditmem",)
    store: ClassVar[dict[str, Any]] = {}
    pseudo_dirs: ClassVar[list[str]] = [""]
    paths: ClassVar[list[str]] = []

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, str) and path.startswith("auditmem://"):
            path = "memory://" + path[len("auditmem://") :]
        return super()._strip_protocol(path)

    def _seen(self, path: Any) -> None:
        for p in path if isinstance(path, (list, tuple)) else [path]:
            AuditedMemory.paths.append(self._strip_protocol(p))

    def cat_file(self, path, *args, **kwargs):
        self._seen(path)
        return super().cat_file(path, *args, **kwargs)

    def _open(self, path, *args, **kwargs):
        self._seen(path)
        return super()._open(path, *args, **kwargs)

    def info(self, path, **kwargs):
        self._seen(path)
        return super().info(path, **kwargs)

    def ls(self, path, detail=True, **kwargs):
        self._seen(path)
        return super().ls(path, detail=detail, **kwargs)

    def pipe_file(self, path, *args, **kwargs):
        self._seen(path)
        return super().pipe_file(path, *args, **kwargs)

    def rm_file(self, path):
        self._seen(path)
        return super().rm_file(path)


fsspec.register_implementation("auditmem", AuditedMemory, clobber=True)


@pytest.mark.timeout(60)
def test_memory_store_reads_only_under_its_root():
    base = f"/audit-{uuid.uuid4().hex}"
    url = f"auditmem://{base}/store"
    other = f"auditmem://{base}/store-evil"
    tree = {"../../store-evil": {"w": np.arange(50_000, dtype=np.float32)}, "x": np.ones(3)}
    treestore.save(url, tree, "good")
    treestore.save(url, {**tree, "x": np.zeros(3)}, "bad")
    treestore.save(other, tree, "good")
    hostile.mutate_manifest(url, "bad", lambda m: m["leaves"][0].update(address="../../store-evil/w"))
    AuditedMemory.paths.clear()
    check_readers(url, root=None)
    assert treestore.Store(url).gc(grace=0).damaged == ("bad",)  # its manifest is refused
    outside = sorted({p for p in AuditedMemory.paths if not p.startswith(f"{base}/store/")})
    assert not outside, f"paths outside the store were used: {outside[:5]}"


def _swapped_after_lstat(monkeypatch: pytest.MonkeyPatch, target: str) -> None:
    """``os.lstat`` of ``target`` reports a regular file, as it was a moment before another
    process swapped it: the window between a reader's look and its open, made deterministic."""
    from treestore._storage import local

    real = os.lstat
    regular = os.lstat(__file__)

    def lstat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        return regular if os.fspath(path) == target else real(path, *args, **kwargs)

    monkeypatch.setattr(local.os, "lstat", lstat)


@pytest.mark.parametrize("swap", ["symlink", "fifo"])
def test_an_object_swapped_for_a_link_or_fifo_after_it_was_looked_at_is_refused(tmp_path, monkeypatch, swap):
    """A chunk replaced by a link (or a FIFO) between the reader's lstat and its open: the open
    refuses to follow the link (O_NOFOLLOW) and the open file is checked again (fstat), so the
    read fails with StorageError instead of reading outside the store or blocking on a FIFO."""
    url = str(tmp_path / "s")
    treestore.save(url, {"w": np.arange(50_000, dtype=np.float32)}, "a")
    (path,) = hostile.chunk_paths(url, "a")["w"]
    full = os.path.join(url, path)
    os.unlink(full)
    if swap == "symlink":
        outside = tmp_path / "outside"
        outside.write_bytes(b"secret")
        os.symlink(outside, full)
    else:
        os.mkfifo(full)
    _swapped_after_lstat(monkeypatch, full)
    with pytest.raises(
        treestore.StorageError, match="is a symlink" if swap == "symlink" else "not a regular file"
    ):
        treestore.load(url, "a")


def test_an_object_path_through_a_file_is_a_storage_error(tmp_path):
    """Inspecting an object whose folder is a file (lstat fails with ENOTDIR) is a StorageError
    naming it, not a bare OSError and not "absent"."""
    url = str(tmp_path / "s")
    treestore.save(url, {"w": np.arange(10.0)}, "a")
    (tmp_path / "s" / "chunks" / "zz").write_bytes(b"a file where a folder would be")
    with pytest.raises(treestore.StorageError, match=r"inspecting .*chunks/zz/x failed"):
        hostile.storage(url).object_size("chunks/zz/x")
