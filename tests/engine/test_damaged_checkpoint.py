"""One damaged checkpoint does not take the store down: list, gc and a CheckpointManager's
retention keep working around a checkpoint whose commit record or manifest is truncated, and name
it (issue 12.5 of the attack report)."""

from __future__ import annotations

import logging
from typing import Any

import msgpack
import pytest

import treestore
from tests.support.faults import (
    FaultyMemoryFileSystem,
    chunked_tree,
    fs_root,
    get_object,
    objects,
    outcome,
    put_object,
)
from tests.support.helpers import assert_tree_equal


# --- 12.5: one bad checkpoint must not take the store down --------------------------------------
def _healthy_and_damaged(url: str, damage: str) -> dict[str, Any]:
    """Checkpoints keep-1 and keep-2 (returned) around 'other', whose commit record or manifest
    is then truncated to half its length."""
    trees = {"keep-1": chunked_tree(11)}
    treestore.save(url, trees["keep-1"], "keep-1")
    treestore.save(url, chunked_tree(12), "other")
    trees["keep-2"] = chunked_tree(13)
    treestore.save(url, trees["keep-2"], "keep-2")
    if damage == "record":
        path = "checkpoints/other"
    else:
        (path,) = objects(url, "manifests") - _manifests_of(url, ["keep-1", "keep-2"])
    put_object(url, path, get_object(url, path)[: len(get_object(url, path)) // 2])
    return trees


def _manifests_of(url: str, names: list[str]) -> set[str]:
    """The manifest objects of the named checkpoints (read from their commit records)."""
    out = set()
    for name in names:
        rec = msgpack.unpackb(get_object(url, f"checkpoints/{name}"), raw=False)
        out.add(f"manifests/{rec['manifest'].hex()}")
    return out


def test_list_survives_a_damaged_commit_record(store_url: str):
    _healthy_and_damaged(store_url, "record")
    names = [c.name for c in treestore.Store(store_url).list()]
    assert {"keep-1", "keep-2"} <= set(names), names


@pytest.mark.parametrize("damage", ["record", "manifest"])
def test_gc_survives_a_damaged_checkpoint(store_url: str, damage: str):
    trees = _healthy_and_damaged(store_url, damage)
    treestore.Store(store_url).gc(grace=0)
    for name, t in trees.items():
        assert_tree_equal(treestore.load(store_url, name), t)
    assert treestore.verify(f"{store_url}#keep-1").ok and treestore.verify(f"{store_url}#keep-2").ok


@pytest.mark.parametrize("damage", ["record", "manifest"])
def test_manager_retention_survives_a_damaged_checkpoint(store_url: str, damage: str):
    trees = _healthy_and_damaged(store_url, damage)
    steps = {s: chunked_tree(100 + s) for s in (1, 2, 3)}
    with treestore.CheckpointManager(
        store_url, retention=treestore.Retention(keep_last=1), async_save=False
    ) as m:
        for s, t in steps.items():
            assert m.save(s, t) is True
        assert m.steps() == [3]
        assert_tree_equal(m.restore(), steps[3])
    for name, t in trees.items():  # not steps: the manager never deletes them
        assert_tree_equal(treestore.load(store_url, name), t)


def test_list_names_the_damaged_checkpoint_it_leaves_out(store_url: str, caplog):
    _healthy_and_damaged(store_url, "record")
    with caplog.at_level(logging.WARNING, logger="treestore"):
        names = [c.name for c in treestore.Store(store_url).list()]
    assert names == ["keep-1", "keep-2"]
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "'other'" in said, f"the damaged checkpoint was not named: {said!r}"


@pytest.mark.parametrize("damage", ["record", "manifest"])
def test_gc_with_a_damaged_checkpoint_deletes_no_chunk_and_names_it(store_url: str, damage: str):
    """What the damaged checkpoint references is unknown, so no chunk or manifest goes, not even
    one that only a deleted checkpoint used; the report names the damaged checkpoint."""
    trees = _healthy_and_damaged(store_url, damage)
    treestore.save(store_url, chunked_tree(14), "gone")
    treestore.Store(store_url).delete("gone")  # its chunks are unreferenced now
    before = objects(store_url, "chunks") | objects(store_url, "manifests")
    report = treestore.Store(store_url).gc(grace=0)
    assert report.damaged == ("other",)
    assert (report.chunks_removed, report.manifests_removed) == (0, 0)
    assert objects(store_url, "chunks") | objects(store_url, "manifests") == before
    treestore.Store(store_url).delete("other")  # once it is gone, gc frees space again
    report = treestore.Store(store_url).gc(grace=0)
    assert report.damaged == () and report.chunks_removed > 0
    for name, t in trees.items():
        assert_tree_equal(treestore.load(store_url, name), t)


def test_manager_save_succeeds_when_retention_fails_after_the_commit(faultmem: str, caplog):
    """Retention runs after the commit: a checkpoint it cannot delete is logged, and the step
    still counts as saved (a retry would otherwise find it committed)."""
    root = fs_root(faultmem)[1]
    with treestore.CheckpointManager(
        faultmem, retention=treestore.Retention(keep_last=1), async_save=False
    ) as m:
        assert m.save(1, chunked_tree(61)) is True
        FaultyMemoryFileSystem.undeletable = (f"{root}/checkpoints/",)
        with caplog.at_level(logging.WARNING, logger="treestore"):
            result = outcome(lambda: m.save(2, chunked_tree(62)))
        FaultyMemoryFileSystem.undeletable = ()
        assert result is None, f"save raised although step 2 is committed: {result!r}"
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "step-000000001" in said, said
        assert m.save(3, chunked_tree(63)) is True  # retention runs again, and now succeeds
        assert m.steps() == [3]
