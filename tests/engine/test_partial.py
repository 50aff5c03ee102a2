"""Partial restore and lazy reads touch only the chunks they need."""

from __future__ import annotations

import collections
import uuid

import jax
import numpy as np
import pytest

import treestore
from tests.support.counting import CountingFileSystem
from tests.support.helpers import assert_tree_equal, same_bytes
from tests.support.templates import blank

RNG = np.random.default_rng(7)
Block = collections.namedtuple("Block", "attn mlp")
OPTIONS = treestore.SaveOptions(chunk_size=64 * 1024)


def model():
    layers = [
        Block(
            attn={
                "weights": RNG.standard_normal((128, 256)).astype(np.float32),
                "bias": np.zeros(256, np.float32),
            },
            mlp={
                "weights": RNG.standard_normal((256, 128)).astype(np.float32),
                "bias": np.ones(128, np.float32),
            },
        )
        for _ in range(3)
    ]
    return {
        "params": {"embed": RNG.standard_normal((1000, 64)).astype(np.float32), "layers": layers},
        "opt_state": {"mu": RNG.standard_normal((1000, 64)).astype(np.float32), "count": 5},
        "rng": jax.random.key(0),
    }


@pytest.fixture
def counted():
    url = f"counting://partial/{uuid.uuid4().hex}"
    tree = model()
    treestore.Store(url).save(tree, "c", options=OPTIONS)
    CountingFileSystem.reset()
    return url, tree


def chunk_bytes(url, addresses):
    m = treestore.Store(url).manifest("c")
    return sum(c.stored_size for e in m.leaves if e.address in addresses for c in e.chunks if c.pack is None)


def test_select_reads_only_selected_chunks(counted):
    url, tree = counted
    out = treestore.load(url, "c", select="params/layers/*/.attn/weights")
    assert list(out) == ["params"] and list(out["params"]) == ["layers"]
    assert [sorted(b) for b in out["params"]["layers"]] == [["attn"]] * 3  # custom nodes: dicts
    for i in range(3):
        assert same_bytes(
            out["params"]["layers"][i]["attn"]["weights"], tree["params"]["layers"][i].attn["weights"]
        )
    wanted = {f"params/layers/{i}/.attn/weights" for i in range(3)}
    total, chunks = CountingFileSystem.bytes_read(), CountingFileSystem.bytes_read("chunks")
    manifest_and_ref = CountingFileSystem.bytes_read("manifests") + CountingFileSystem.bytes_read(
        "checkpoints"
    )
    assert chunks == chunk_bytes(url, wanted)
    assert total == chunks + manifest_and_ref
    assert not any("opt_state" in p for p in CountingFileSystem.paths_read())


def test_several_patterns(counted):
    url, tree = counted
    out = treestore.load(url, "c", select=["params/embed", "opt_state/*"])
    assert sorted(out) == ["opt_state", "params"]
    assert out["opt_state"]["count"] == 5 and same_bytes(out["params"]["embed"], tree["params"]["embed"])


def test_pattern_matching_nothing_lists_nearest(counted):
    url, _ = counted
    with pytest.raises(
        treestore.errors.NoMatchError, match=r"'params/embedd'.*nearest addresses: 'params/embed'"
    ):
        treestore.load(url, "c", select="params/embedd")


def test_like_a_subtree_with_prefix(counted):
    url, tree = counted
    like = {"mu": jax.ShapeDtypeStruct((1000, 64), np.float32), "count": 0}
    out = treestore.load(url, "c", like=like, prefix="opt_state")
    assert same_bytes(out["mu"], tree["opt_state"]["mu"]) and out["count"] == 5
    assert CountingFileSystem.bytes_read("chunks") == chunk_bytes(url, {"opt_state/mu"})


def test_like_with_select_validates_the_selection(counted):
    url, tree = counted
    like = {"params": {"embed": blank(tree["params"]["embed"])}}
    out = treestore.load(url, "c", like=like, select="params/embed")
    assert_tree_equal(out, {"params": {"embed": tree["params"]["embed"]}})
    with pytest.raises(treestore.StructureMismatchError, match="params/embed: expected shape"):
        treestore.load(
            url, "c", like={"params": {"embed": np.zeros((3, 3), np.float32)}}, select="params/embed"
        )


def test_lazy_handles(counted):
    url, tree = counted
    ckpt = treestore.open(url, "c")
    emb = ckpt["params/embed"]
    assert (emb.shape, emb.dtype, emb.address) == ((1000, 64), np.float32, "params/embed")
    assert emb.stored_bytes > 0 and emb.nbytes == 1000 * 64 * 4
    assert CountingFileSystem.bytes_read("chunks") == 0  # nothing read until indexed
    rows = emb[10:20]
    assert same_bytes(rows, tree["params"]["embed"][10:20])
    assert CountingFileSystem.bytes_read("chunks") == emb.entry.chunks[0].stored_size
    for index in [
        5,
        -1,
        slice(None, None, -3),
        (slice(3, 900, 7), 2),
        (Ellipsis, 3),
        (4, slice(1, 3)),
        slice(990, 5000),
    ]:
        assert same_bytes(emb[index], tree["params"]["embed"][index]), index
    assert same_bytes(np.asarray(emb), tree["params"]["embed"])
    assert ckpt["opt_state/count"] == 5
    assert isinstance(ckpt.tree["params"]["layers"][0]["mlp"]["weights"], treestore.LazyLeaf)
    key = ckpt["rng"].read()
    assert same_bytes(jax.random.key_data(key), jax.random.key_data(tree["rng"]))


def test_lazy_slice_reads_only_intersecting_chunks(counted):
    url, _ = counted
    ckpt = treestore.open(url, "c")
    entry = ckpt["params/embed"].entry
    row_bytes = 64 * 4
    CountingFileSystem.reset()
    ckpt["params/embed"][300:400]
    start, stop = 300 * row_bytes, 400 * row_bytes
    at, expected = 0, 0
    for c in entry.chunks:
        if at < stop and at + c.raw_size > start:
            expected += c.stored_size
        at += c.raw_size
    assert CountingFileSystem.bytes_read("chunks") == expected


def test_lazy_errors(counted):
    url, _ = counted
    emb = treestore.open(url, "c")["params/embed"]
    with pytest.raises(
        treestore.errors.OutOfBoundsError, match="params/embed: index 1000 is out of bounds"
    ) as info:
        emb[1000]
    assert isinstance(info.value, IndexError)
    with pytest.raises(IndexError):
        emb[0, 0, 0]
    with pytest.raises(treestore.InvalidInputError, match="only basic indexing"):
        emb[[1, 2]]
    assert emb[2000:3000].shape == (0, 64)  # slices past the end are empty, as in numpy
    with pytest.raises(treestore.errors.NoMatchError, match="nearest addresses"):
        treestore.open(url, "c")["params/embedding"]


def test_lazy_read_of_missing_chunk_names_the_address(counted):
    url, _ = counted
    store = treestore.Store(url)
    entry = store.open("c")["opt_state/mu"].entry
    from treestore._format import paths as _paths

    store._storage.delete(_paths.chunk_path(entry.chunks[1].digest))
    ckpt = store.open("c")
    assert ckpt["opt_state/mu"][:10].shape == (10, 64)  # first chunk still readable
    with pytest.raises(treestore.errors.ChunkMissingError, match=r"opt_state/mu: chunk .* is missing"):
        np.asarray(ckpt["opt_state/mu"])
