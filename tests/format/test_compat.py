"""A store written by each format version, checked in, must stay readable and re-encode byte for byte."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import msgpack
import numpy as np
import pytest

import treestore
from tests.data.make_store_v1 import tree
from tests.support.helpers import assert_leaf_equal
from tests.support.templates import blank
from treestore._engine.reading import committed as _committed
from treestore._format import paths as _paths
from treestore._format.manifest.codec import decode_any, decode_columns, encode, encode_columns
from treestore._format.manifest.frame import Frame
from treestore._format.manifest.record_views import Manifest
from treestore._format.manifest.v1 import decode_v1
from treestore.errors import ManifestDamagedError

DATA = Path(__file__).parent.parent / "data"
VERSIONS = (1, 2)


@pytest.mark.parametrize("version", VERSIONS)
def test_checked_in_store_loads_exactly(tmp_path, version):
    url = str(tmp_path / "store")
    shutil.copytree(DATA / f"store-v{version}", url)  # never touch the checked-in copy
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
    note = {"note": f"written by format version {version}"}
    assert treestore.Store(url).manifest("first").metadata == note
    d = treestore.diff(f"{url}#first", f"{url}#second")
    assert set(d.changed) == {"params/dense/b", "step"}
    assert treestore.verify(url).ok


def _manifests(version: int) -> list[tuple[str, bytes]]:
    storage = treestore.Store(str(DATA / f"store-v{version}"))._storage
    out = []
    for name in _committed.checkpoint_names(storage):
        ref = _committed.read_commit_record(storage, name)
        data = storage.read(_paths.manifest_path(ref.manifest))
        assert data is not None
        assert msgpack.unpackb(data)["version"] == version, name
        out.append((name, data))
    return out


@pytest.mark.parametrize("version", VERSIONS)
def test_checked_in_manifests_reencode_byte_for_byte(version):
    for name, data in _manifests(version):
        if version == 1:
            assert encode(decode_v1(msgpack.unpackb(data, raw=False), name), 1) == data, name
        else:
            assert encode_columns(decode_columns(data, name)) == data, name
        # The one encoder writers use, in the version the manifest was read in:
        columns = decode_any(data, name)
        assert columns.version == version
        assert encode(columns, version) == data, name
    opened = treestore.open(str(DATA / f"store-v{version}"), "first")
    assert np.asarray(opened["params/dense/w"][:2]).shape == (2, 80)


def test_both_versions_describe_the_same_checkpoints():
    """The version-2 store holds the same trees as the version-1 store: the same leaves, chunk
    refs and leaf digests (SPEC: a version-2 leaf's digest is the version-1 digest of its v1 form)."""
    for (n1, d1), (n2, d2) in zip(_manifests(1), _manifests(2), strict=True):
        a, b = decode_any(d1, n1), decode_any(d2, n2)
        assert n1 == n2 and a.addresses == b.addresses
        assert [e.digest for e in Manifest(a).leaves] == [e.digest for e in Manifest(b).leaves]
        # The columns give the same digests without making a leaf entry.
        assert [a.digest(i) for i in range(len(a))] == [e.digest for e in Manifest(a).leaves]
        assert [b.digest(i) for i in range(len(b))] == [e.digest for e in Manifest(b).leaves]
        assert a.chunk_digests() == b.chunk_digests()


def test_leaf_digests_of_leaves_in_pieces_are_the_same_from_columns_and_entries():
    """The parted store's leaves saved in pieces (four processes): the columns' digest of each
    leaf is its entry's (SPEC 6.7, pieces with their boxes)."""
    store = treestore.Store(str(DATA / "store-v2-parts"))
    columns = _committed.read_columns(
        store._storage, _committed.read_commit_record(store._storage, "sharded")
    )
    entries = store.manifest("sharded").leaves
    assert any(e.pieces for e in entries)
    assert [columns.digest(i) for i in range(len(columns))] == [e.digest for e in entries]


def test_a_store_holds_checkpoints_of_both_versions(tmp_path):
    """A store written by version 1 and saved to by version 2 holds both; every reader (load,
    open, diff, verify, copy, gc) takes each, and the newer save reuses the older chunks."""
    url = str(tmp_path / "store")
    shutil.copytree(DATA / "store-v1", url)
    store = treestore.Store(url)
    t = tree()
    t["step"] = 99
    result = store.save(t, "third", options=treestore.SaveOptions(chunk_size=8192, small_leaf=4096))
    assert result.chunks_reused > 0
    versions = {}
    for name in ("first", "second", "third"):
        ref = _committed.read_commit_record(store._storage, name)
        data = _committed.read_manifest_bytes(store._storage, ref)
        versions[name] = msgpack.unpackb(data)["version"]
    assert versions == {"first": 1, "second": 1, "third": 2}
    assert treestore.load(url, "third")["step"] == 99
    assert set(treestore.diff(f"{url}#first", f"{url}#third").changed) == {"step"}
    assert np.asarray(treestore.open(url, "first")["params/dense/w"]).shape == (96, 80)
    assert treestore.verify(url).ok
    store.gc(grace=0)
    assert treestore.verify(url).ok and [c.name for c in store.list()] == ["first", "second", "third"]
    # copy keeps each manifest's bytes, and renaming re-encodes in the source's version
    dst = str(tmp_path / "copy")
    treestore.copy(f"{url}#first", f"{dst}#renamed")
    treestore.copy(f"{url}#third", dst)
    dst_storage = treestore.Store(dst)._storage
    for name, version in (("renamed", 1), ("third", 2)):
        ref = _committed.read_commit_record(dst_storage, name)
        data = _committed.read_manifest_bytes(dst_storage, ref)
        assert msgpack.unpackb(data)["version"] == version, name
    assert treestore.verify(dst).ok
    assert treestore.load(dst, "renamed")["step"] == 1234


def test_checked_in_store_in_parts_loads_exactly(tmp_path):
    """The store a job of four processes wrote, its manifest in parts (SPEC.md, section 8):
    every reader takes it, its frame re-encodes byte for byte, gc keeps its parts and copy
    carries them."""
    from tests.data.make_store_v2_parts import tree as sharded_tree

    url = str(tmp_path / "store")
    shutil.copytree(DATA / "store-v2-parts", url)
    storage = treestore.Store(url)._storage
    ref = _committed.read_commit_record(storage, "sharded")
    data = _committed.read_manifest_bytes(storage, ref)
    frame = decode_columns(data, "sharded")
    assert isinstance(frame, Frame) and len(frame.parts) == 4
    assert encode_columns(frame) == data
    out = treestore.load(url, "sharded")
    for key, want in sharded_tree().items():
        assert_leaf_equal(out[key], want, key)
    assert np.array_equal(treestore.open(url, "sharded")["w"][100:104], sharded_tree()["w"][100:104])
    assert [len(e.pieces) for e in treestore.Store(url).manifest("sharded").leaves] == [4, 0, 0, 0, 4]
    assert treestore.verify(url).ok
    treestore.Store(url).gc(grace=0)
    assert treestore.verify(url).ok
    treestore.copy(f"{url}#sharded", str(tmp_path / "copy"))
    treestore.copy(f"{url}#sharded", str(tmp_path / "copy") + "#renamed")
    copied = treestore.Store(str(tmp_path / "copy"))
    assert copied._storage.read(_paths.manifest_path(frame.parts[2][0])) is not None  # carried over
    for name in ("sharded", "renamed"):
        assert_leaf_equal(treestore.load(str(tmp_path / "copy"), name)["w"], sharded_tree()["w"], name)
    assert treestore.verify(str(tmp_path / "copy")).ok


def test_the_version_1_decoder_refuses_a_manifest_of_another_version():
    """decode_v1 reads the version-1 form only: a checked-in version-1 manifest whose version field
    says 2 is a ManifestDamagedError naming the version, never read by version 1's rules."""
    name, data = _manifests(1)[0]
    rec = msgpack.unpackb(data, raw=False)
    rec["version"] = 2
    with pytest.raises(ManifestDamagedError, match="version-2 manifest, not the version-1 form"):
        decode_v1(rec, name)
