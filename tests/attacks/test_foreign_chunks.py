"""Chunk digests that point at other checkpoints' data, and objects swapped for others.

Content addressing makes a reference to another checkpoint's chunk legitimate when sizes agree:
the bytes returned are exactly the bytes that digest names. Everything else (other sizes, other
leaves' slices of a pack, objects stored under the wrong name) is refused, naming the address.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

import treestore
from treestore._format import paths as _paths
from treestore._format.manifest.codec import decode_any
from treestore._format.manifest.columns import ARRAY_CODES, LEAF_DTYPE

from ._harness import errors


def _leaf(m, address):
    return next(x for x in m["leaves"] if x["address"] == address)


@pytest.mark.timeout(30)
def test_chunk_of_another_checkpoint_with_the_same_size_is_read_as_that_data(store):
    good = store.manifest_record("good")
    foreign = _leaf(good, "w")["chunks"][0]
    store.mutate_manifest(lambda m: _leaf(m, "w")["chunks"].__setitem__(0, list(foreign)))
    out = store.check(ops=["load", "open", "verify", "diff"])
    w_good = treestore.load(store.url, "good")["w"]
    w = out["load"].value["w"]
    half = w.shape[0] // 2
    assert np.array_equal(w[:half], w_good[:half]), "the spliced chunk is not the data its digest names"
    assert not out["verify"].value.problems


@pytest.mark.timeout(30)
@pytest.mark.parametrize("delta", [-4, 4, -1])
def test_chunk_of_another_checkpoint_with_another_size(store, delta):
    good = store.manifest_record("good")
    foreign = list(_leaf(good, "w")["chunks"][0])

    def change(m):
        chunks = _leaf(m, "w")["chunks"]
        foreign[1] += delta
        chunks[0] = foreign
        chunks[1][1] -= delta  # the sizes still add up to the leaf's bytes

    store.mutate_manifest(change)
    out = store.check(ops=["load", "open", "verify", "diff"])
    assert isinstance(out["load"].error, treestore.errors.ChunkDamagedError), errors(out)
    assert out["load"].error.address == "w"


@pytest.mark.timeout(30)
def test_pack_of_another_checkpoint(store):
    good = store.manifest_record("good")
    store.mutate_manifest(lambda m: m["packs"].__setitem__(0, list(good["packs"][0])))
    out = store.check(ops=["load", "open", "verify", "diff"])
    err = out["load"].error
    assert isinstance(err, treestore.errors.ChunkDamagedError), errors(out)
    packed = {
        e.address
        for e in treestore.Store(store.url).manifest("good").leaves
        if any(c.pack is not None for c in e.chunks)
    }
    assert err.address in packed


@pytest.mark.timeout(30)
@pytest.mark.parametrize("shift", [-8, 8, 1])
def test_packed_leaf_pointing_at_its_neighbours_bytes(store, shift):
    def change(m):
        ref = _leaf(m, "small/a")["chunks"][0]
        ref[4] = max(0, ref[4] + shift)

    store.mutate_manifest(change)
    out = store.check(ops=["load", "open", "verify", "diff"])
    assert isinstance(
        out["load"].error, (treestore.errors.ChunkDamagedError, treestore.errors.ManifestDamagedError)
    )
    if isinstance(out["load"].error, treestore.errors.ChunkDamagedError):
        assert out["load"].error.address == "small/a"


@pytest.mark.timeout(30)
def test_packed_leaf_pointing_at_a_neighbour_with_its_digest(store):
    """small/a takes small/bf's slice of the pack, digest and all: consistent, so it reads as
    those bytes (reinterpreted as small/a's dtype), verified."""

    def change(m):
        a, bf = _leaf(m, "small/a"), _leaf(m, "small/bf")
        a["dtype"], a["shape"], a["chunks"] = "uint8", [bf["chunks"][0][1]], [list(bf["chunks"][0])]

    store.mutate_manifest(change)
    out = store.check(ops=["load", "open", "verify"])
    assert bytes(out["load"].value["small"]["a"]) == out["load"].value["small"]["bf"].tobytes()


@pytest.mark.timeout(30)
def test_object_swapped_for_another_chunk(store):
    a, b = store.chunk_file("w", 0), store.chunk_file("ids", 0)
    a.write_bytes(b.read_bytes())
    out = store.check(ops=["load", "open", "verify", "diff"])
    assert (
        isinstance(out["load"].error, treestore.errors.ChunkDamagedError) and out["load"].error.address == "w"
    )


@pytest.mark.timeout(30)
def test_manifest_object_rewritten_in_place(store):
    """The manifest object of "bad" now holds another valid manifest of the same size (one
    leaf's value changed), its commit record untouched: refused for its digest."""
    ref = store.ref_record()
    path = store.root / _paths.manifest_path(ref["manifest"])
    m = msgpack.unpackb(path.read_bytes(), raw=False)  # a version-2 manifest, as save writes
    at = decode_any(path.read_bytes(), "bad").find("py/n")
    assert at is not None
    rank = int((np.frombuffer(m["leaves"], LEAF_DTYPE)["kind"][:at] >= ARRAY_CODES).sum())
    assert m["values"][rank] == 3
    m["values"][rank] += 1  # 3 -> 4: a fixint of the same size
    data = msgpack.packb(m, use_bin_type=True)
    assert len(data) == path.stat().st_size
    path.write_bytes(data)
    out = store.check(ops=["manifest", "load", "open", "verify"])
    assert isinstance(out["load"].error, treestore.errors.ManifestDamagedError), errors(out)
    assert "digest" in str(out["load"].error)


@pytest.mark.timeout(30)
def test_chunk_digest_naming_a_manifest(store):
    """A chunk ref whose digest is a manifest's: chunks and manifests live in different folders,
    so it is simply missing."""
    good = store.ref_record("good")
    store.mutate_manifest(lambda m: _leaf(m, "w")["chunks"][0].__setitem__(0, good["manifest"]))
    out = store.check(ops=["load", "verify"])
    assert isinstance(out["load"].error, treestore.errors.ChunkMissingError)


@pytest.mark.timeout(30)
def test_manifest_digest_naming_a_chunk(store):
    m = treestore.Store(store.url).manifest("bad")
    chunk = m.leaves[0].chunks[0].digest if m.leaves[0].chunks else m.packs[0].digest
    (store.root / _paths.manifest_path(chunk)).write_bytes(store.chunk_file("w").read_bytes())
    size = (store.root / _paths.manifest_path(chunk)).stat().st_size
    store.write_ref({**store.ref_record(), "manifest": chunk, "manifest_size": size})
    out = store.check(ops=["load", "verify"])
    assert isinstance(out["load"].error, treestore.errors.ManifestDamagedError)
