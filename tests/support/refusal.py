"""What a refused save must leave behind: nothing written, the earlier checkpoint intact, and a
store that still lists, verifies, collects garbage and opens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import treestore

from .helpers import assert_tree_equal

# The errors a save may refuse its input with (SPEC: a writer refuses what a reader would refuse).
INPUT_ERRORS = (
    treestore.InvalidInputError,
    treestore.errors.UnsupportedLeafError,
    treestore.errors.UnsupportedKeyError,
)

BASE = {"base": np.arange(6, dtype=np.float32), "step": 3}


def store_files(url: str | Path) -> set[str]:
    """Every regular file in a local store, relative to its root."""
    root = Path(url)
    if not root.exists():
        return set()
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def with_base(tmp_path: Path) -> str:
    """A local store holding one earlier checkpoint, ``base``."""
    url = str(tmp_path / "store")
    treestore.save(url, BASE, "base")
    return url


def assert_store_healthy(url: str) -> None:
    """Every checkpoint loads and opens; the store lists, verifies, collects garbage and opens in
    a CheckpointManager."""
    store = treestore.Store(url)
    names = [info.name for info in store.list()]
    assert names, "the store lost its checkpoints"
    for name in names:
        store.load(name)
        ckpt = treestore.open(url, name)
        for value in ckpt.leaves.values():
            if isinstance(value, treestore.LazyLeaf):
                value.read()
        ckpt.tree  # noqa: B018 - rebuilding the tree is part of opening it
    report = treestore.verify(url)
    assert report.ok, report.problems
    store.gc()
    treestore.CheckpointManager(url, async_save=False).close()


def assert_base_intact(url: str) -> None:
    assert_tree_equal(treestore.load(url, "base"), BASE)


def assert_refused(url: str, tree: Any, name: str = "c", *, address: str | None = None) -> BaseException:
    """``save`` raises an input error before writing anything; the store stays healthy."""
    before = store_files(url)
    with pytest.raises(treestore.TreestoreError) as info:
        treestore.save(url, tree, name)
    exc = info.value
    assert isinstance(exc, INPUT_ERRORS), f"refused with {type(exc).__name__}, not an input error: {exc}"
    if address is not None:
        assert exc.address == address or address in str(exc), f"the error does not name {address!r}: {exc}"
    assert store_files(url) == before, "the refused save wrote objects"
    assert not treestore.Store(url).exists(name)
    assert_base_intact(url)
    assert_store_healthy(url)
    return exc


def tree_leaf_values(tree: Any) -> list[Any]:
    """The leaves of a tree of dicts, lists and tuples (anything else is a leaf)."""
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in tree_leaf_values(v)]
    if isinstance(tree, (list, tuple)):
        return [x for v in tree for x in tree_leaf_values(v)]
    return [tree]
