"""A save copies each chunk before hashing it (so that an array changed meanwhile never makes an
object that differs from its name) unless nothing but the save can reach the leaf's host data:
a copy made for the save (an async save's host snapshot, a non-contiguous or big-endian array),
or the host copy jax makes of an array on an accelerator. Those are hashed and encoded in
place."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

import treestore
from tests.support.helpers import assert_tree_equal
from treestore._engine import write as _write
from treestore._engine.saving import chunk_writer as _chunk_writer
from treestore._engine.saving.snapshot import HostSnapshot
from treestore._tree.leaves import ArrayLeaf, prepare_leaf


def _private(value: Any, copy: bool = False) -> bool:
    leaf = prepare_leaf(value, "x", copy=copy)
    assert isinstance(leaf, ArrayLeaf)
    return leaf.private


def test_which_leaves_a_save_may_read_in_place():
    a = np.arange(12.0).reshape(3, 4)
    assert not _private(a)  # the caller's own array
    assert _private(a, copy=True)
    assert _private(a.T)  # not C-ordered: copied
    assert _private(a.astype(">f8"))  # big-endian: converted
    assert not _private(a.view(np.ndarray)[1:])  # a view of the caller's array
    assert not _private(jnp.ones(5))  # a CPU device's buffer, which a donation may reuse


@pytest.fixture
def snapshots(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the chunk copies saves make (chunk_writer._private_copy)."""
    made: list[int] = []
    real = _chunk_writer._private_copy

    def snapshot(raw: np.ndarray) -> np.ndarray:
        made.append(raw.nbytes)
        return real(raw)

    monkeypatch.setattr(_chunk_writer, "_private_copy", snapshot)
    return made


def tree() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {"w": rng.standard_normal((500, 700)).astype(np.float32), "j": jnp.arange(90_000.0), "s": 3}


OPTIONS = treestore.SaveOptions(chunk_size=256 * 1024)


def test_a_save_of_the_callers_arrays_copies_each_chunk(tmp_path, snapshots):
    treestore.save(str(tmp_path / "s"), tree(), "a", options=OPTIONS)
    assert sum(snapshots) == tree()["w"].nbytes + tree()["j"].nbytes


def test_a_save_of_a_host_snapshot_copies_nothing_more(tmp_path, snapshots):
    """What an async save writes: the snapshot is the save's own, so it is read in place."""
    prepared = HostSnapshot().take(tree())
    assert all(leaf.private for _, leaf in prepared.leaves if isinstance(leaf, ArrayLeaf))
    storage = treestore.Store(str(tmp_path / "s"))._storage
    _write.write(storage, prepared, "a", options=OPTIONS)
    assert snapshots == []
    assert_tree_equal(treestore.load(str(tmp_path / "s"), "a"), tree())


def test_an_async_manager_save_copies_each_chunk_once(tmp_path, snapshots):
    with treestore.CheckpointManager(str(tmp_path / "run"), options=OPTIONS) as mgr:
        mgr.save(1, tree())
        mgr.wait()
    assert snapshots == []
    with treestore.CheckpointManager(str(tmp_path / "run")) as mgr:
        got = mgr.restore(step=1)
    assert np.array_equal(got["w"], tree()["w"]) and np.array_equal(got["j"], np.asarray(tree()["j"]))
