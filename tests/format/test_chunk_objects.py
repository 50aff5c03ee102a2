"""A chunk object is what its name says before anything references it (issue 12.2).

A save (and a copy) references an object already under a chunk's name only if its size and
header fit the chunk; a bad one is written again, from the bytes that were hashed. On a local
disk a chunk's final name only ever holds complete, fsynced bytes.
"""

from __future__ import annotations

import os
import struct
import threading
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import treestore
from tests.support.faults import (
    chunk_objects,
    chunked_tree,
    get_object,
    put_object,
)
from tests.support.helpers import assert_tree_equal
from treestore.errors import ChunkDamagedError

MiB = 2**20
HEADER = struct.Struct("<4sBBHQ")  # SPEC.md section 4: magic, codec, plane width, mask, raw size


def tree() -> dict[str, Any]:
    """One leaf per codec: byte planes (float32 weights), zstd (ints), raw (random bytes)."""
    rng = np.random.default_rng(5)
    return {
        "planes": (rng.standard_normal(100_000) * 0.02).astype(np.float32),
        "zstd": np.arange(100_000, dtype=np.int64) % 1000,
        "raw": rng.integers(0, 256, 300_000, dtype=np.uint8),
        "small": np.arange(10, dtype=np.int32),
    }


def chunk_file(root: Path, store: treestore.Store, name: str, address: str) -> Path:
    (entry,) = [e for e in store.manifest(name).leaves if e.address == address]
    (c,) = entry.chunks
    h = c.digest.hex()
    return root / "chunks" / h[:2] / h


def codec_of(data: bytes) -> int:
    return HEADER.unpack_from(data)[1]


def _damaged(good: bytes, how: str) -> bytes:
    magic, codec, width, mask, size = HEADER.unpack_from(good)
    if how == "empty":
        return b""
    if how == "header only":
        return good[: HEADER.size]
    if how == "truncated":
        return good[:-1]
    if how == "extended":
        return good + b"\0"
    if how == "zeroed":  # a power cut after the size but before the data reached the disk
        return bytes(len(good))
    if how == "magic":
        return b"XXXX" + good[4:]
    if how == "raw size":
        return HEADER.pack(magic, codec, width, mask, size - 4) + good[HEADER.size :]
    if how == "codec":
        return HEADER.pack(magic, 9, width, mask, size) + good[HEADER.size :]
    raise AssertionError(how)


# Damage the cheap check finds for every codec, and what it finds only where the stored size is
# told by the header (raw: exact; byte planes: the plane-length table).
EVERY_CODEC = ["empty", "header only", "zeroed", "magic", "raw size", "codec"]
SIZED_CODECS = ["truncated", "extended"]


@pytest.mark.parametrize(
    ("address", "how"),
    [(a, h) for a in ("planes", "zstd", "raw") for h in EVERY_CODEC]
    + [(a, h) for a in ("planes", "raw") for h in SIZED_CODECS],
)
def test_a_save_rewrites_a_bad_object_under_a_chunk_name(tmp_path: Path, address: str, how: str):
    root = tmp_path / "store"
    store = treestore.Store(str(root))
    data = tree()
    store.save(data, "first")
    path = chunk_file(root, store, "first", address)
    good = path.read_bytes()
    assert codec_of(good) == {"raw": 0, "zstd": 1, "planes": 2}[address]
    path.write_bytes(_damaged(good, how))
    # Damaged after "first" committed it: a save trusting "first" would not look at it again
    # (tests/engine/test_trusted_chunks.py); one that checks every chunk repairs it.
    result = store.save(data, "again", trust_previous=False)
    assert result.chunks_written == 1, f"the {how} object was reused"
    assert path.read_bytes() == good
    assert_tree_equal(store.load("again"), data)
    assert_tree_equal(store.load("first"), data)  # repaired for the earlier checkpoint too
    assert treestore.verify(str(root)).ok


def test_a_sound_object_is_reused(tmp_path: Path):
    store = treestore.Store(str(tmp_path / "store"))
    first = store.save(tree(), "first")
    again = store.save(tree(), "again")
    assert again.chunks_written == 0 and again.chunks_reused == first.chunks_written


@pytest.mark.parametrize("how", ["truncated", "zeroed", "raw size"])
def test_copy_rewrites_a_bad_object_at_the_destination(tmp_path: Path, how: str):
    src = f"memory://treestore-tests/{uuid.uuid4().hex}"
    root = tmp_path / "dst"
    data = tree()
    treestore.save(src, data, "a")
    treestore.copy(f"{src}#a", str(root))
    store = treestore.Store(str(root))
    path = chunk_file(root, store, "a", "planes")
    good = path.read_bytes()
    store.delete("a")
    path.write_bytes(_damaged(good, how))
    report = treestore.copy(f"{src}#a", str(root))
    assert report.chunks_copied == 1
    assert path.read_bytes() == good
    assert_tree_equal(store.load("a"), data)


@pytest.mark.timeout(60)
def test_small_leaves_written_to_during_a_save_never_make_a_damaged_pack(tmp_path: Path):
    """Small leaves are packed: each is hashed and copied into its pack from one copy."""
    url = str(tmp_path / "store")
    leaves = [np.zeros(2048, np.float32) for _ in range(300)]  # 8 KiB each, in packs
    stop = threading.Event()

    def scribble() -> None:
        k = 0.0
        while not stop.is_set():
            for a in leaves:
                a[:] = k
            k += 1.0

    writer = threading.Thread(target=scribble, daemon=True)
    writer.start()
    try:
        for i in range(8):
            treestore.save(url, {"small": leaves}, f"s{i}")
    finally:
        stop.set()
        writer.join()
    report = treestore.verify(url)
    assert report.ok, "\n".join(p.message for p in report.problems)


def test_a_local_chunk_is_fsynced_before_it_takes_its_name(tmp_path: Path, monkeypatch):
    """Otherwise a power cut between the rename and the next sync can leave an empty or short
    file under the chunk's name, which later saves would find there."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace, real_link = os.fsync, os.replace, os.link

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: Any, dst: Any, **kw: Any) -> None:
        events.append(("name", os.fspath(src)))
        real_replace(src, dst, **kw)

    def link(src: Any, dst: Any, **kw: Any) -> None:
        events.append(("name", os.fspath(src)))
        real_link(src, dst, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "link", link)
    treestore.save(str(tmp_path / "store"), tree(), "a", overwrite=True)
    monkeypatch.undo()
    named = [path for what, path in events if what == "name"]
    assert any("/chunks/" in p for p in named)
    for path in named:
        fsynced = ("fsync", path) in events[: events.index(("name", path))]
        assert fsynced, f"{path} took its final name before it was fsynced"


@pytest.mark.parametrize("width", [2, 4, 8])
def test_the_fast_and_the_numpy_byte_planes_are_the_same_bytes(monkeypatch, width):
    """Chunk objects do not depend on whether the compiled part was built: encoding with it and
    without it gives identical objects, and each decodes the other's."""
    from treestore._format import codecs
    from treestore._kernels import planes

    if planes._COMPILED is None:
        pytest.skip("no compiled part in this install: only the numpy path exists")
    rng = np.random.default_rng(width)
    raw = (rng.standard_normal(4096 * width) * 0.02).astype(np.float32).view(np.uint8)[: 4096 * width]
    fast = b"".join(bytes(b) for b in codecs.encode(raw, width, codecs.Codec()))
    monkeypatch.setattr(planes, "_COMPILED", None)
    slow = b"".join(bytes(b) for b in codecs.encode(raw, width, codecs.Codec()))
    assert fast == slow and fast[4] == codecs.PLANES
    for obj in (fast, slow):
        out = np.empty(raw.nbytes, np.uint8)
        codecs.decode_into(obj, out)
        assert out.tobytes() == raw.tobytes()
    monkeypatch.undo()
    out = np.empty(raw.nbytes, np.uint8)
    codecs.decode_into(slow, out)  # the fast path decodes what the numpy path wrote
    assert out.tobytes() == raw.tobytes()


def test_a_big_chunk_stored_alone_is_hashed_and_compressed_on_every_core(tmp_path: Path, monkeypatch):
    """A 64 MiB leaf saved as one chunk: nothing else overlaps it, so its BLAKE3 runs on every
    core and its 16 MiB planes are compressed by zstd's threads into frames every reader
    decodes; the leaf loads exactly, whole and as one leaf, and verifies. Chunks of the default
    size (four at a time here) stay on one thread each."""
    import blake3

    from treestore._kernels import compressors
    from treestore._kernels import digest as hashing

    asked: list[tuple[int, int]] = []
    real = blake3.blake3

    def spy(data: Any = b"", **kwargs: Any) -> Any:
        asked.append((memoryview(data).nbytes, kwargs.get("max_threads", 1)))
        return real(data, **kwargs)

    monkeypatch.setattr(hashing.blake3, "blake3", spy)
    raw = (np.random.default_rng(3).standard_normal(16 * 2**20) * 0.02).astype(np.float32).view(np.uint8)
    assert hashing.digest(raw, spread=True) == real(raw.tobytes()).digest() == hashing.digest(raw)
    plane = raw[3::4].tobytes()
    if (os.cpu_count() or 1) > 1:  # zstd's threads make other, equally valid, frames
        spread = compressors.compressor(1, spread=True).compress(plane)
        assert spread != compressors.compressor(1).compress(plane)
    store = treestore.Store(str(tmp_path / "store"))
    asked.clear()
    store.save({"w": raw.view(np.float32)}, "a", options=treestore.SaveOptions(chunk_size=64 * 2**20))
    assert (raw.nbytes, os.cpu_count()) in asked
    assert len(store._storage.list("chunks")) == 1
    assert np.array_equal(store.load("a")["w"], raw.view(np.float32))
    assert np.array_equal(np.asarray(store.open("a")["w"]), raw.view(np.float32))
    assert treestore.verify(str(tmp_path / "store")).ok
    asked.clear()
    store.save({"w": raw.view(np.float32) + 1}, "b")
    assert {threads for size, threads in asked if size >= 2**20} == {1}


# --- 12.2: a bad object under a chunk's name ------------------------------------------------------
def _damage(url: str, path: str, how: str, size: int) -> None:
    """Put a bad object at ``path``: empty, or ``size`` bytes of garbage (the good one's size)."""
    bad = b"" if how == "empty" else np.random.default_rng(size).bytes(size)
    put_object(url, path, bad)


@pytest.mark.parametrize("how", ["empty", "garbage"])
def test_a_save_does_not_reuse_a_bad_chunk_object(store_url: str, how: str):
    data = chunked_tree(7, n=1_500_000)  # 6 MB: two chunks of the default 4 MiB, and a pack
    treestore.save(store_url, data, "first")
    chunks = chunk_objects(store_url)
    assert len(chunks) >= 3
    for path in chunks:
        _damage(store_url, path, how, len(get_object(store_url, path)))
    treestore.Store(store_url).delete("first")
    treestore.save(store_url, data, "again")
    assert_tree_equal(treestore.load(store_url, "again"), data)
    report = treestore.verify(store_url)
    assert report.ok, report.problems


@pytest.mark.parametrize("how", ["empty", "garbage"])
def test_copy_repairs_a_bad_chunk_object_at_the_destination(store_url: str, how: str):
    src = f"memory://treestore-tests/{uuid.uuid4().hex}"
    data = chunked_tree(8, n=1_500_000)
    treestore.save(src, data, "a")
    for path in chunk_objects(src):  # the destination holds bad objects under the same names
        _damage(store_url, path, how, len(get_object(src, path)))
    treestore.copy(f"{src}#a", store_url)
    assert_tree_equal(treestore.load(store_url, "a"), data)
    report = treestore.verify(store_url)
    assert report.ok, report.problems


@pytest.mark.timeout(60)
def test_an_array_written_to_during_a_save_never_makes_a_damaged_chunk(tmp_path: Path):
    """The loaded values may be any mix of the states the array went through; every chunk
    object must still hold the bytes its name promises."""
    url = str(tmp_path / "store")
    arr = np.zeros(2 * MiB + 123, np.float32)  # 8 MiB: three chunks
    stop = threading.Event()

    def scribble() -> None:
        k = 0.0
        while not stop.is_set():
            arr[:] = k
            k += 1.0

    writer = threading.Thread(target=scribble, daemon=True)
    writer.start()
    try:
        names = [f"s{i}" for i in range(6)]
        for name in names:
            treestore.save(url, {"w": arr}, name)
    finally:
        stop.set()
        writer.join()
    report = treestore.verify(url)
    corrupt = [p for p in report.problems if p.kind == "chunk_damaged"]
    assert corrupt == [], "\n".join(p.message for p in corrupt)
    for name in names:
        loaded = treestore.load(url, name)["w"]
        assert loaded.dtype == arr.dtype and loaded.shape == arr.shape


def _pack_headers(root: Path) -> list[tuple[int, int]]:
    """(codec, plane width) of every chunk object under ``root`` (all packs here)."""
    found = []
    for path in (root / "chunks").rglob("*"):
        if path.is_file():
            _, codec, width, _, _ = struct.unpack("<4sBBHQ", path.read_bytes()[:16])
            found.append((codec, width))
    return found


def test_a_pack_of_floats_of_one_width_is_stored_in_byte_planes(tmp_path: Path):
    """Small float32 leaves share packs whose elements all lie on 4-byte boundaries: a pack of
    them is split into byte planes as a float32 chunk is; a pack mixing widths is not. (Whole
    numbers, so that the pack compresses enough to be stored compressed at all.)"""
    rng = np.random.default_rng(5)
    floats = {
        f"w{i}": rng.integers(-99, 99, int(rng.integers(1, 2000))).astype(np.float32) for i in range(40)
    }
    mixed = {"a": np.arange(5, dtype=np.float32), "b": np.ones(7, np.float16), "c": np.arange(3)}
    for name, tree in (("floats", floats), ("mixed", mixed)):
        url = str(tmp_path / name)
        treestore.save(url, tree, "c")
        assert_tree_equal(treestore.load(url, "c"), tree)
        assert treestore.verify(url).ok
        headers = _pack_headers(tmp_path / name)
        if name == "floats":
            assert headers and all(h == (2, 4) for h in headers), headers
        else:
            assert [codec for codec, width in headers if width] == [], headers


def test_a_pack_is_compressed_only_when_that_pays(tmp_path: Path):
    """Random float32 weights shrink by a tenth at most: their pack is stored raw (so that a
    member can be read alone). Zeros shrink to almost nothing: their pack is compressed."""
    rng = np.random.default_rng(6)
    noise = {f"w{i}": rng.standard_normal(300).astype(np.float32) for i in range(20)}
    zeros = {f"w{i}": np.zeros(300, np.float32) + i for i in range(20)}
    for name, tree, raw in (("noise", noise, True), ("zeros", zeros, False)):
        treestore.save(str(tmp_path / name), tree, "c")
        headers = _pack_headers(tmp_path / name)
        assert len(headers) == 1 and (headers[0][0] == 0) is raw, (name, headers)
        assert_tree_equal(treestore.load(str(tmp_path / name), "c"), tree)


def test_one_leaf_of_a_raw_pack_reads_its_own_bytes_only(tmp_path: Path):
    """A small leaf read alone (whole or a slice of it) from a pack stored raw costs a read of
    its bytes, not of the pack."""
    rng = np.random.default_rng(7)
    tree = {f"w{i}": rng.standard_normal(100 + i).astype(np.float32) for i in range(30)}
    url = str(tmp_path / "s")
    treestore.save(url, tree, "c")
    ckpt = treestore.open(url, "c")
    np.testing.assert_array_equal(np.asarray(ckpt["w7"]), tree["w7"])
    assert ckpt.bytes_read == tree["w7"].nbytes
    np.testing.assert_array_equal(ckpt["w8"][3:9], tree["w8"][3:9])
    assert ckpt.bytes_read == tree["w7"].nbytes + tree["w8"].nbytes
    assert_tree_equal(treestore.load(url, "c"), tree)


def test_a_damaged_member_of_a_raw_pack_is_refused_by_address(tmp_path: Path):
    """The bytes of a member read alone are checked against its digest: a flipped byte in them
    fails that leaf's read with ChunkDamagedError naming its address (its neighbours still read),
    and so does a pack object cut short inside it."""
    rng = np.random.default_rng(8)
    tree = {f"w{i}": rng.standard_normal(64).astype(np.float32) for i in range(10)}
    url = str(tmp_path / "s")
    treestore.save(url, tree, "c")
    (obj,) = [p for p in (tmp_path / "s" / "chunks").rglob("*") if p.is_file()]
    data = bytearray(obj.read_bytes())
    offset = 16 + 256 * 3 + 5  # inside w3 (members in address order, 256 bytes each)
    data[offset] ^= 0xFF
    os.chmod(obj, 0o644)
    obj.write_bytes(bytes(data))
    ckpt = treestore.open(url, "c")
    with pytest.raises(ChunkDamagedError, match="w3"):
        np.asarray(ckpt["w3"])
    np.testing.assert_array_equal(np.asarray(ckpt["w4"]), tree["w4"])
    obj.write_bytes(bytes(data[: 16 + 256 * 9 + 100]))  # truncated inside w9, the last member
    ckpt = treestore.open(url, "c")
    with pytest.raises(ChunkDamagedError, match="w9"):
        np.asarray(ckpt["w9"])


@pytest.mark.parametrize("width", range(2, 9))
def test_without_the_compiled_part_planes_split_and_join_by_word_arithmetic_exactly(monkeypatch, width):
    """Without the compiled part, 2- and 4-byte elements are split into planes, and 2-byte ones joined
    again, by arithmetic on unsigned words; other widths keep numpy's copies. Either way the
    planes are exactly SPEC's, and every decoder (whole, in place) gives the bytes back."""
    import sys

    from treestore._format import codecs
    from treestore._kernels import planes

    monkeypatch.setattr(planes, "_COMPILED", None)
    assert planes.joined_fast(width) == (width == 2 and sys.byteorder == "little")
    rng = np.random.default_rng(width)
    n = 5000 * width  # not a multiple of the words' SIMD lanes
    raw = rng.integers(0, 256, n, dtype=np.uint8)
    raw[: n // 2] = 7  # compressible planes beside incompressible ones
    split = np.empty(n, np.uint8)
    planes.split_planes(raw, split, width)
    assert np.array_equal(split.reshape(width, -1), raw.reshape(-1, width).T)
    joined = np.empty(n, np.uint8)
    planes.join_planes(split, joined, width)
    assert np.array_equal(joined, raw)
    obj = b"".join(bytes(b) for b in codecs.encode(raw, width, codecs.Codec()))
    assert obj[4] == codecs.PLANES
    out = np.empty(n, np.uint8)
    codecs.decode_into(obj, out)
    assert np.array_equal(out, raw)
    room = np.zeros(codecs.in_place_room(n), np.uint8)
    room[: len(obj)] = np.frombuffer(obj, np.uint8)
    out[:] = 0
    codecs.decode_in_place(room, len(obj), out)
    assert np.array_equal(out, raw)
