"""Python's cyclic garbage collector is paused while a save or load makes its per-leaf objects,
and is always left as the caller had it."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import treestore
from treestore._tree.collector_pause import MANY_LEAVES, paused_collector


@pytest.fixture
def collections() -> Iterator[list[int]]:
    """The generation of every collection that starts while the test runs."""
    started: list[int] = []

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started.append(info["generation"])

    gc.callbacks.append(callback)
    try:
        yield started
    finally:
        gc.callbacks.remove(callback)


def tree_of(n: int) -> dict[str, Any]:
    return {f"g{i // 100}": {f"w{i}": np.full(4, i, np.float32)} for i in range(n)}


def test_a_save_and_a_load_of_many_leaves_run_no_collection(tmp_path, collections):
    tree = tree_of(3 * MANY_LEAVES)
    store = treestore.Store(str(tmp_path / "s"))
    store.save({"x": np.ones(2)}, "warm")  # the modules a first save and load import, imported
    store.load("warm")
    gc.collect()
    collections.clear()
    store.save(tree, "a")
    saving = list(collections)
    gc.collect()
    collections.clear()
    back = store.load("a")
    # Without the pause: dozens each. With it, at most the one that the first allocation
    # after the pause may start (the objects made during it are young).
    assert len(saving) <= 1 and len(collections) <= 1, (saving, collections)
    assert gc.isenabled()
    assert np.array_equal(back["g29"]["w2999"], tree["g29"]["w2999"])


@pytest.mark.parametrize("how", ["function", "store"])
def test_a_save_frees_its_per_leaf_objects_before_the_collector_resumes(tmp_path, how):
    # A save's leaves, leaf table and columns die with it. When they were still referenced as
    # the pause ended, the next allocation started a collection that walked them all once more
    # (two objects a leaf: 32-54 ms at 100k leaves).
    tree = {f"g{g}": {f"w{i}": np.full(4, i, np.float32) for i in range(100)} for g in range(30)}
    walked: list[int] = []  # the young objects each collection that starts walks

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and info["generation"] == 0:
            walked.append(len(gc.get_objects(generation=0)))

    store = treestore.Store(str(tmp_path / "s"))
    store.save(tree, "warm")  # the modules a first save imports, and its memos, made
    gc.collect()
    gc.callbacks.append(callback)
    try:
        if how == "store":
            store.save(tree, "a")
        else:
            treestore.save(str(tmp_path / "s"), tree, "a")
        young = len(gc.get_objects(generation=0))
        after = [object() for _ in range(1000)]  # allocations that start any collection due
    finally:
        gc.callbacks.remove(callback)
    assert all(n < MANY_LEAVES for n in walked) and young < MANY_LEAVES, (walked, young)
    assert len(after) == 1000


def test_the_collector_is_left_as_the_caller_had_it(tmp_path):
    store = treestore.Store(str(tmp_path / "s"))
    gc.disable()
    try:
        store.save(tree_of(MANY_LEAVES), "off")
        assert not gc.isenabled()  # a caller that turned it off keeps it off
    finally:
        gc.enable()
    with pytest.raises(treestore.errors.UnsupportedLeafError):
        store.save({"ok": tree_of(MANY_LEAVES), "bad": object()}, "failed")
    assert gc.isenabled()  # and a failed save turns it back on


def test_nested_and_concurrent_pauses_resume_once_the_last_ends():
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with paused_collector():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(10)
    with paused_collector():
        with paused_collector():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread's pause still holds
    release.set()
    t.join()
    assert gc.isenabled()
    with paused_collector(leaves=MANY_LEAVES - 1):
        assert gc.isenabled()  # a tree of few leaves does not pause it
