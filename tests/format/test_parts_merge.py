"""Multi-process saves, their columnar parts and the primary's vectorised merge.

Jobs of threads stand in for the processes of a jax.distributed job (tests/support/jobs.py); the real
two-process job is tests/system/test_distributed.py.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import tracemalloc
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import msgpack
import numpy as np
import pytest

import treestore
from tests.support.helpers import in_use
from tests.support.jobs import prepared, rows, run_job
from tests.support.records import Hand
from treestore._api.checkpoint import Checkpoint
from treestore._engine import locks as _locks
from treestore._engine.commit import commit
from treestore._engine.group import distributed as D
from treestore._engine.group import group_wait
from treestore._engine.group.group_runtime import LocalRuntime
from treestore._engine.reading import parts as parts_module
from treestore._engine.reading.committed import (
    read_columns,
    read_commit_record,
    read_frame,
    read_manifest_bytes,
)
from treestore._engine.reading.parts import UNREAD_PART, complete
from treestore._engine.write import SaveOptions, SaveResult
from treestore._format.manifest import frame as frame_module
from treestore._format.manifest.codec import decode_any, decode_columns, encode, encode_columns
from treestore._format.manifest.columns import CHUNK_DTYPE
from treestore._format.manifest.frame import Frame, ListedPart
from treestore._format.manifest.leaf_table import LeafTable, ref_of
from treestore._format.manifest.record_views import Manifest, leaf_entry
from treestore._format.manifest.records import ChunkRef, LeafEntry, Piece
from treestore._format.parts.merge import frame_leaves_from_fields, frame_of
from treestore._format.parts.part import decode_part, encode_part, leaf_range, part_from_fields
from treestore._format.paths import manifest_path
from treestore._kernels.digest import digest
from treestore._storage.registry import open_storage
from treestore._tree.leaves import ArrayLeaf
from treestore._tree.prepare import prepare
from treestore.errors import (
    BarrierTimeoutError,
    ChunkDamagedError,
    InvalidInputError,
    ManifestDamagedError,
    OutOfMemoryError,
    StorageError,
    StructureMismatchError,
)


def tree_of() -> dict[str, Any]:
    rng = np.random.default_rng(7)
    return {
        "big": rng.standard_normal((256, 256)).astype(np.float32),  # 64 KiB pieces: chunked
        "grid": rng.standard_normal((64, 48)).astype(np.float32),  # a 2 × 2 grid of packed pieces
        "odd": np.arange(48, dtype=np.int64).reshape(12, 4),  # irregular owners, out of order
        "whole": np.full((8, 8), 3, np.int16),  # one process owns all of it
        "v": np.arange(16, dtype=np.int32),
        "replicated": np.eye(3),
        "step": 7,
        "label": "run",
    }


BOXES = {
    "big": rows(256, 4, 256),
    "grid": [[((r * 32, c * 24), (32, 24))] for r in (0, 1) for c in (0, 1)],
    "odd": [[((8, 0), (4, 4)), ((0, 0), (4, 4))], [], [((4, 0), (4, 4))], []],
    "whole": [[], [], [], [((0, 0), (8, 8))]],
    "v": rows(16, 4),
}
OPTIONS = SaveOptions(chunk_size=16384, small_leaf=4096, threads=2)


def job(boxes: dict[str, Any] = BOXES, count: int = 4) -> list[Any]:
    tree = tree_of()
    return [prepared(tree, boxes, i) for i in range(count)]


class Spied:
    """A storage whose writes to one path can be changed (``damage``) or delayed, and whose
    lock writes are timed."""

    def __init__(self, storage: Any) -> None:
        self._storage = storage
        self.damage: dict[str, Any] = {}  # path suffix -> bytes -> bytes (None: do not write)
        self.delay: dict[str, float] = {}  # path suffix -> seconds to wait before writing
        self.delayed: list[float] = []  # when each delay began
        self.refuse_lock_of: str | None = None  # the thread whose save lock cannot be written
        self.lock_writes: list[tuple[float, str]] = []
        self.delay_of: dict[str, float] = {}  # thread -> seconds to wait before writing its part
        self.reads: list[str] = []  # every path read

    def read_range(self, path: str, start: int, end: int) -> Any:
        self.reads.append(path)
        return self._storage.read_range(path, start, end)

    def read(self, path: str, **kwargs: Any) -> Any:
        self.reads.append(path)
        return self._storage.read(path, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._storage, name)

    def write(self, path: str, buffers: Any) -> None:
        if path.startswith("locks/save-"):
            self.lock_writes.append((time.monotonic(), threading.current_thread().name))
            if threading.current_thread().name == self.refuse_lock_of:
                raise StorageError(f"writing {path} failed: PermissionError: disk on fire")
        for suffix, seconds in self.delay.items():
            if path.endswith(suffix):
                self.delayed.append(time.monotonic())
                time.sleep(seconds)
        seconds = self.delay_of.get(threading.current_thread().name, 0.0)
        if seconds and path.startswith("manifests/"):
            self.delayed.append(time.monotonic())
            time.sleep(seconds)
        for suffix, change in self.damage.items():
            if path.endswith(suffix):
                data = change(b"".join(bytes(b) for b in buffers))
                if data is None:
                    return
                buffers = [data]
        self._storage.write(path, buffers)


def test_a_job_of_threads_saves_one_checkpoint_every_layout(store_url):
    runtime = LocalRuntime(4)
    results = run_job(open_storage(store_url), job(), "job", runtime=runtime, options=OPTIONS)
    assert all(isinstance(r, SaveResult) for r in results), results
    assert results[0].leaves == 8 and results[0].nbytes == sum(
        v.nbytes for v in tree_of().values() if isinstance(v, np.ndarray)
    )
    store = treestore.Store(store_url)
    out = store.load("job")
    for key, value in tree_of().items():
        assert np.array_equal(out[key], value) if isinstance(value, np.ndarray) else out[key] == value, key
    by = {e.address: e for e in store.manifest("job").leaves}
    assert [p.start for p in by["grid"].pieces] == [(0, 0), (0, 24), (32, 0), (32, 24)]
    assert [p.start for p in by["odd"].pieces] == [(0, 0), (4, 0), (8, 0)]  # sorted by start
    assert all(len(p.chunks) == 4 for p in by["big"].pieces)  # 64 KiB in 16 KiB chunks
    assert {c.pack for p in by["v"].pieces for c in p.chunks} == {1, 2, 3, 4}  # after the frame's pack
    assert not by["whole"].pieces and len(by["whole"].chunks) == 1  # one piece, all of it
    assert store._storage.list("staging") == [] and store._storage.list("locks") == []
    assert runtime.items("treestore/") == {}  # the runtime keeps nothing of the save


def test_every_process_trusts_the_previous_checkpoints_chunks(store_url):
    """A second save of the same tree by the job sends no existence check from any process: each
    learns the newest checkpoint's chunks under its own lock."""
    storage = open_storage(in_use(store_url))
    first = run_job(storage, job(), "one", options=OPTIONS)
    again = run_job(storage, job(), "two", options=OPTIONS)
    assert all(isinstance(r, SaveResult) for r in first + again), first + again
    assert sum(r.existence_checks for r in first) > 0
    assert [(r.existence_checks, r.chunks_written, r.trusted_from) for r in again] == [(0, 0, "one")] * 4
    assert sum(r.chunks_trusted for r in again) == sum(r.chunks_written + r.chunks_reused for r in first)
    assert treestore.verify(f"{store_url}#two").ok


def _refs(rng: np.random.Generator, packs: list[ChunkRef], nbytes: int) -> tuple[ChunkRef, ...]:
    """A piece's chunk refs: inside one of ``packs`` (small ones, at times), else 1 to 3 chunks."""
    if packs and nbytes < 4096 and rng.random() < 0.5:
        return (ChunkRef(rng.bytes(32), nbytes, 0, int(rng.integers(len(packs))), 0),)
    cut = np.unique(np.r_[0, rng.integers(0, nbytes + 1, int(rng.integers(0, 3))), nbytes]).tolist()
    return tuple(ChunkRef(rng.bytes(32), b - a, b - a + 16) for a, b in itertools.pairwise(cut))


def _grid(rng: np.random.Generator, ndim: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The boxes of a random grid over a leaf of shape (6,) * ndim."""
    cuts = [np.unique(np.r_[0, rng.integers(1, 6, int(rng.integers(0, 3))), 6]).tolist() for _ in range(ndim)]
    return [
        (
            tuple(c[j] for c, j in zip(cuts, at, strict=True)),
            tuple(c[j + 1] - c[j] for c, j in zip(cuts, at, strict=True)),
        )
        for at in np.ndindex(*[len(c) - 1 for c in cuts])
    ]


def _plain(entry: LeafEntry) -> LeafEntry:
    """A leaf in one piece covering all of it, as one process stores it: a plain leaf."""
    if len(entry.pieces) == 1 and entry.pieces[0].shape == entry.shape:
        return replace(entry, pieces=())
    return entry


def _written(
    where: dict[str, int], entries: list[LeafEntry], packs: list[ChunkRef]
) -> tuple[dict[str, Any], np.ndarray]:
    """What a process that wrote ``entries`` holds (its table's manifest arrays, each row's leaf
    index): a leaf in one piece stays a piece, as a process of a multi-process save keeps it."""
    table = LeafTable(pieces_kept=True)
    for e in entries:
        pieces = [(p.start, p.shape, len(p.chunks)) for p in e.pieces] if e.pieces else None
        refs = [ref_of(c) for c in e.chunks]
        assert e.dtype is not None and e.shape is not None
        table.array(
            e.kind, e.dtype, e.shape, e.prng_impl, e.weak_type, refs, pieces, e.address, where[e.address]
        )
    return table.fields(packs), np.array(table.index, np.int64)


def _random_job(
    rng: np.random.Generator,
) -> tuple[Hand, list[list[LeafEntry]], list[list[ChunkRef]], list[bool]]:
    """A checkpoint saved by a job of 1 to 5 processes: the manifest one process would write
    (pieces sorted by start, each process's packs after the earlier ones'), and what each
    process holds: its leaf entries (the primary's: every leaf) and its packs."""
    count = int(rng.integers(1, 6))
    packs = [
        [ChunkRef(rng.bytes(32), 1 << 20, 1000) for _ in range(int(rng.integers(0, 3)))] for _ in range(count)
    ]
    bases = np.cumsum([0] + [len(p) for p in packs]).tolist()
    entries: list[LeafEntry] = []
    owned: list[list[LeafEntry]] = [[] for _ in range(count)]
    sharded: list[bool] = []
    for i in range(int(rng.integers(1, 8))):
        address = f"l{i}"
        sharded.append(rng.random() > 0.25)
        if not sharded[-1]:
            entries.append(LeafEntry(address, "numpy", "float32", (16,), _refs(rng, packs[0], 64)))
            owned[0].append(entries[-1])
            continue
        ndim = int(rng.integers(1, 4))
        pieces: list[list[Piece]] = [[] for _ in range(count)]
        for start, shape in _grid(rng, ndim):
            k = int(rng.integers(count))
            pieces[k].append(Piece(start, shape, _refs(rng, packs[k], 4 * int(np.prod(shape)))))
        merged = []
        for k in range(count):
            rng.shuffle(pieces[k])  # in any order: the merge sorts them
            chunks = tuple(c for p in pieces[k] for c in p.chunks)
            owned[k].append(
                LeafEntry(address, "numpy", "float32", (6,) * ndim, chunks, pieces=tuple(pieces[k]))
            )
            moved = [Piece(p.start, p.shape, tuple(_moved(c, bases[k]) for c in p.chunks)) for p in pieces[k]]
            merged += moved
        merged.sort(key=lambda p: p.start)
        chunks = tuple(c for p in merged for c in p.chunks)
        entries.append(
            _plain(LeafEntry(address, "numpy", "float32", (6,) * ndim, chunks, pieces=tuple(merged)))
        )
    tree = {
        "type": "dict",
        "keys": [["dict", e.address] for e in entries],
        "children": [{"type": "leaf", "leaf": j} for j in range(len(entries))],
    }
    manifest = Hand("m", 1.5, tree, tuple(entries), tuple(p for ps in packs for p in ps), {"n": count})
    return manifest, owned, packs, sharded


def _moved(ref: ChunkRef, base: int) -> ChunkRef:
    return ref if ref.pack is None else ChunkRef(ref.digest, ref.raw_size, 0, ref.pack + base, ref.offset)


def _resolved(m: Manifest | Hand, leaves: Sequence[LeafEntry] | None = None, packs: Any = None) -> list[Any]:
    """Each leaf of ``m`` (or ``leaves``, whose chunk refs index ``packs``) with every chunk
    ref's pack named by its digest, not its index."""
    packs = m.packs if packs is None else packs

    def ref(c: ChunkRef) -> tuple[Any, ...]:
        pack = None if c.pack is None else packs[c.pack].digest
        return (c.digest, c.raw_size, c.stored_size if pack is None else 0, pack, c.offset)

    return [
        (
            e.address,
            e.shape,
            [ref(c) for c in e.chunks],
            [(p.start, p.shape, [ref(c) for c in p.chunks]) for p in e.pieces],
        )
        for e in (m.leaves if leaves is None else leaves)
    ]


def test_a_reader_merges_the_parts_into_the_manifest_one_process_would_write():
    """Random tilings, owners, orders, chunk counts and packs: the frame the primary commits and
    every process's part, encoded and decoded as a reader decodes them, merge into the manifest
    one process would write (packs renumbered: the frame's first, then each part's)."""
    rng = np.random.default_rng(3)
    for trial in range(40):
        manifest, owned, packs, sharded = _random_job(rng)
        where = {e.address: j for j, e in enumerate(manifest.leaves)}
        layout = b"L" * 32
        shares = [part_from_fields(*_written(where, owned[k], packs[k]))[0] for k in range(len(owned))]
        parts = [encode_part(share, layout) for share in shares]
        addresses = [e.address for e in manifest.leaves]
        frame_leaves = frame_leaves_from_fields(
            manifest.tree, addresses.__getitem__, _written(where, owned[0], packs[0])[0], sharded
        )
        header = {"name": "m", "created": 1.5, "metadata": manifest.metadata, "codec": {}, "chunk_size": 0}
        refs = [ListedPart(digest(p), len(p), *leaf_range(s)) for p, s in zip(parts, shares, strict=True)]
        frame = frame_of(frame_leaves, header, layout, refs)
        decoded = decode_columns(encode_columns(frame), "m")
        assert isinstance(decoded, Frame) and decoded.parts == frame.parts
        columns, problems = complete(decoded, [decode_part(p, layout) for p in parts])
        assert columns is not None and not problems, problems
        assert _resolved(Manifest(columns)) == _resolved(manifest), trial
        encode(columns)  # what readers accept
        # A reader of some leaves, given only the parts it needs, gets those leaves exactly.
        chosen = rng.random(len(manifest.leaves)) < 0.3
        needed = set(decoded.needed(chosen).tolist())
        for k, share in enumerate(shares):  # a part not needed holds no piece of a chosen leaf
            assert k in needed or not chosen[share.piece_leaves].any()
        given = [decode_part(p, layout) if k in needed else UNREAD_PART for k, p in enumerate(parts)]
        some, problems = complete(decoded, given, chosen)
        assert some is not None and not problems, problems
        assert some.parts == tuple(refs[k].digest for k in sorted(needed))  # those it was given
        rows = np.flatnonzero(chosen).tolist()
        picked = [leaf_entry(some, i) for i in rows]
        assert _resolved(manifest, picked, some.pack_refs()) == [_resolved(manifest)[i] for i in rows], trial
        for i in np.flatnonzero(~chosen & np.array(sharded)).tolist():
            assert some.unread[i]
            with pytest.raises(RuntimeError, match="parts not read"):
                leaf_entry(some, i)


def overlapping() -> dict[str, Any]:
    boxes = dict(BOXES)
    boxes["v"] = [[((0,), (4,))], [((4,), (4,))], [((4,), (4,))], [((12,), (4,))]]  # 8..12 missing
    return boxes


def missing() -> dict[str, Any]:
    boxes = dict(BOXES)
    boxes["v"] = [[((0,), (4,))], [((4,), (4,))], [((8,), (4,))], []]
    return boxes


OVERLAP = "leaf v: pieces from processes 1 and 2 overlap: at (4,) of shape (4,) and at (4,)"
MISSING = (
    "leaf v: its pieces cover 12 of its 16 elements: processes 0, 1, 2 sent pieces of it, process 3 sent none"
)


@pytest.mark.parametrize(("boxes", "expected"), [(overlapping(), OVERLAP), (missing(), MISSING)])
def test_pieces_that_do_not_tile_a_leaf_name_it_and_the_processes(store_url, boxes, expected):
    store = treestore.Store(store_url)
    store.save({"earlier": np.arange(3)}, "earlier")
    runtime = LocalRuntime(4)
    results = run_job(store._storage, job(boxes), "job", runtime=runtime, options=OPTIONS)
    assert isinstance(results[0], InvalidInputError) and expected in str(results[0]), results[0]
    assert results[0].address == "v"
    for r in results[1:]:  # the others learn it from the outcome
        assert isinstance(r, StorageError) and expected in str(r), r
    assert [c.name for c in store.list()] == ["earlier"]
    assert store._storage.list("locks") == [] and runtime.items("treestore/") == {}


def test_a_piece_outside_its_leaf_names_the_process(store_url):
    tree = {"v": np.arange(16, dtype=np.int32)}

    def process(i: int) -> Any:
        start = (4 * i,) if i < 3 else (14,)  # process 3 claims 4 elements from 14 of 16

        def leaf(address: str, value: Any) -> ArrayLeaf:
            part = np.arange(4, dtype=np.int32)
            return ArrayLeaf("numpy", "int32", None, pieces=((start, part),), global_shape=(16,))

        return prepare(tree, leaf=leaf)

    results = run_job(open_storage(store_url), [process(i) for i in range(4)], "job")
    assert isinstance(results[0], InvalidInputError), results[0]
    assert "leaf v: a piece from process 3 at (14,) of shape (4,) lies outside its shape (16,)" in str(
        results[0]
    )
    assert treestore.Store(store_url).list() == []


def _record(data: bytes, change: Any) -> bytes:
    rec = msgpack.unpackb(data, raw=False)
    change(rec)
    return msgpack.packb(rec, use_bin_type=True)


def _filled(column: bytes, value: int) -> bytes:
    """A u4 column of the same length, every entry ``value``."""
    return np.full(len(column) // 4, value, "<u4").tobytes()


def _set(**fields: Any) -> Any:
    return lambda data: _record(data, lambda rec: rec.update(fields))


class Told(LocalRuntime):
    """A job's runtime in which what process 1 tells the primary of its share is changed."""

    def __init__(self, count: int, change: Any) -> None:
        super().__init__(count)
        self.change = change

    def set(self, key: str, value: str) -> None:
        if key.endswith("/summary/1"):
            value = self.change(value)
            if value is None:
                return
        super().set(key, value)


def _told(**fields: Any) -> Any:
    return lambda text: json.dumps({**json.loads(text), **fields})


SUMMARIES = {
    "not JSON": (lambda text: "{not json", "its summary is not valid JSON"),
    "not a map": (lambda text: "[1, 2]", "its summary is malformed"),
    "ok is not a bool": (_told(ok=1), "its summary is malformed"),
    "another tree": (_told(layout="00" * 32), "it saved another tree than the primary"),
    "no part": (_told(part=None), "it wrote no part"),
    "a short digest": (_told(part="ab"), "its summary is malformed"),
    "a negative count": (_told(pieces=-1), "its summary is malformed"),
    "a part over its limit": (_told(size=2**28 + 1), "its summary is malformed"),
    "a fingerprint out of range": (_told(cover="f" * 32), "its summary is malformed"),
    "no leaf range": (_told(leaves=None), "its summary is malformed"),
    "a leaf range that is not one": (_told(leaves=[3, 2]), "its summary is malformed"),
    "pieces in no leaf": (_told(leaves=[0, 0]), "its summary is malformed"),
    "leaves beyond the tree": (_told(leaves=[0, 9]), "its pieces lie in leaves up to 9, beyond the tree's 8"),
    "a failure": (lambda text: json.dumps({"ok": False, "error": "disk on fire"}), "process 1: disk on fire"),
    "no summary at all": (lambda text: None, "it sent no summary of its part"),
}


@pytest.mark.parametrize("attack", sorted(SUMMARIES))
def test_a_bad_summary_fails_the_save_naming_its_process(store_url, attack):
    change, expected = SUMMARIES[attack]
    runtime = Told(4, change)
    results = run_job(open_storage(store_url), job(), "job", runtime=runtime, options=OPTIONS)
    assert isinstance(results[0], StorageError), results[0]
    assert "process 1: " in str(results[0]) and expected in str(results[0]), str(results[0])
    assert all(isinstance(r, StorageError) for r in results[1:]), results
    assert treestore.Store(store_url).list() == []


def test_a_wrong_fingerprint_is_caught_and_explained(store_url):
    """A process whose fingerprint is wrong while its pieces are right: the primary reads the
    parts to explain, finds them sound, and commits nothing."""
    runtime = Told(4, _told(cover="1" * 32))
    results = run_job(open_storage(store_url), job(), "job", runtime=runtime, options=OPTIONS)
    assert isinstance(results[0], StorageError), results[0]
    assert "coverage fingerprints say their pieces do not tile the sharded leaves" in str(results[0])
    assert treestore.Store(store_url).list() == []


def test_the_primary_commits_without_reading_a_part(store_url):
    """The commit checks the pieces from the processes' fingerprints: no part is read, and the
    manifest lists every process's part."""
    storage = Spied(open_storage(store_url))
    results = run_job(storage, job(), "job", options=OPTIONS)
    assert all(isinstance(r, SaveResult) for r in results), results
    store = treestore.Store(store_url)
    record = read_commit_record(store._storage, "job")
    frame = decode_any(read_manifest_bytes(store._storage, record), "job")
    assert isinstance(frame, Frame) and len(frame.parts) == 4
    assert not {manifest_path(p.digest) for p in frame.parts} & set(storage.reads)
    assert read_columns(store._storage, record).parts == tuple(p.digest for p in frame.parts)


def test_a_reader_of_some_leaves_reads_only_the_parts_holding_them(store_url):
    """Process 3 alone holds "whole" (leaf 7; the others hold pieces of leaves 0 to 6): reading
    it reads part 3 and no other; reading "big", held by all, reads the rest, each part once."""
    saved(store_url)
    storage = Spied(open_storage(store_url))
    frame = read_frame(storage, read_commit_record(storage, "job"))
    assert isinstance(frame, Frame)
    assert [(p.first, p.end) for p in frame.parts] == [(0, 7), (0, 7), (0, 7), (0, 8)]
    parts = [manifest_path(p.digest) for p in frame.parts]
    ckpt = Checkpoint(storage, frame)
    assert not set(parts) & set(storage.reads)  # opening reads the frame alone
    np.testing.assert_array_equal(ckpt["replicated"].read(), tree_of()["replicated"])  # no part
    assert not set(parts) & set(storage.reads)
    before = ckpt.bytes_read
    np.testing.assert_array_equal(ckpt["whole"][2:], tree_of()["whole"][2:])
    assert [p for p in parts if p in storage.reads] == [parts[3]]
    assert ckpt.bytes_read > before  # counted by the reader of the leaf's columns
    np.testing.assert_array_equal(np.asarray(ckpt["big"]), tree_of()["big"])
    assert [storage.reads.count(p) for p in parts] == [1, 1, 1, 1]  # part 3 was kept
    store = treestore.Store(store_url)
    store._storage = storage = Spied(store._storage)
    np.testing.assert_array_equal(store.load("job", select="whole")["whole"], tree_of()["whole"])
    assert [p for p in parts if p in storage.reads] == [parts[3]]
    like = {"whole": np.zeros((8, 8), np.int16)}
    for options in ({"select": "whole", "partial": True}, {"partial": True}):  # flax's params-only restore
        restored = store.load("job", like=like, **options)
        np.testing.assert_array_equal(restored["whole"], tree_of()["whole"])
    restored = store.load("job", like=np.zeros((8, 8), np.int16), prefix="whole")
    np.testing.assert_array_equal(restored, tree_of()["whole"])
    assert [p for p in parts if p in storage.reads] == [parts[3]]
    # A template that is not partial is matched against every leaf: every part is read.
    like = {k: np.zeros_like(v) if isinstance(v, np.ndarray) else v for k, v in tree_of().items()}
    with pytest.raises(StructureMismatchError, match="replicated: unexpected"):
        store.load("job", like={k: v for k, v in like.items() if k != "replicated"})
    restored = store.load("job", like=like)
    np.testing.assert_array_equal(restored["big"], tree_of()["big"])
    assert all(p in storage.reads for p in parts)


def test_a_view_read_leaf_by_leaf_merges_each_set_of_parts_once(store_url, monkeypatch):
    """A leaf's parts complete every leaf they alone hold: reading "big" (in every part)
    completes every sharded leaf, so the view's other leaves need no merge; reading "whole"
    (part 3 alone) completes it alone."""
    saved(store_url)
    merges = []
    merge = parts_module.merge
    monkeypatch.setattr(parts_module, "merge", lambda *a, **k: merges.append(1) or merge(*a, **k))
    ckpt = treestore.open(store_url + "#job")
    np.testing.assert_array_equal(np.asarray(ckpt["whole"]), tree_of()["whole"])
    assert len(merges) == 1
    for address in ("big", "grid", "odd", "v"):
        np.testing.assert_array_equal(np.asarray(ckpt[address]), tree_of()[address])
    assert len(merges) == 2


def test_a_frame_that_lists_a_part_s_leaves_wrongly_is_refused(store_url):
    """Part 1 holds pieces of leaves 0 to 6; a frame saying 1 to 7 hides its piece of "big"
    (leaf 0). A reader of every leaf refuses the part, and a reader of "big" alone, which skips
    it, finds the leaf's pieces do not cover it: both refuse the checkpoint."""
    saved(store_url)
    storage = open_storage(store_url)
    record = read_commit_record(storage, "job")
    frame = decode_any(read_manifest_bytes(storage, record), "job")
    assert isinstance(frame, Frame)
    parts = list(frame.parts)
    parts[1] = parts[1]._replace(first=1)
    commit(storage, encode_columns(replace(frame, parts=tuple(parts))), frame.columns, overwrite=True)
    with pytest.raises(
        ManifestDamagedError, match=r"process 1: .*a piece lies outside the leaves its frame lists"
    ):
        treestore.load(store_url, "job")
    for read in (
        lambda: treestore.load(store_url, "job", select="big"),
        lambda: treestore.open(store_url + "#job")["big"],
    ):
        with pytest.raises(ManifestDamagedError, match=r"leaf big: .*process"):
            read()
    np.testing.assert_array_equal(
        treestore.load(store_url, "job", select="whole")["whole"], tree_of()["whole"]
    )


def saved(store_url: str) -> None:
    """The job's checkpoint "job", saved in parts."""
    results = run_job(open_storage(store_url), job(), "job", options=OPTIONS)
    assert all(isinstance(r, SaveResult) for r in results), results


def _reparted(store_url: str, name: str, k: int, change: Any, *, keep_digest: bool = False) -> None:
    """Replace part ``k`` of checkpoint ``name`` with ``change(its bytes)`` (None: remove it),
    under its new digest with the manifest and commit record rewritten to match, or
    (``keep_digest``) under its old name."""
    storage = open_storage(store_url)
    record = read_commit_record(storage, name)
    frame = decode_any(read_manifest_bytes(storage, record), name)
    assert isinstance(frame, Frame)
    found = frame.parts[k].digest
    data = change(storage.read(manifest_path(found)))
    if data is None:
        storage.delete(manifest_path(found))
        return
    if keep_digest:
        storage.write(manifest_path(found), [data])
        return
    storage.write(manifest_path(digest(data)), [data])
    parts = list(frame.parts)
    parts[k] = parts[k]._replace(digest=digest(data), size=len(data))
    commit(storage, encode_columns(replace(frame, parts=tuple(parts))), frame.columns, overwrite=True)


def _moved_piece(data: bytes) -> bytes:
    """Part 1 with its first piece of leaf v moved onto process 2's (4..8 → 8..12)."""

    def change(rec: dict[str, Any]) -> None:
        leaves = np.frombuffer(rec["piece_leaves"], "<u4")
        v = 6  # big, grid, label, odd, replicated, step, v, whole: v is 1-d, the others 2-d
        at = sum(1 if j == v else 2 for j in leaves[: int(np.flatnonzero(leaves == v)[0])].tolist())
        start = np.frombuffer(rec["piece_start"], "<u8").copy()
        start[at] = 8
        rec["piece_start"] = start.tobytes()

    return _record(data, change)


PARTS = {
    "garbage": (lambda data: b"\xc1 not msgpack", "it is not valid msgpack"),
    "not a map": (lambda data: msgpack.packb([1, 2]), "it is not a map"),
    "trailing bytes": (lambda data: data + b"\x00", "not valid msgpack"),
    "another format": (_set(format="treestore.manifest"), "expected 'treestore.part'"),
    "another tree": (_set(layout=b"\x00" * 32), "its layout differs"),
    "no layout": (lambda data: _record(data, lambda rec: rec.pop("layout")), "missing field 'layout'"),
    "a torn chunk table": (
        lambda data: _record(data, lambda rec: rec.update(chunks=rec["chunks"][:-1])),
        "field 'chunks' holds",
    ),
    "a leaf beyond the tree": (
        _set(piece_leaves=np.full(2, 10**6, "<u4").tobytes(), piece_chunks=np.ones(2, "<u4").tobytes()),
        "a piece names a leaf beyond the tree's 8",
    ),
    "a leaf that is not sharded": (
        lambda data: _record(data, lambda rec: rec.update(piece_leaves=_filled(rec["piece_leaves"], 5))),
        "it holds a piece of a leaf that is not sharded",  # leaf 5, "step", is a scalar
    ),
    "boxes of the wrong size": (
        lambda data: _record(data, lambda rec: rec.update(piece_start=rec["piece_start"][:-8])),
        "its piece boxes do not match its pieces",
    ),
    "chunk counts that do not add up": (
        lambda data: _record(data, lambda rec: rec.update(piece_chunks=_filled(rec["piece_chunks"], 0))),
        "its pieces do not list its chunk refs",
    ),
    "a pack index out of range": (
        lambda data: _record(data, lambda rec: rec.update(packs=b"")),
        "a pack index is out of range",
    ),
    "pieces that overlap": (_moved_piece, "leaf v: pieces from processes 1 and 2 overlap"),
}  # fmt: skip


@pytest.mark.parametrize("attack", sorted(PARTS))
def test_a_hostile_part_is_refused_by_readers_naming_its_process(store_url, attack):
    change, expected = PARTS[attack]
    saved(store_url)
    _reparted(store_url, "job", 1, change)
    store = treestore.Store(store_url)
    leaf = "v" if attack == "pieces that overlap" else "big"  # each process holds a piece of it
    reads = (
        lambda: store.load("job"),
        lambda: store.load("job", select=leaf),
        lambda: store.open("job")[leaf],
        lambda: store.open("job").manifest,
        lambda: store.manifest("job"),
    )
    for read in reads:
        with pytest.raises(ManifestDamagedError) as caught:
            read()
        assert "is stored in parts" in str(caught.value) and expected in str(caught.value), str(caught.value)
        if attack != "pieces that overlap":
            assert "process 1: " in str(caught.value)
    assert not treestore.verify(store_url).ok
    # Process 3 alone holds "whole": its readers read its part only, never process 1's.
    np.testing.assert_array_equal(store.load("job", select="whole")["whole"], tree_of()["whole"])
    np.testing.assert_array_equal(np.asarray(store.open("job")["whole"]), tree_of()["whole"])


def _packed_digest_flipped(data: bytes) -> bytes:
    """A part whose first packed piece names bytes its pack does not hold."""

    def change(rec: dict[str, Any]) -> None:
        chunks = np.frombuffer(rec["chunks"], CHUNK_DTYPE).copy()
        at = int(np.flatnonzero(chunks["pack"] >= 0)[0])
        flipped = bytearray(chunks["digest"][at].tobytes())
        flipped[0] ^= 1
        chunks["digest"][at] = np.void(bytes(flipped))
        rec["chunks"] = chunks.tobytes()

    return _record(data, change)


def test_a_packed_piece_a_load_refuses_is_not_copied(store_url):
    """A part's packed piece that does not match its pack fails a load; copy refuses it too,
    naming the leaf, and commits nothing."""
    saved(store_url)
    _reparted(store_url, "job", 1, _packed_digest_flipped)
    with pytest.raises(ChunkDamagedError):
        treestore.load(store_url, "job")
    dst = f"memory://treestore-tests/copy-{time.monotonic_ns()}"
    with pytest.raises(ChunkDamagedError) as caught:
        treestore.copy(f"{store_url}#job", dst)
    assert caught.value.checkpoint == "job" and caught.value.address
    assert "nothing was committed" in str(caught.value)
    assert treestore.Store(dst).list() == []


def test_a_part_of_many_small_pieces_beside_a_deep_leaf_is_refused_in_bounded_memory(store_url):
    """A 3.6 MB part adds 150,000 one-element pieces to a 1-d leaf of a checkpoint that also has
    a sharded leaf of rank 32. Padding every box to the widest rank to sort them took 170 MiB;
    a reader refuses the part within memory proportional to its size."""
    z, o = (0,) * 31, (1,) * 31
    tree = {"v": np.arange(16, dtype=np.int32), "deep": np.arange(2.0).reshape((2, *o))}
    boxes = {"v": rows(16, 4), "deep": [[((0, *z), (1, *o))], [((1, *z), (1, *o))], [], []]}
    run_job(open_storage(store_url), [prepared(tree, boxes, i) for i in range(4)], "job", options=OPTIONS)
    extra = 150_000

    def grow(rec: dict[str, Any]) -> None:
        rec["piece_leaves"] += np.full(extra, 1, "<u4").tobytes()  # leaf 1 is "v" ("deep" sorts first)
        rec["piece_chunks"] += np.zeros(extra, "<u4").tobytes()
        rec["piece_start"] += np.zeros(extra, "<u8").tobytes()
        rec["piece_shape"] += np.ones(extra, "<u8").tobytes()

    _reparted(store_url, "job", 1, lambda data: _record(data, grow))
    tracemalloc.start()
    try:
        with pytest.raises(ManifestDamagedError, match=r"leaf v: .*pieces"):
            treestore.load(store_url, "job")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, f"{peak / 2**20:.0f} MiB"


@pytest.mark.parametrize("damage", ["missing", "changed", "grown"])
def test_a_part_missing_or_changed_is_refused_by_readers(store_url, damage):
    saved(store_url)
    flipped = {
        "missing": lambda d: None,
        "changed": lambda d: d[:-1] + bytes([d[-1] ^ 1]),
        "grown": lambda d: d + b"x",
    }
    change = flipped[damage]
    _reparted(store_url, "job", 2, change, keep_digest=True)
    with pytest.raises(ManifestDamagedError) as caught:
        treestore.load(store_url, "job")
    expected = "is missing" if damage == "missing" else "does not match its digest"
    assert "process 2: its part" in str(caught.value) and expected in str(caught.value), str(caught.value)


def test_a_part_over_its_limit_is_not_read(store_url, monkeypatch):
    saved(store_url)
    monkeypatch.setattr(frame_module, "MAX_PART_BYTES", 100)  # smaller than every part
    with pytest.raises(ManifestDamagedError) as caught:
        treestore.load(store_url, "job")
    assert "a part has a 32-byte digest or a size outside [0, 100]" in str(caught.value), str(caught.value)


@pytest.mark.parametrize(
    ("raised", "expected", "message"),
    [
        (MemoryError(), OutOfMemoryError, "out of memory merging its parts"),
        (ValueError("a bound the checks missed"), ManifestDamagedError, "unexpected malformation"),
    ],
)
def test_a_merge_that_fails_unexpectedly_is_a_treestore_error(
    store_url, monkeypatch, raised, expected, message
):
    """Running out of memory while merging parts, or a check the merge missed: readers raise the
    TreestoreError that says so, naming the checkpoint."""
    saved(store_url)

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise raised

    monkeypatch.setattr(parts_module, "merge", failing)
    for read in (lambda: treestore.load(store_url, "job"), lambda: treestore.open(store_url + "#job")["big"]):
        with pytest.raises(expected, match=message) as caught:
            read()
        assert caught.value.checkpoint == "job" and "'job'" in str(caught.value)


def test_a_share_over_the_limit_is_refused_by_its_own_process(store_url, monkeypatch):
    monkeypatch.setattr(D, "MAX_PART_BYTES", 600)
    results = run_job(open_storage(store_url), job(), "job", options=OPTIONS)
    refused = [r for r in results if "over the 600 bytes a part may hold" in str(r)]
    assert refused and all(isinstance(r, StorageError) for r in results), results
    assert treestore.Store(store_url).list() == []


def test_a_failing_process_fails_every_process_naming_it(store_url):
    store = treestore.Store(store_url)
    storage = Spied(store._storage)
    storage.refuse_lock_of = "process-2"
    results = run_job(storage, job(), "job", options=OPTIONS)
    assert isinstance(results[2], StorageError) and "disk on fire" in str(results[2])
    assert isinstance(results[0], StorageError)
    assert "process 2: StorageError: writing locks/save-" in str(results[0]), results[0]
    for r in results[1:]:
        assert isinstance(r, StorageError) and "disk on fire" in str(r), r
    assert store.list() == [] and store._storage.list("locks") == []


def test_a_process_that_never_arrives_is_named_when_the_others_give_up(store_url, monkeypatch):
    monkeypatch.setenv("TREESTORE_BARRIER_TIMEOUT", "1")
    trees: list[Any] = job(count=4)
    trees[2] = None  # process 2 never saves
    started = time.monotonic()
    results = run_job(open_storage(store_url), trees, "job", options=OPTIONS)
    assert time.monotonic() - started < 30
    for i in (0, 1, 3):
        r = results[i]
        assert isinstance(r, BarrierTimeoutError) and r.missing == (2,), r
        assert "barrier 'written': process 2 (of 4) did not arrive within 1 s" in str(r), r
        assert "nothing was committed" in str(r)
    store = treestore.Store(store_url)
    assert store.list() == [] and store._storage.list("locks") == []


def test_followers_name_a_primary_that_never_starts(store_url, monkeypatch):
    monkeypatch.setenv("TREESTORE_BARRIER_TIMEOUT", "0.5")
    trees: list[Any] = job(count=4)
    trees[0] = None
    results = run_job(open_storage(store_url), trees, "job", options=OPTIONS)
    for r in results[1:]:
        assert isinstance(r, BarrierTimeoutError) and r.missing == (0,), r
        assert "the primary (process 0) did not start it within 0.5 s" in str(r), r
    assert treestore.Store(store_url).list() == []


def test_waiting_processes_keep_their_save_locks_fresh(store_url, monkeypatch):
    """A process that waits long for the others rewrites its save lock as a save rewrites it
    between leaves, so gc never mistakes a save in flight for an abandoned one."""
    monkeypatch.setattr(group_wait, "KEEP_FRESH", 0.02)
    monkeypatch.setattr(_locks, "STALE_AFTER", 0.2)  # a lock is rewritten after 0.05 s
    storage = Spied(open_storage(store_url))
    storage.delay_of["process-2"] = 2.0  # process 2 is slow to share its pieces
    results = run_job(storage, job(), "job", options=OPTIONS)
    assert all(isinstance(r, SaveResult) for r in results), results
    (began,) = storage.delayed
    unread = {name.split()[0] for t, name in storage.lock_writes if began + 1.0 < t < began + 1.9}
    assert {"process-0", "process-1", "process-3"} <= unread, storage.lock_writes


def test_a_job_of_one_process_saves_through_the_group_path(store_url):
    results = run_job(open_storage(store_url), [prepared(tree_of(), {"v": [[((0,), (16,))]]}, 0)], "one")
    assert isinstance(results[0], SaveResult) and results[0].leaves == 8
    assert np.array_equal(treestore.load(store_url, "one")["v"], np.arange(16, dtype=np.int32))


def test_gc_keeps_the_parts_of_a_checkpoint_until_it_is_deleted(store_url):
    saved(store_url)
    store = treestore.Store(store_url)
    frame = decode_any(read_manifest_bytes(store._storage, read_commit_record(store._storage, "job")), "job")
    assert isinstance(frame, Frame)
    paths = [manifest_path(p.digest) for p in frame.parts]
    store.save({"x": np.arange(3)}, "other")
    store.gc(grace=0)
    assert all(store._storage.read(p) is not None for p in paths)
    assert treestore.verify(store_url).ok and np.array_equal(store.load("job")["v"], tree_of()["v"])
    store.delete("job")
    report = store.gc(grace=0)
    assert all(store._storage.read(p) is None for p in paths)
    assert report.manifests_removed == 1 + len(paths)  # the frame and its parts
    assert treestore.verify(store_url).ok


def test_a_sharded_leaf_with_no_elements_is_checked_by_merging(store_url):
    """Pieces of a leaf with no elements weigh nothing in the coverage fingerprint: the primary
    merges the parts to check them instead, and commits what readers accept."""
    tree = {"e": np.zeros((0, 4), np.float32), "v": np.arange(16, dtype=np.int32)}
    boxes = {"e": [[((0, 0), (0, 4))], [], [], []], "v": rows(16, 4)}
    results = run_job(open_storage(store_url), [prepared(tree, boxes, i) for i in range(4)], "job")
    assert all(isinstance(r, SaveResult) for r in results), results
    out = treestore.load(store_url, "job")
    assert out["e"].shape == (0, 4) and np.array_equal(out["v"], tree["v"])
    boxes["e"] = [[], [], [], []]  # no process holds a piece of it: readers would refuse it
    results = run_job(open_storage(store_url), [prepared(tree, boxes, i) for i in range(4)], "none")
    assert isinstance(results[0], InvalidInputError) and "leaf e: " in str(results[0]), results[0]
    assert [c.name for c in treestore.Store(store_url).list()] == ["job"]


def test_an_empty_piece_outside_its_leaf_is_caught(store_url):
    """A piece with no elements has no weight, so a process marks one outside its leaf in its
    fingerprint: the primary merges, names the leaf and commits nothing."""
    tree = {"v": np.arange(16, dtype=np.int32)}
    boxes = {"v": [*rows(16, 4)[:3], [((12,), (4,)), ((20,), (0,))]]}
    results = run_job(open_storage(store_url), [prepared(tree, boxes, i) for i in range(4)], "job")
    assert isinstance(results[0], InvalidInputError), results[0]
    assert "leaf v: a piece from process 3 at (20,) of shape (0,) lies outside its shape (16,)" in str(
        results[0]
    )
    assert treestore.Store(store_url).list() == []


def test_parts_over_their_total_limit_are_refused_by_the_primary(store_url, monkeypatch):
    monkeypatch.setattr(D, "MAX_PARTS_BYTES", 1000)
    results = run_job(open_storage(store_url), job(), "job", options=OPTIONS)
    assert isinstance(results[0], InvalidInputError), results[0]
    assert "over the 1000 bytes readers accept" in str(results[0])
    assert treestore.Store(store_url).list() == []


def test_a_frame_whose_parts_are_over_their_total_limit_is_not_read(store_url, monkeypatch):
    saved(store_url)
    monkeypatch.setattr(frame_module, "MAX_PARTS_BYTES", 1000)
    with pytest.raises(ManifestDamagedError, match="over the limit of 1000"):
        treestore.load(store_url, "job")
