"""A multi-process save whose storage fails one process at one step: the primary's outcome record
lost, damaged, unreadable or not removable, and a part that cannot be written. Every process
learns the right outcome, naming what failed; a committed checkpoint stays committed.

Jobs of threads stand in for the processes (tests/support/jobs.py), as in test_parts_merge.py.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

import treestore
from tests.format.test_parts_merge import OPTIONS
from tests.support.jobs import prepared, rows, run_job
from treestore._engine.group import distributed as D
from treestore._engine.write import SaveResult
from treestore._storage.registry import open_storage
from treestore.errors import BarrierTimeoutError, StorageError

TREE = {"v": np.arange(64, dtype=np.float32), "w": np.ones((8, 4), np.int16), "step": 3}
BOXES = {"v": rows(64, 4), "w": rows(8, 4, 4)}


def trees() -> list[Any]:
    return [prepared(TREE, BOXES, i) for i in range(4)]


class Failing:
    """A storage whose writes, reads or deletes of paths matching ``match`` fail as ``how``
    says, for the calls of one thread (None: every thread)."""

    def __init__(self, storage: Any, thread: str | None, match: Callable[[str], bool]) -> None:
        self._storage, self._thread, self._match = storage, thread, match
        self.write_as: Callable[[bytes], bytes | None] | None = None  # None result: the write is lost
        self.fail_write = self.fail_read = self.fail_delete = False
        self.hits: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._storage, name)

    def _mine(self, path: str) -> bool:
        hit = self._match(path) and self._thread in (None, threading.current_thread().name)
        if hit:
            self.hits.append(path)
        return hit

    def write(self, path: str, buffers: Any) -> None:
        if self._mine(path):
            if self.fail_write:
                raise StorageError(f"writing {path} failed: PermissionError: disk on fire")
            if self.write_as is not None:
                data = self.write_as(b"".join(bytes(b) for b in buffers))
                if data is None:
                    return
                buffers = [data]
        self._storage.write(path, buffers)

    def read(self, path: str, **kwargs: Any) -> Any:
        if self.fail_read and self._mine(path):
            raise StorageError(f"reading {path} failed: ConnectionResetError: reset by peer")
        return self._storage.read(path, **kwargs)

    def delete_many(self, paths: Any) -> None:
        paths = list(paths)
        if self.fail_delete and any(self._mine(p) for p in paths):
            raise StorageError(f"deleting {paths[0]} failed: PermissionError: read-only")
        self._storage.delete_many(paths)


def outcome(path: str) -> bool:
    return path.endswith("/outcome")


def _committed_and_followers_fail(store_url: str, results: list[Any], why: str) -> None:
    """The primary committed; each other process says the save failed, naming ``why``."""
    assert isinstance(results[0], SaveResult), results[0]
    for r in results[1:]:
        assert isinstance(r, StorageError), r
        assert str(r) == f"multi-process save of checkpoint 'job' failed: {why}", str(r)
    back = treestore.load(store_url, "job")
    assert np.array_equal(back["v"], TREE["v"]) and np.array_equal(back["w"], TREE["w"])


def test_an_outcome_record_lost_fails_the_followers(store_url):
    storage = Failing(open_storage(store_url), "process-0", outcome)
    storage.write_as = lambda data: None
    results = run_job(storage, trees(), "job", options=OPTIONS)
    assert storage.hits
    _committed_and_followers_fail(store_url, results, "the primary process wrote no outcome")


def test_a_malformed_outcome_record_fails_the_followers(store_url):
    storage = Failing(open_storage(store_url), "process-0", outcome)
    storage.write_as = lambda data: b"\xc1 not msgpack"
    results = run_job(storage, trees(), "job", options=OPTIONS)
    _committed_and_followers_fail(store_url, results, "the primary process's outcome record is malformed")


def test_an_outcome_record_that_cannot_be_read_fails_that_follower(store_url):
    storage = Failing(open_storage(store_url), "process-2", outcome)
    storage.fail_read = True
    results = run_job(storage, trees(), "job", options=OPTIONS)
    assert all(isinstance(r, SaveResult) for i, r in enumerate(results) if i != 2), results
    assert isinstance(results[2], StorageError), results[2]
    assert str(results[2]).startswith(
        "multi-process save of checkpoint 'job' failed: its outcome record cannot be read (reading "
    ), str(results[2])
    assert "reset by peer" in str(results[2])
    assert [c.name for c in treestore.Store(store_url).list()] == ["job"]


def test_an_outcome_record_that_cannot_be_removed_is_left_for_gc(store_url, caplog):
    storage = Failing(open_storage(store_url), "process-0", outcome)
    storage.fail_delete = True
    with caplog.at_level(logging.WARNING, "treestore"):
        results = run_job(storage, trees(), "job", options=OPTIONS)
    assert all(isinstance(r, SaveResult) for r in results), results
    said = [r.getMessage() for r in caplog.records]
    assert any("job: committed; could not remove its outcome record: " in s for s in said), said
    store = treestore.Store(store_url)
    assert [c.name for c in store.list()] == ["job"]
    assert any(o.path.endswith("/outcome") for o in store._storage.list("staging"))  # left for gc
    assert store.gc().chunks_removed == 0 and store._storage.list("staging")  # younger than the grace
    store.gc(grace=0)
    assert store._storage.list("staging") == []
    back = store.load("job")
    assert np.array_equal(back["v"], TREE["v"]) and np.array_equal(back["w"], TREE["w"])


def test_a_part_that_cannot_be_written_fails_every_process(store_url):
    storage = Failing(open_storage(store_url), "process-3", lambda p: p.startswith("manifests/"))
    storage.fail_write = True
    results = run_job(storage, trees(), "job", options=OPTIONS)
    assert storage.hits
    assert isinstance(results[3], StorageError) and "disk on fire" in str(results[3]), results[3]
    assert isinstance(results[0], StorageError), results[0]
    assert "process 3: StorageError: writing manifests/" in str(results[0]), str(results[0])
    assert all(isinstance(r, StorageError) for r in results), results
    assert treestore.Store(store_url).list() == []


def test_an_outcome_record_that_cannot_be_written_leaves_the_followers_waiting(
    store_url, monkeypatch, caplog
):
    """The primary committed but could not write the outcome: it returns (the save succeeded)
    without passing the last barriers; the others give up waiting and say the primary may still
    commit, rather than that the save failed."""
    monkeypatch.setenv("TREESTORE_BARRIER_TIMEOUT", "1")
    storage = Failing(open_storage(store_url), "process-0", outcome)
    storage.fail_write = True
    with caplog.at_level(logging.WARNING, "treestore"):
        results = run_job(storage, trees(), "job", options=OPTIONS)
    assert isinstance(results[0], SaveResult), results[0]
    said = [r.getMessage() for r in caplog.records]
    assert any("job: committed; outcome record left for gc: " in s and "disk on fire" in s for s in said), (
        said
    )
    for r in results[1:]:
        assert isinstance(r, BarrierTimeoutError) and r.missing == (0,), r
        assert "barrier 'committed': process 0 (of 4) did not arrive within 1 s" in str(r), str(r)
        assert "the primary (process 0) may still commit the checkpoint" in str(r), str(r)
    assert [c.name for c in treestore.Store(store_url).list()] == ["job"]


# --- limits the primary checks before it commits ---------------------------------------------------
def test_more_processes_with_pieces_than_a_manifest_lists_are_refused(store_url, monkeypatch):
    monkeypatch.setattr(D, "MAX_PARTS", 3)
    results = run_job(open_storage(store_url), trees(), "job", options=OPTIONS)
    assert isinstance(results[0], treestore.InvalidInputError), results[0]
    assert str(results[0]) == (
        "multi-process save of checkpoint 'job': 4 processes hold pieces, "
        "over the 3 parts a manifest may list"
    )
    assert all(isinstance(r, treestore.TreestoreError) for r in results[1:]), results
    assert treestore.Store(store_url).list() == []


def test_more_pieces_of_a_leaf_than_readers_accept_are_refused(store_url, monkeypatch):
    monkeypatch.setattr(D, "MAX_PIECES", 3)
    results = run_job(open_storage(store_url), trees(), "job", options=OPTIONS)
    assert isinstance(results[0], treestore.InvalidInputError), results[0]
    assert "a leaf may have more than the 3 pieces readers accept" in str(results[0]), str(results[0])
    assert treestore.Store(store_url).list() == []


def test_a_job_whose_leaves_are_all_the_primary_s_writes_no_part(store_url):
    """No sharded leaf: each process sends a summary without a part, and the checkpoint is the
    primary's leaves alone, in one manifest."""
    tree = {"a": np.arange(8.0), "n": 5}
    results = run_job(
        open_storage(store_url), [prepared(tree, {}, i) for i in range(4)], "job", options=OPTIONS
    )
    assert all(isinstance(r, SaveResult) for r in results), results
    back = treestore.load(store_url, "job")
    assert np.array_equal(back["a"], tree["a"]) and back["n"] == 5
    assert len(open_storage(store_url).list("manifests")) == 1  # one manifest, and no part
