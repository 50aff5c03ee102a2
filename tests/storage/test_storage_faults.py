"""A store whose storage fails keeps every checkpoint: listings that fail abort gc and list, and
store folders removed under a live Store or CheckpointManager come back.

Faults are injected by real means, never by patching treestore: a folder replaced by a regular
file (the tests run as root, so permissions would not stop a listing) and ``faultmem://``
(tests/support/faults.py). Each test reproduces one finding of an external attack report
(issue 12.N)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

import treestore
from tests.support.faults import (
    FaultyMemoryFileSystem,
    chunk_objects,
    chunked_tree,
    fs_root,
    objects,
    outcome,
)
from tests.support.helpers import assert_tree_equal


# --- 12.1: a listing that fails must abort gc -----------------------------------------------------
def _save_and_orphan(url: str) -> dict[str, Any]:
    """Checkpoints a and b, plus c deleted again (its chunks and manifest unreferenced)."""
    trees = {"a": chunked_tree(1), "b": chunked_tree(2)}
    for name, t in trees.items():
        treestore.save(url, t, name)
    treestore.save(url, chunked_tree(3), "c")
    treestore.Store(url).delete("c")
    return trees


def _check_gc_aborted(url: str, failure: BaseException | None, before: set[str], trees: dict, what: str):
    """After the fault is removed: every checkpoint loads bit-exact, gc deleted nothing, and it
    raised a StorageError naming what it could not list."""
    for name, t in trees.items():
        assert_tree_equal(treestore.load(url, name), t)
    after = {p for p in objects(url) if not p.startswith("locks/")}
    assert before - after == set(), f"gc deleted {sorted(before - after)} although a listing failed"
    assert isinstance(failure, treestore.errors.StorageError), f"gc did not raise a StorageError: {failure!r}"
    assert what in str(failure), f"the error does not name {what!r}: {failure}"


def test_gc_aborts_when_local_checkpoints_cannot_be_listed(tmp_path: Path):
    """(A local manifests/ that cannot be listed cannot be read either, and gc already stops.)"""
    folder = "checkpoints"
    url = str(tmp_path / "store")
    trees = _save_and_orphan(url)
    before = {p for p in objects(url) if not p.startswith("locks/")}
    real = Path(url) / folder
    moved = tmp_path / f"moved-{folder}"
    os.rename(real, moved)
    real.write_bytes(b"not a folder")  # os.walk cannot list it
    try:
        failure = outcome(lambda: treestore.Store(url).gc(grace=0))
    finally:
        real.unlink()
        os.rename(moved, real)
    _check_gc_aborted(url, failure, before, trees, folder)


@pytest.mark.parametrize("folder", ["checkpoints", "manifests", "chunks/<hh>"])
def test_gc_aborts_when_an_fsspec_folder_cannot_be_listed(faultmem: str, folder: str):
    trees = _save_and_orphan(faultmem)
    before = {p for p in objects(faultmem) if not p.startswith("locks/")}
    root = fs_root(faultmem)[1]
    if folder == "chunks/<hh>":  # the folder of a chunk only the deleted checkpoint used
        live = set(chunk_objects(faultmem))
        orphan = sorted(live - _chunks_of(faultmem, ["a", "b"]))[0]
        folder = os.path.dirname(orphan)
    FaultyMemoryFileSystem.unlistable = {f"{root}/{folder}"}
    try:
        failure = outcome(lambda: treestore.Store(faultmem).gc(grace=0))
    finally:
        FaultyMemoryFileSystem.unlistable = set()
    _check_gc_aborted(faultmem, failure, before, trees, folder.split("/")[0])


def _chunks_of(url: str, names: list[str]) -> set[str]:
    """The chunk objects the named checkpoints reference (read through the public manifest)."""
    out = set()
    store = treestore.Store(url)
    for name in names:
        m = store.manifest(name)
        refs = [*m.packs, *(c for e in m.leaves for c in e.chunks if c.pack is None)]
        for c in refs:
            h = c.digest.hex()
            out.add(f"chunks/{h[:2]}/{h}")
    return out


@pytest.mark.parametrize("backend", ["local", "fsspec"])
def test_list_raises_when_checkpoints_cannot_be_listed(tmp_path: Path, faultmem: str, backend: str):
    url = str(tmp_path / "store") if backend == "local" else faultmem
    treestore.save(url, chunked_tree(1), "a")
    if backend == "local":
        shutil.rmtree(Path(url) / "checkpoints")
        (Path(url) / "checkpoints").write_bytes(b"not a folder")
    else:
        FaultyMemoryFileSystem.unlistable = {f"{fs_root(url)[1]}/checkpoints"}
    with pytest.raises(treestore.errors.StorageError, match="checkpoints"):
        treestore.Store(url).list()


# --- 12.9: a store folder removed under a live Store or CheckpointManager --------------------------
@pytest.mark.parametrize("folder", ["locks", "checkpoints", "manifests", "the whole store"])
def test_a_store_recreates_a_removed_folder(tmp_path: Path, folder: str):
    url = str(tmp_path / "store")
    store = treestore.Store(url)
    store.save(chunked_tree(41), "a")
    shutil.rmtree(url if folder == "the whole store" else os.path.join(url, folder))
    data = chunked_tree(42)
    failure = outcome(lambda: store.save(data, "b"))
    assert failure is None, f"save after removing {folder} raised {failure!r}"
    assert_tree_equal(store.load("b"), data)
    assert_tree_equal(treestore.Store(url).load("b"), data)


def test_a_store_folder_swapped_for_a_link_under_a_live_store_is_never_written_through(tmp_path: Path):
    """A folder this Storage made, replaced by a symlink to a folder outside the store while the
    Storage lives: the next write into it is a StorageError naming the link, and nothing is
    written outside the store."""
    from treestore._storage.registry import open_storage

    root, outside = tmp_path / "store", tmp_path / "outside"
    outside.mkdir()
    storage = open_storage(str(root))
    storage.write("chunks/ab/first", [b"first"])
    shutil.rmtree(root / "chunks" / "ab")
    (root / "chunks" / "ab").symlink_to(outside, target_is_directory=True)
    with pytest.raises(treestore.StorageError, match="is a symlink"):
        storage.write("chunks/ab/second", [b"second"])
    assert list(outside.iterdir()) == []


def test_a_manager_recreates_a_removed_store(tmp_path: Path):
    url = str(tmp_path / "store")
    with treestore.CheckpointManager(url, async_save=False) as m:
        m.save(1, chunked_tree(51))
        shutil.rmtree(url)
        data = chunked_tree(52)
        failure = outcome(lambda: m.save(2, data))
        assert failure is None, f"save after removing the store raised {failure!r}"
        assert m.latest_step() == 2
        assert_tree_equal(m.restore(), data)


def test_a_local_path_that_leads_out_of_the_store_is_refused_before_any_file_is_touched(tmp_path: Path):
    """Store paths are built from checked names, but the local backend does not rely on it: a
    path whose folder lies outside the store's root (``..``) is a StorageError for reads,
    listings and writes alike, and nothing outside the root is read, listed or made."""
    from treestore._storage.registry import open_storage

    root, outside = tmp_path / "store", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret").write_bytes(b"not the store's")
    storage = open_storage(str(root))
    calls = {
        "read": lambda: storage.read("../outside/secret"),
        "list": lambda: storage.list("../outside"),
        "write": lambda: storage.write("../outside/made", [b"x"]),
    }
    for what, call in calls.items():
        with pytest.raises(treestore.StorageError, match=r"outside.* leads outside the store"):
            call()
        assert sorted(p.name for p in outside.iterdir()) == ["secret"], what
