"""gc deletes an unreferenced object only when its age is known to be past the grace period: an
object listed without a modification time (a backend that does not report one) is never old."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

import treestore
from treestore._storage import base


def _orphaned_store() -> treestore.Store:
    """A store with one checkpoint deleted: its chunks and manifest are unreferenced."""
    store = treestore.Store(f"memory://gc-age-{uuid.uuid4().hex}")
    store.save({"w": np.arange(5000, dtype=np.float32)}, "a")
    store.save({"w": np.ones(5000, dtype=np.float32)}, "b")
    store.delete("a")
    return store


def test_objects_listed_without_a_modification_time_are_never_deleted_by_age(monkeypatch: pytest.MonkeyPatch):
    store = _orphaned_store()
    before = sorted(o.path for o in store._storage.list(""))
    monkeypatch.setattr(base, "_mtime", lambda info: None)
    assert store._storage.list("chunks")[0].mtime is None  # the backend as gc sees it now
    report = store.gc(grace=0)
    assert (report.chunks_removed, report.manifests_removed, report.bytes_freed) == (0, 0, 0)
    assert report.kept_young > 0
    assert sorted(o.path for o in store._storage.list("")) == before
    monkeypatch.undo()  # with modification times the same objects are old enough to go
    report = store.gc(grace=0)
    assert report.chunks_removed > 0 and report.manifests_removed == 1
    np.testing.assert_array_equal(store.load("b")["w"], np.ones(5000, dtype=np.float32))
