"""Absurd shapes and sizes: declared sizes are checked before anything is allocated, decompression
is bounded by the declared size, and a reader never reads more of an object than its format allows.

Every case runs under a memory bound (tracemalloc: Python and numpy allocations).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import zstandard

import treestore
from treestore._format import codecs as _codecs
from treestore._format import paths as _paths
from treestore._format.encoding import Bad
from treestore._format.limits import CHUNK_SLACK, MAX_GRID_CELLS, MAX_MANIFEST_BYTES
from treestore._format.manifest.rules import check_tiling

from ..support import hostile
from ._harness import MiB, errors

KiB = 1024
READ_CHUNKS = ["load", "open", "verify", "diff"]


def _chunk(codec: int, raw_size: int, body: bytes, width: int = 0, mask: int = 0) -> bytes:
    return _codecs.HEADER.pack(_codecs.MAGIC, codec, width, mask, raw_size) + body


# --- shapes ------------------------------------------------------------------------------------------
@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "shape",
    [
        [2**48, 2**48, 0],  # zero elements, but numpy refuses the shape
        [0, 2**40, 2**40, 2**40],
        [2**31] * 4 + [0],
        [0] * 64,
    ],
)
def test_empty_leaf_with_absurd_dimensions(store, shape):
    store.mutate_manifest(hostile.set_leaf("empty", shape=shape, chunks=[]))
    store.check(ops=["load", "open", "verify", "diff"])


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "shape",
    [
        [2**49],
        [-1],
        [2**64 - 1],
        [2**63],
        [1] * 65,
        [2**48, 2**48],
        [2**24, 2**24, 2**24],
        ["1"],
        [1.0],
        [None],
    ],
)
def test_absurd_shape(store, shape):
    store.mutate_manifest(hostile.set_leaf("w", shape=shape))
    out = store.check(ops=["load", "verify"])
    assert isinstance(out["load"].error, treestore.errors.ManifestDamagedError), errors(out)


@pytest.mark.timeout(60)
def test_consistent_declaration_of_a_terabyte_leaf(store):
    """4096 chunk refs of 256 MiB (a 190 KiB manifest) declare a 1 TiB leaf. The reader may
    allocate what a manifest declares (a real leaf that big needs it), but when it cannot, the
    caller must get a TreestoreError, not MemoryError."""
    refs = [[bytes([i % 256, i // 256]) + bytes(30), 256 * MiB, 10_000] for i in range(4096)]
    store.mutate_manifest(hostile.set_leaf("ids", dtype="uint8", shape=[2**40], chunks=refs))
    out = store.check(ops=["manifest", "load", "open", "verify"])
    assert out["manifest"].error is None
    assert out["load"].error is not None


@pytest.mark.timeout(60)
def test_declared_gigabyte_with_missing_chunks_allocates_at_most_what_is_declared(store):
    refs = [[bytes([i]) + bytes(31), 256 * MiB, 10_000] for i in range(4)]
    store.mutate_manifest(hostile.set_leaf("ids", dtype="uint8", shape=[2**30], chunks=refs))
    out = store.check(ops=["load", "open", "verify"], memory=2**30 + 64 * MiB)
    assert isinstance(out["load"].error, treestore.errors.ChunkMissingError)
    assert out["load"].error.address == "ids"


@pytest.mark.timeout(60)
def test_many_tiny_chunk_refs_stay_within_a_bounded_multiple_of_the_manifest(store):
    """A manifest of 5,000 one-byte chunk refs: decoding it must cost memory proportional to
    its size, and every ref must be checked (here: all point at missing chunks)."""
    n = 5_000
    refs = [[i.to_bytes(32, "little"), 1, 9] for i in range(n)]
    store.mutate_manifest(hostile.set_leaf("ids", dtype="uint8", shape=[n], chunks=refs))
    size = (store.root / _paths.manifest_path(store.ref_record()["manifest"])).stat().st_size
    out = store.check(ops=["manifest", "load", "verify"], memory=64 * size + 64 * MiB)
    assert isinstance(out["load"].error, treestore.errors.ChunkMissingError)


# --- chunk refs: sizes, offsets, packs -----------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("address", "index", "value"),
    [
        ("w", 1, -1),
        ("w", 1, 2**64 - 1),
        ("w", 1, 256 * MiB + 1),
        ("w", 2, -1),
        ("w", 2, 2**63),
        ("small/a", 3, -1),  # pack index
        ("small/a", 3, 2**32),
        ("small/a", 4, -1),  # byte offset in the pack
        ("small/a", 4, 2**63 - 1),
        ("small/a", 4, 2**64 - 1),
        ("small/a", 4, 10**6),
    ],
)
def test_negative_or_overflowing_chunk_ref_fields(store, address, index, value):
    def change(m):
        leaf = next(x for x in m["leaves"] if x["address"] == address)
        leaf["chunks"][0][index] = value

    store.mutate_manifest(change)
    out = store.check(ops=["load", "open", "verify"])
    assert isinstance(out["load"].error, treestore.errors.ManifestDamagedError), errors(out)


@pytest.mark.timeout(30)
def test_chunk_size_that_disagrees_with_the_object(store):
    """Sizes that still sum to the leaf's bytes, but the chunk objects hold other sizes."""

    def change(m):
        leaf = next(x for x in m["leaves"] if x["address"] == "w")
        a, b = leaf["chunks"]
        a[1], b[1] = a[1] - 4, b[1] + 4

    store.mutate_manifest(change)
    out = store.check(ops=READ_CHUNKS)
    assert (
        isinstance(out["load"].error, treestore.errors.ChunkDamagedError) and out["load"].error.address == "w"
    )


@pytest.mark.timeout(30)
def test_pack_declared_huge_with_a_small_object(store):
    """A pack that claims 256 MiB: the reader may allocate about that much (twice: the buffer and
    a read of up to the declared size), no more, and must fail. Not once per leaf in the pack."""

    def change(m):
        m["packs"][0][1] = 256 * MiB

    store.mutate_manifest(change)
    out = store.check(ops=["load", "open", "verify"], memory=2 * 256 * MiB + 64 * MiB)
    assert isinstance(out["load"].error, treestore.errors.ChunkDamagedError)


# --- chunk objects -------------------------------------------------------------------------------
@pytest.mark.timeout(30)
@pytest.mark.parametrize("raw_size", [0, 1, 2**31, 2**40, 2**63, 2**64 - 1])
def test_chunk_header_declares_another_raw_size(store, raw_size):
    path = store.chunk_file("ids")
    data = bytearray(path.read_bytes())
    struct.pack_into("<Q", data, 8, raw_size)
    path.write_bytes(bytes(data))
    out = store.check(ops=READ_CHUNKS)
    assert isinstance(out["load"].error, treestore.errors.ChunkDamagedError)
    assert "ids" in str(out["load"].error)


def _ids_chunk(store) -> tuple[os.PathLike[str], int, bytes]:
    """The first chunk of "ids" (a zstd chunk): its path, raw size and raw bytes."""
    path = store.chunk_file("ids")
    obj = path.read_bytes()
    size = struct.unpack_from("<Q", obj, 8)[0]
    raw = zstandard.ZstdDecompressor().decompress(obj[16:], max_output_size=size)
    return path, size, raw


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "case",
    [
        "content size too big",
        "content size too small",
        "no content size",
        "bigger frame",
        "two frames",
        "trailing garbage",
        "skippable frame",
        "empty body",
        "frame of another chunk",
    ],
)
def test_zstd_frames_that_lie(store, case):
    path, size, raw = _ids_chunk(store)
    cctx = zstandard.ZstdCompressor(write_content_size=True)
    if case == "content size too big":
        body = zstandard.ZstdCompressor().compress(raw + bytes(2**20))
    elif case == "content size too small":
        frame = bytearray(cctx.compress(raw))
        frame = cctx.compress(raw[: size // 2])  # a valid frame of half the size ...
        body = frame
    elif case == "no content size":
        body = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
    elif case == "bigger frame":  # declares n, holds 64 MiB of zeros after a patched header
        big = cctx.compress(raw + bytes(64 * MiB))
        params = zstandard.get_frame_parameters(big)
        assert params.content_size == size + 64 * MiB
        body = big.replace(struct.pack("<Q", params.content_size), struct.pack("<Q", size), 1)
    elif case == "two frames":
        body = cctx.compress(raw) + cctx.compress(raw)
    elif case == "trailing garbage":
        body = cctx.compress(raw) + b"\xff" * 100
    elif case == "skippable frame":
        body = struct.pack("<II", 0x184D2A50, 4) + b"skip" + cctx.compress(raw)
    elif case == "empty body":
        body = b""
    else:
        other = store.chunk_file("ids", 1).read_bytes()
        body = other[16:]
    path.write_bytes(_chunk(_codecs.ZSTD, size, body))
    out = store.check(ops=READ_CHUNKS, memory=16 * MiB)
    load = out["load"]
    if load.error is None:  # the only acceptable success: exactly the saved bytes
        assert case in ("two frames", "trailing garbage"), f"{case}: accepted"
        assert bytes(load.value["ids"].view("uint8")[:size]) == raw
    else:
        assert isinstance(load.error, treestore.errors.ChunkDamagedError) and load.error.address == "ids"


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "lengths",
    [
        [2**64 - 1] * 4,
        [2**63, 2**63, 0, 0],
        [0, 0, 0, 0],
        "swap",  # right sum, wrong split
        "short table",
    ],
)
def test_byte_plane_tables_that_lie(store, lengths):
    path = store.chunk_file("w")
    obj = bytearray(path.read_bytes())
    assert obj[4] == _codecs.PLANES and obj[5] == 4
    table = list(struct.unpack_from("<4Q", obj, 16))
    if lengths == "swap":
        table[0], table[1] = table[0] + 1, table[1] - 1
        struct.pack_into("<4Q", obj, 16, *table)
    elif lengths == "short table":
        obj = obj[:40]
    else:
        struct.pack_into("<4Q", obj, 16, *lengths)
    path.write_bytes(bytes(obj))
    out = store.check(ops=READ_CHUNKS, memory=16 * MiB)
    assert (
        isinstance(out["load"].error, treestore.errors.ChunkDamagedError) and out["load"].error.address == "w"
    )


@pytest.mark.timeout(30)
def test_raw_chunk_body_of_the_wrong_length(store):
    path = store.chunk_file("small/a")  # the pack, stored raw here: a valid encoding of it
    obj = path.read_bytes()
    size = struct.unpack_from("<Q", obj, 8)[0]
    raw = zstandard.ZstdDecompressor().decompress(obj[16:], max_output_size=size) if obj[4] else obj[16:]
    path.write_bytes(_chunk(_codecs.RAW, size, raw))
    store.check(ops=["load"])  # the raw form reads back
    for body in (raw[:-1], raw + b"\0", b""):
        path.write_bytes(_chunk(_codecs.RAW, size, body))
        out = store.check(ops=READ_CHUNKS)
        assert isinstance(out["load"].error, treestore.errors.ChunkDamagedError)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("extra", [1, 4096, 2 * MiB])
def test_chunk_object_larger_than_its_raw_size_allows(store, extra):
    """A valid zstd chunk followed by trailing bytes, the object now beyond its raw size plus
    the 144 bytes of slack: refused (SPEC.md §4), though its frame alone decodes to exactly the
    chunk's bytes, and read no further than the bound."""
    path, size, _ = _ids_chunk(store)
    obj = path.read_bytes()
    path.write_bytes(obj + b"\xff" * (size + CHUNK_SLACK + extra - len(obj)))
    out = store.check(ops=READ_CHUNKS, memory=16 * MiB)
    assert isinstance(out["load"].error, treestore.errors.ChunkDamagedError), errors(out)
    assert out["load"].error.address == "ids"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("declared", [MAX_MANIFEST_BYTES + 1, 2**40])
def test_commit_record_declaring_a_manifest_over_the_bound(store, declared):
    """A sealed commit record whose manifest_size exceeds MAX_MANIFEST_BYTES is damaged as it
    stands: listing leaves it out, and loading names the field, without reading the manifest."""
    store.write_ref({**store.ref_record(), "manifest_size": declared})
    out = store.check(ops=["list", "load", "verify all"])
    assert [c.name for c in out["list"].value] == ["good"]
    assert isinstance(out["load"].error, treestore.errors.ManifestDamagedError), errors(out)
    assert "manifest_size" in str(out["load"].error)


# --- huge objects: never read whole ---------------------------------------------------------------
def _sparse(path: os.PathLike[str], size: int, head: bytes = b"") -> None:
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)


@pytest.mark.timeout(60)
def test_huge_chunk_object_is_not_read_whole(store):
    path = store.chunk_file("w")
    _sparse(path, 8 * 2**30, path.read_bytes()[:16])
    out = store.check(ops=READ_CHUNKS, memory=16 * MiB)
    assert isinstance(out["load"].error, treestore.errors.ChunkDamagedError)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("declared", ["its own size", "the maximum"])
def test_huge_manifest_object_is_not_read_beyond_its_bound(store, declared):
    """The commit record bounds the read: its manifest_size (at most 256 MiB)."""
    ref = store.ref_record()
    path = store.root / _paths.manifest_path(ref["manifest"])
    _sparse(path, 8 * 2**30, path.read_bytes())
    if declared == "the maximum":
        store.write_ref({**ref, "manifest_size": 256 * MiB})
    out = store.check(ops=["load"], memory=256 * MiB + 64 * MiB)
    assert isinstance(out["load"].error, treestore.errors.ManifestDamagedError)


@pytest.mark.timeout(60)
def test_huge_commit_record_is_not_read_whole(store):
    path = store.root / _paths.record_path("bad")
    _sparse(path, 8 * 2**30, path.read_bytes())
    out = store.check(ops=["list", "load", "verify all"], memory=16 * MiB)
    assert isinstance(out["load"].error, treestore.errors.ManifestDamagedError)


# --- pieces of sharded leaves --------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "case", ["overlap", "hole", "outside", "too many", "irregular grid", "huge start", "wrong rank"]
)
def test_pieces_that_do_not_tile_the_leaf(store, case):
    rec = store.manifest_record()
    leaf = next((x for x in rec["leaves"] if "pieces" in x), None)
    if leaf is None:
        leaf = next(x for x in rec["leaves"] if x["address"] == "w")  # give "w" pieces
        leaf["pieces"] = [[[0, 0], leaf["shape"], leaf.pop("chunks")]]
    pieces = leaf["pieces"]
    first = pieces[0]
    if case == "overlap":
        pieces[1] = [list(first[0]), first[1], pieces[1][2]] if len(pieces) > 1 else pieces[0]
        pieces.append(first)
    elif case == "hole":
        pieces.pop()
    elif case == "outside":
        first[0] = [s + 1 for s in first[0]]
    elif case == "too many":
        pieces.extend([[[0] * len(first[0]), [0] * len(first[0]), []]] * 70_000)
    elif case == "irregular grid":
        n = len(first[0])
        pieces.extend([[[i] + [0] * (n - 1), [0] * n, []] for i in range(3000)])
        for p in pieces[:3000]:
            if len(p[0]) > 1:
                p[0][1] = 1
    elif case == "huge start":
        first[0] = [2**48] * len(first[0])
    else:
        first[0] = first[0] + [0]
    store.write_manifest(rec)
    out = store.check(ops=["load", "verify"], memory=96 * MiB)
    assert isinstance(out["load"].error, treestore.errors.ManifestDamagedError), errors(out)


@pytest.mark.timeout(60)
def test_pieces_whose_boundaries_span_too_large_a_grid(store):
    """4,200 pieces that tile a 2100 x 2101 leaf exactly (row i cut at column i + 1) but whose
    boundaries span a grid of 2100 x 2101 cells, over MAX_GRID_CELLS: refused by that bound,
    before the cover of every cell is counted."""
    rows, cols = 2100, 2101
    assert rows * cols > MAX_GRID_CELLS

    def ref(i: int, n: int) -> list[object]:
        return [i.to_bytes(32, "little"), n, n + 16]

    pieces = []
    for i in range(rows):
        pieces.append([[i, 0], [1, i + 1], [ref(2 * i, i + 1)]])
        pieces.append([[i, i + 1], [1, cols - i - 1], [ref(2 * i + 1, cols - i - 1)]])

    def change(m):
        leaf = next(x for x in m["leaves"] if x["address"] == "ids")
        leaf.pop("chunks")
        leaf.update(dtype="uint8", shape=[rows, cols], pieces=pieces)

    store.mutate_manifest(change)
    out = store.check(ops=["manifest", "load", "verify"], memory=96 * MiB)
    assert isinstance(out["load"].error, treestore.errors.ManifestDamagedError), errors(out)
    assert "grid" in str(out["load"].error)


@pytest.mark.timeout(5)  # about 0.1 s; counting every cell takes minutes
def test_overlapping_pieces_over_a_fine_grid_are_refused_without_counting_every_cell():
    """2,040 one-element pieces on the diagonal cut a leaf into a grid of about 4.2 million
    cells (just under MAX_GRID_CELLS); 40,000 more pieces each cover the whole grid. Counting
    the cover of every cell of every piece is 1.7e11 additions (minutes); the pieces cover more
    cells than the grid has, so they overlap, and that is known from their corners alone."""
    n = 2040
    tiny = np.stack([np.arange(n), np.arange(n)], 1)
    big = np.zeros((40_000, 2), np.int64)
    start = np.concatenate([tiny, big]).astype(np.int64)
    extent = np.concatenate([np.ones((n, 2)), np.full((40_000, 2), n)]).astype(np.int64)
    with pytest.raises(Bad, match="overlap"):
        check_tiling(start, extent, (n + 1, n + 1))
    assert (n + 1) ** 2 <= MAX_GRID_CELLS


def test_two_pieces_that_overlap_and_leave_a_hole_are_refused_in_version_1(store):
    """A leaf of two pieces made from its own two intact chunks: both at the top, so the bottom
    half is covered by none. The bytes add up and every chunk matches its digest, so only the
    tiling check tells: every reader refuses it (it would load uninitialised memory), and verify
    reports it. The same two chunks tiling the leaf (top and bottom) load as saved. (The hostile
    manifest is written in format version 1.)"""
    want = np.asarray(treestore.load(store.url, "good", select="w")["w"])

    def pieces(second_row: int) -> Callable[[dict[str, Any]], None]:
        def change(m: dict[str, Any]) -> None:
            leaf = next(x for x in m["leaves"] if x["address"] == "w")
            c0, c1 = leaf.pop("chunks")
            leaf["pieces"] = [[[0, 0], [128, 128], [c0]], [[second_row, 0], [128, 128], [c1]]]

        return change

    store.mutate_manifest(pieces(128), name="good")
    np.testing.assert_array_equal(np.asarray(treestore.load(store.url, "good", select="w")["w"]), want)
    store.mutate_manifest(pieces(0))
    out = store.check(ops=["manifest", "load", "open", "verify"], memory=96 * MiB)
    for op in ("manifest", "load", "open"):
        assert isinstance(out[op].error, treestore.errors.ManifestDamagedError), errors(out)
        assert "overlap or leave holes" in str(out[op].error)
    assert not out["verify"].value.ok


def test_two_pieces_that_overlap_and_leave_a_hole_are_refused(tmp_path):
    """Format version 2: a leaf saved in two pieces (sharded over two devices), the second
    piece's start moved onto the first. Its packed bytes and their digests are intact, so only
    the tiling check tells: every reader refuses it (it would load uninitialised memory for the
    bottom half), and verify reports it."""
    import jax

    from ._harness import check_readers

    url = str(tmp_path / "store")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    values = np.arange(512.0, dtype=np.float32).reshape(16, 32)
    treestore.save(url, {"w": jax.device_put(values, spec)}, "bad")

    def overlap(rec, arrays):
        assert arrays["piece_start"].reshape(-1, 2).tolist() == [[0, 0], [8, 0]]
        arrays["piece_start"][:] = 0

    hostile.mutate_v2_manifest(url, "bad", overlap)
    out = check_readers(url, good=None, ops=["manifest", "load", "open", "verify"])
    for op in ("manifest", "load", "open"):
        assert isinstance(out[op].error, treestore.errors.ManifestDamagedError), (op, out[op])
        assert "overlap or leave holes" in str(out[op].error)
    assert not out["verify"].value.ok
