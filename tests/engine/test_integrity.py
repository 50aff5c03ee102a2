"""Damage is always detected, with a distinct error naming the checkpoint and the address."""

from __future__ import annotations

import blake3
import numpy as np
import pytest

import treestore
from tests.support import hostile
from treestore._format import paths as _paths

W = (np.random.default_rng(3).standard_normal((256, 1024)) * 0.02).astype(np.float32)  # 1 MiB


@pytest.fixture
def saved(store_url):
    tree = {"layer": {"w": W, "b": np.arange(8, dtype=np.float32)}, "step": 3}
    treestore.save(store_url, tree, "ckpt", metadata={"step": 3})
    return store_url


@pytest.mark.parametrize("where", [0, 3, 4, 8, 20, 100, -1])
def test_flipped_byte_in_a_chunk(saved, where):
    (path,) = hostile.chunk_paths(saved, "ckpt")["layer/w"]
    hostile.flip_byte(saved, path, where)
    with pytest.raises(treestore.errors.ChunkDamagedError) as info:
        treestore.load(saved)
    assert info.value.address == "layer/w" and info.value.checkpoint == "ckpt"
    assert "layer/w: chunk" in str(info.value) and "'ckpt'" in str(info.value)


def test_flipped_byte_in_a_pack(saved):
    (path,) = hostile.chunk_paths(saved, "ckpt")["<pack 0>"]
    hostile.flip_byte(saved, path, -1)
    with pytest.raises(treestore.errors.ChunkDamagedError, match="layer/b: chunk"):
        treestore.load(saved)


@pytest.mark.parametrize("keep", [0, 5, 16, 1000])
def test_truncated_chunk(saved, keep):
    (path,) = hostile.chunk_paths(saved, "ckpt")["layer/w"]
    hostile.truncate(saved, path, keep)
    with pytest.raises(treestore.errors.ChunkDamagedError, match="layer/w"):
        treestore.load(saved)


def test_missing_chunk(saved):
    (path,) = hostile.chunk_paths(saved, "ckpt")["layer/w"]
    hostile.storage(saved).delete(path)
    with pytest.raises(
        treestore.errors.ChunkMissingError, match=r"layer/w: chunk [0-9a-f]+ is missing in checkpoint 'ckpt'"
    ):
        treestore.load(saved)
    # The rest of the checkpoint still loads.
    assert treestore.load(saved, select="layer/b")["layer"]["b"].shape == (8,)


def test_oversized_chunk_object_is_not_read_whole(saved):
    (path,) = hostile.chunk_paths(saved, "ckpt")["layer/w"]
    s = hostile.storage(saved)
    s.write(path, [s.read(path) + b"\0" * (4 << 20)])
    with pytest.raises(treestore.errors.ChunkDamagedError, match="larger than its raw size allows"):
        treestore.load(saved)


def test_truncated_manifest(saved):
    ref = hostile.commit_record(saved, "ckpt")
    path = _paths.manifest_path(ref["manifest"])
    hostile.truncate(saved, path, 50)
    with pytest.raises(treestore.errors.ManifestDamagedError, match="manifest of checkpoint 'ckpt'"):
        treestore.load(saved)


def test_garbage_manifest_with_matching_digest(saved):
    hostile.write_manifest(saved, "ckpt", None, raw=b"\xc1 not msgpack at all")
    with pytest.raises(treestore.errors.ManifestDamagedError, match="not valid msgpack"):
        treestore.load(saved)


def test_garbage_commit_record(saved):
    hostile.storage(saved).write(_paths.record_path("ckpt"), [b"\x92\x01"])
    with pytest.raises(treestore.errors.ManifestDamagedError, match="commit record of checkpoint 'ckpt'"):
        treestore.load(saved, "ckpt")


def test_future_format_version(saved):
    hostile.mutate_manifest(saved, "ckpt", lambda m: m.update(version=99))
    with pytest.raises(treestore.UnsupportedFormatError, match=r"format version 99.*upgrade treestore"):
        treestore.load(saved)


def test_future_commit_record_version(saved):
    s = hostile.storage(saved)
    ref = hostile.commit_record(saved, "ckpt")
    ref["version"] = 7
    import msgpack

    s.write(_paths.record_path("ckpt"), [msgpack.packb(ref)])
    with pytest.raises(treestore.UnsupportedFormatError, match="version 7"):
        treestore.Store(saved).list()


def test_missing_checkpoint(store_url):
    with pytest.raises(treestore.errors.CheckpointNotFoundError, match=r"no treestore store at \S+\Z"):
        treestore.load(store_url)
    treestore.save(store_url, {"a": 1}, "one")
    with pytest.raises(treestore.errors.CheckpointNotFoundError, match="no checkpoint 'two'") as info:
        treestore.load(store_url, "two")
    assert isinstance(info.value, KeyError) and info.value.checkpoint == "two"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"shape": [2**40, 2**40]}, "too large to exist"),
        ({"shape": [2**20, 2**20]}, "needs .* bytes, chunks hold"),
        ({"shape": [-1, 4]}, "dimension should be an integer"),
        ({"shape": [1] * 100}, "over the limit of 64"),
        ({"shape": "big"}, "field 'shape' should be list"),
        ({"dtype": "object"}, "unsupported dtype 'object'"),
        ({"dtype": "os.system"}, "unsupported dtype"),
        ({"kind": "pickle"}, "unsupported leaf kind 'pickle'"),
        ({"chunks": [[b"x" * 32, 2**40, 1]]}, "chunk size should be an integer"),
        ({"chunks": [[b"short", 8, 8]]}, "chunk digest should be 32 bytes"),
        ({"chunks": [[b"x" * 32, 32, 40, 7, 0]]}, "pack index"),
        ({"address": "../../etc/passwd"}, "bad address.*not an address segment"),
        ({"address": 'layer/"b"'}, "not in canonical form"),
        ({"address": "layer/a"}, "sits at address"),
        ({"address": 7}, "field 'address' should be str"),
    ],
)
def test_hostile_leaf_fields(saved, fields, message):
    hostile.mutate_manifest(saved, "ckpt", hostile.set_leaf("layer/b", **fields))
    with pytest.raises(
        (treestore.errors.ManifestDamagedError, treestore.UnsupportedFormatError), match=message
    ) as info:
        treestore.load(saved)
    assert "'ckpt'" in str(info.value)


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.update(leaves="nope"),
        lambda m: m.update(tree={"type": "leaf", "leaf": 99}),
        lambda m: m.update(tree={"type": "pickle", "children": []}),
        lambda m: m.update(tree={"type": "dict", "keys": [["dict", "a"]], "children": []}),
        lambda m: m["leaves"].append(dict(m["leaves"][0])),
        lambda m: m.update(packs=[[b"x" * 32, 2**40, 0]]),
        lambda m: m.pop("leaves"),
        lambda m: m.update(format="zarr"),
    ],
)
def test_hostile_manifest_structure(saved, change):
    hostile.mutate_manifest(saved, "ckpt", change)
    with pytest.raises((treestore.errors.ManifestDamagedError, treestore.UnsupportedFormatError)):
        treestore.load(saved)


@pytest.mark.parametrize("depth", [501, 3000])
def test_deeply_nested_tree_record(saved, depth):
    import msgpack

    rec = hostile.manifest_record(saved, "ckpt")
    rec["tree"] = "PLACEHOLDER"
    level = msgpack.packb({"type": "list", "children": [None]})[:-1]  # ends with the child slot
    deep = level * depth + msgpack.packb({"type": "leaf", "leaf": 0})
    data = msgpack.packb(rec, use_bin_type=True).replace(msgpack.packb("PLACEHOLDER"), deep)
    hostile.write_manifest(saved, "ckpt", None, raw=data)
    with pytest.raises(treestore.errors.ManifestDamagedError, match=r"deeper than|not valid msgpack"):
        treestore.load(saved)


def test_tree_record_at_the_depth_limit_loads(saved):
    """The valid boundary: a leaf node at depth 500 (SPEC: deeper than 500 is invalid) decodes,
    loads, opens and verifies; Python's recursion limit must not decide it."""
    import msgpack

    depth = 500
    rec = hostile.manifest_record(saved, "ckpt")
    (leaf,) = [dict(e) for e in rec["leaves"] if e["address"] == "layer/b"]
    leaf["address"] = "/".join(["0"] * depth)
    rec["leaves"] = [leaf]
    rec["tree"] = "PLACEHOLDER"
    level = msgpack.packb({"type": "list", "children": [None]})[:-1]  # ends with the child slot
    deep = level * depth + msgpack.packb({"type": "leaf", "leaf": 0})
    data = msgpack.packb(rec, use_bin_type=True).replace(msgpack.packb("PLACEHOLDER"), deep)
    hostile.write_manifest(saved, "ckpt", None, raw=data, leaves=1, nbytes=32)
    out = treestore.load(saved)
    for _ in range(depth):
        assert type(out) is list and len(out) == 1
        out = out[0]
    assert out.tolist() == list(range(8))
    assert list(treestore.open(saved, "ckpt").leaves) == [leaf["address"]]
    assert treestore.verify(saved).ok


@pytest.mark.parametrize(
    "value",
    ["007", "+18446744073709551616", "18_446_744_073_709_551_616", "3", "-0", "١٨٤٤٦٧٤٤٠٧٣٧٠٩٥٥١٦١٦"],
    ids=["leading-zeros", "plus", "underscores", "in-range", "minus-zero", "non-ascii-digits"],
)
def test_int_leaf_text_must_be_canonical(saved, value):
    """A big int is stored as its canonical decimal text, only when outside [-2**63, 2**64):
    readers refuse any other text int() would accept, so one value has one encoding."""
    hostile.mutate_manifest(saved, "ckpt", hostile.set_leaf("step", value=value))
    with pytest.raises(treestore.errors.ManifestDamagedError, match="leaf step: an int leaf holds"):
        treestore.load(saved)
    assert not treestore.verify(saved).ok


def test_metadata_over_the_writers_limit_is_refused(saved):
    """Writers keep metadata within 1 MiB encoded; readers check the same bound."""
    hostile.mutate_manifest(saved, "ckpt", lambda m: m.update(metadata=bytes(2**20)))
    with pytest.raises(treestore.errors.ManifestDamagedError, match="over the 1 MiB limit"):
        treestore.load(saved)
    assert not treestore.verify(saved).ok


def test_chunk_of_another_checkpoint_is_caught(saved):
    """A digest that points at other data: the bytes do not hash to what this leaf expects."""
    treestore.save(saved, {"other": np.ones((256, 1024), np.float32)}, "other")
    other = hostile.chunk_paths(saved, "other")["other"][0]
    mine = hostile.chunk_paths(saved, "ckpt")["layer/w"][0]
    s = hostile.storage(saved)
    s.write(mine, [s.read(other)])
    with pytest.raises(treestore.errors.ChunkDamagedError, match="layer/w"):
        treestore.load(saved, "ckpt")


@pytest.mark.parametrize("member", [0, 2])
def test_pack_member_whose_digest_lies(store_url, member):
    """A manifest whose pack is intact but one member's digest differs from the member's bytes
    (a hostile writer's): a whole load, a selected load and a lazy read refuse that leaf, naming
    it, and the other members still load."""
    tree = {f"p{i}": np.full(4, i, np.float32) for i in range(3)}
    treestore.save(store_url, tree, "ckpt")
    rec = hostile.manifest_record(store_url, "ckpt")
    entry = next(e for e in rec["leaves"] if e["address"] == f"p{member}")
    assert entry["chunks"][0][3] == 0  # packed
    entry["chunks"][0][0] = b"\x01" * 32
    hostile.write_manifest(store_url, "ckpt", rec)
    for read in (
        lambda: treestore.load(store_url),
        lambda: treestore.load(store_url, select=f"p{member}"),
        lambda: np.asarray(treestore.open(store_url)[f"p{member}"]),
    ):
        with pytest.raises(treestore.errors.ChunkDamagedError, match=f"p{member}: chunk 0101") as info:
            read()
        assert info.value.address == f"p{member}" and info.value.checkpoint == "ckpt"
    other = f"p{2 - member}"
    assert treestore.load(store_url, select=other)[other].tolist() == [2 - member] * 4


@pytest.mark.parametrize("lie", [None, 0, 1])
def test_packed_pieces_whose_digest_lies(store_url, lie):
    """A leaf saved in two pieces, each one chunk inside a pack, assembled from the columns: with
    honest digests it loads; a piece whose digest differs from its bytes is refused, naming the
    leaf, by a whole load, a selected load and a lazy read."""
    import blake3

    values = np.arange(4, dtype=np.float32)
    treestore.save(store_url, {"p": values, "q": np.ones(3, np.float32)}, "ckpt")
    rec = hostile.manifest_record(store_url, "ckpt")
    entry = next(e for e in rec["leaves"] if e["address"] == "p")
    _, raw, _, pack, offset = entry.pop("chunks")[0]
    assert raw == 16 and pack is not None
    halves = [values[:2].tobytes(), values[2:].tobytes()]
    refs = [[blake3.blake3(h).digest(), 8, 0, pack, offset + 8 * k] for k, h in enumerate(halves)]
    if lie is not None:
        refs[lie][0] = b"\x01" * 32
    entry["pieces"] = [[[2 * k], [2], [r]] for k, r in enumerate(refs)]
    hostile.write_manifest(store_url, "ckpt", rec)
    reads = (
        lambda: treestore.load(store_url)["p"],
        lambda: treestore.load(store_url, select="p")["p"],
        lambda: np.asarray(treestore.open(store_url)["p"]),
    )
    for read in reads:
        if lie is None:
            assert read().tolist() == values.tolist()
            continue
        with pytest.raises(treestore.errors.ChunkDamagedError, match="p: chunk 0101") as info:
            read()
        assert info.value.address == "p" and info.value.checkpoint == "ckpt"
    assert treestore.load(store_url, select="q")["q"].tolist() == [1, 1, 1]


def _leaf(m, address):
    return next(leaf for leaf in m["leaves"] if leaf["address"] == address)


@pytest.mark.parametrize("how", ["same bytes", "overlapping bytes"])
def test_leaves_naming_the_same_packed_bytes_load_as_separate_arrays(store_url, how):
    """A consistent manifest may name one pack member for two leaves (or members that overlap):
    the load must still give each leaf memory of its own, so writing one never changes another."""
    a, b = np.arange(8, dtype=np.float32), np.arange(8, 16, dtype=np.float32)
    treestore.save(store_url, {"a": a, "b": b, "c": np.ones(4, np.int32)}, "ckpt")

    def alias(m):
        first, second = _leaf(m, "a"), _leaf(m, "b")
        second["chunks"] = [list(c) for c in first["chunks"]]
        if how == "overlapping bytes":  # b: the last 6 floats of a and the first 2 of b
            (ref,) = _leaf(m, "b")["chunks"]
            ref[4] = first["chunks"][0][4] + 8  # [digest, raw, stored, pack, offset]
            ref[0] = blake3.blake3(np.concatenate([a[2:], b[:2]]).tobytes()).digest()

    hostile.mutate_manifest(store_url, "ckpt", alias)
    tree = treestore.load(store_url)
    expected_b = a if how == "same bytes" else np.concatenate([a[2:], b[:2]])
    assert tree["a"].tolist() == a.tolist() and tree["b"].tolist() == expected_b.tolist()
    leaves = [tree["a"], tree["b"], tree["c"]]
    for i, x in enumerate(leaves):
        for y in leaves[i + 1 :]:
            assert not np.shares_memory(x, y)
    tree["a"][:] = -1
    assert tree["b"].tolist() == expected_b.tolist()


def test_a_manifest_damaged_after_it_was_opened_is_refused_when_reopened(saved):
    """Reopening reuses the columns decoded from a manifest of the same digest, but its bytes
    are read and checked every time: damage after the first open is still found."""
    first = treestore.open(saved, "ckpt")
    again = treestore.open(saved, "ckpt")
    assert again._columns is first._columns  # decoded and validated once
    ref = hostile.commit_record(saved, "ckpt")
    hostile.truncate(saved, _paths.manifest_path(ref["manifest"]), 50)
    for read in (lambda: treestore.open(saved, "ckpt"), lambda: treestore.load(saved)):
        with pytest.raises(treestore.errors.ManifestDamagedError, match="manifest of checkpoint 'ckpt'"):
            read()


def test_a_checkpoint_saved_again_under_its_name_is_read_anew(store_url):
    treestore.save(store_url, {"w": np.zeros(3)}, "c")
    assert treestore.open(store_url, "c")["w"][0] == 0.0
    treestore.save(store_url, {"w": np.ones(3)}, "c", overwrite=True)
    assert treestore.open(store_url, "c")["w"][0] == 1.0


def test_a_load_hashes_packed_bytes_once(store_url, monkeypatch):
    """Each pack member is checked against its own digest; the pack is not hashed again."""
    from treestore._engine.reading import read as _read

    tree = {f"b{i}": np.full(100 + i, i, np.float32) for i in range(40)}
    treestore.save(store_url, tree, "packed")
    hashed = []
    real = _read.digest

    def counting(data, **kw):
        hashed.append(memoryview(data).nbytes)
        return real(data, **kw)

    monkeypatch.setattr(_read, "digest", counting)
    got = treestore.load(store_url, "packed")
    assert all(np.array_equal(got[k], v) for k, v in tree.items())
    assert sum(hashed) == sum(v.nbytes for v in tree.values())


@pytest.mark.parametrize(
    "read",
    [
        pytest.param(lambda leaf: leaf[80:96], id="whole-chunks"),
        pytest.param(lambda leaf: leaf[82:83], id="part-of-a-chunk"),
        pytest.param(lambda leaf: leaf[70:90, 5], id="across-chunks-one-column"),
        pytest.param(lambda leaf: leaf.region((slice(81, 200), slice(3, 9))), id="region"),
        pytest.param(lambda leaf: np.asarray(leaf), id="whole-leaf"),
    ],
)
def test_a_chunk_that_decodes_to_other_bytes_fails_every_lazy_read(store_url, read):
    """A chunk object replaced by a well-formed object of other bytes decodes without complaint:
    only its digest tells. Every read that touches it — whole chunks, part of one, a column
    across several, a region, the whole leaf — raises ChunkDamagedError naming the leaf."""
    from treestore._format import codecs

    treestore.save(store_url, {"w": W}, "ckpt", options=treestore.SaveOptions(chunk_size=64 * 1024))
    paths = hostile.chunk_paths(store_url, "ckpt")["w"]
    assert len(paths) == 16  # rows 16k..16k+15 in chunk k
    other = W[80:96].copy()
    other[2, 7] += 1.0  # one element of row 82
    hostile.storage(store_url).write(paths[5], codecs.encode(other.view(np.uint8).ravel(), 4, codecs.Codec()))
    leaf = treestore.open(store_url, "ckpt")["w"]
    np.testing.assert_array_equal(leaf[0:80], W[0:80])  # the other chunks read as they are
    with pytest.raises(treestore.errors.ChunkDamagedError, match=r"w: chunk .* does not match its digest"):
        read(leaf)


@pytest.mark.parametrize("damage", ["flip", "truncate", "pack"])
def test_damage_read_into_a_load_s_staging_buffers(saved, damage, monkeypatch):
    """A load onto an accelerator (forced here on the CPU) reads into reused host buffers: a
    damaged chunk or pack is the same ChunkDamagedError naming the leaf and the checkpoint."""
    import jax

    from treestore._engine.reading import load as load_module

    monkeypatch.setattr(load_module, "_to_accelerator", lambda: True)
    chunks = hostile.chunk_paths(saved, "ckpt")
    if damage == "pack":
        hostile.flip_byte(saved, chunks["<pack 0>"][0], -1)
    elif damage == "flip":
        hostile.flip_byte(saved, chunks["layer/w"][0], 100)
    else:
        hostile.truncate(saved, chunks["layer/w"][0], 16)
    like = {
        "layer": {"w": jax.ShapeDtypeStruct(W.shape, W.dtype), "b": jax.ShapeDtypeStruct((8,), np.float32)}
    }
    like["step"] = 0  # type: ignore[assignment]
    address = "layer/b" if damage == "pack" else "layer/w"
    with pytest.raises(treestore.errors.ChunkDamagedError, match=f"{address}: chunk") as info:
        treestore.load(saved, like=like)
    assert info.value.address == address and info.value.checkpoint == "ckpt"
