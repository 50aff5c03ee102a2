"""A store written by format version 1, checked in, must stay readable and re-encode byte for byte."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import numpy as np

import treestore
from treestore._engine import read as _read
from treestore._format import layout as _layout
from treestore._format.manifest import decode_manifest, encode_manifest

from .data.make_store_v1 import tree
from .helpers import assert_leaf_equal
from .templates import blank

STORE = Path(__file__).parent / "data" / "store-v1"


def test_version_1_store_loads_exactly(tmp_path):
    url = str(tmp_path / "store")
    shutil.copytree(STORE, url)  # never touch the checked-in copy
    expected = tree()
    assert [c.name for c in treestore.Store(url).list()] == ["first", "second"]
    out = treestore.load(url, "first")
    assert out["step"] == 1234 and list(out["ints"]) == [0, 1, -7]
    assert out["ints"][-7] == (1.5, True, None, b"\x00\x01")
    for (path, want), got in zip(
        jax.tree_util.tree_flatten_with_path(expected)[0],
        jax.tree.leaves(treestore.load(url, "first", like=blank(expected))),
        strict=True,
    ):
        assert_leaf_equal(got, want, jax.tree_util.keystr(path))
    assert treestore.Store(url).manifest("first").metadata == {"note": "written by format version 1"}
    d = treestore.diff(f"{url}#first", f"{url}#second")
    assert set(d.changed) == {"params/dense/b", "step"}
    assert treestore.verify(url).ok


def test_version_1_manifests_reencode_byte_for_byte():
    storage = treestore.Store(str(STORE)).storage
    for name in _read.checkpoint_names(storage):
        ref = _read.read_commit_record(storage, name)
        data = storage.read(_layout.manifest_path(ref.manifest))
        assert data is not None
        assert encode_manifest(decode_manifest(data, name)) == data, name
    assert np.asarray(treestore.open(str(STORE), "first")["params/dense/w"][:2]).shape == (2, 80)
