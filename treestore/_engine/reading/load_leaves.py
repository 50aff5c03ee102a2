"""Whole leaves, many at once, planned from a manifest's columns: what a load reads.

Small leaves packed together are served one pack at a time: the pack is read and decoded once,
and each member becomes a view of the decoded pack, verified against its own digest — no
per-leaf allocation, copy or leaf entry. Members are disjoint, so no two leaves
share memory (one that overlaps another, which only a hand-made manifest holds, is copied).
A leaf with chunks of its own gets one job per chunk, decoding straight into the leaf's array; a
leaf saved in pieces is assembled piece by piece (from the columns when its pieces are packed,
else by :mod:`treestore._engine.reading.region`).
Reading and decoding run in parallel; the Python work on decoded packs runs after, in the
caller's thread, where it does not fight the decoding threads for the GIL.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

from treestore._engine.reading import memory
from treestore._engine.reading.read import ChunkReader
from treestore._engine.reading.region import copy_members, leaf_pieces, plan_regions, run_in_threads
from treestore._format.dtypes import dtype_from_name
from treestore._format.manifest.columns import ARRAY_CODES, DTYPE_NAMES, IN_PIECES, Columns

Arrays = dict[int, np.ndarray[Any, Any]]


def read_leaves(
    reader: ChunkReader,
    columns: Columns,
    which: np.ndarray,
    *,
    threads: int,
    allocate: Callable[..., np.ndarray[Any, Any]] = memory.allocate,
) -> Arrays:
    """The host arrays of the array leaves among leaf indices ``which``, by leaf index, every
    byte verified against its digest (scalar leaves, which live in the manifest, are skipped).
    The leaves with chunks of their own are read into arrays that ``allocate`` makes (with the
    signature of :func:`treestore._engine.reading.memory.allocate`); packed leaves are views of their
    decoded packs."""
    which = np.asarray(which, np.int64)
    rows = columns.leaves[which]
    which, rows = which[rows["kind"] < ARRAY_CODES], rows[rows["kind"] < ARRAY_CODES]
    first = columns.chunk_start[which]
    single = rows["chunks"] == 1
    pack = np.full(len(which), -1, np.int64)
    pack[single] = columns.chunks["pack"][first[single]]
    member = (pack >= 0) & ((rows["flags"] & IN_PIECES) == 0)
    out: Arrays = {}
    jobs: list[Callable[[], None]] = []  # reading and decoding: in parallel
    fills: list[Callable[[], None]] = []
    assemble: list[Callable[[], None]] = []  # Python work on decoded packs: in this thread
    needed: dict[int, int] = {}  # the packs to read, each with a leaf that needs it
    for i in which[~member].tolist():  # leaves with chunks of their own, or in pieces
        boxes = columns.piece_rows(i) if columns.leaves["flags"][i] & IN_PIECES else None
        if boxes is not None and _packed(columns, boxes):
            dtype = dtype_from_name(DTYPE_NAMES[columns.leaves["dtype"][i]])
            address = columns.address(i)
            out[i] = allocate(columns.shape(i), address, reader.name, dtype)
            for p in np.unique(columns.chunks["pack"][boxes[2]]).tolist():
                needed.setdefault(p, i)
            assemble.append(functools.partial(_read_packed_pieces, reader, columns, boxes, out[i], address))
            continue
        pieces = leaf_pieces(columns, i)
        out[i] = allocate(pieces.shape, pieces.address, reader.name, pieces.dtype)
        plan_regions(reader, pieces, [tuple(slice(0, n) for n in pieces.shape)], [out[i]], jobs, fills)
    order = np.argsort(pack[member], kind="stable")
    members, packs = which[member][order], pack[member][order]
    bounds = np.flatnonzero(np.diff(packs, prepend=-1, append=-1)).tolist()
    for lo, hi in itertools.pairwise(bounds):
        needed.setdefault(int(packs[lo]), int(members[lo]))
        assemble.append(functools.partial(_read_pack, reader, columns, int(packs[lo]), members[lo:hi], out))
    jobs += [functools.partial(_decoded, reader, p, columns.address(i)) for p, i in needed.items()]
    run_in_threads(jobs, threads)
    for job in assemble + fills:
        job()
    return out


def _decoded(reader: ChunkReader, pack: int, address: str) -> None:
    reader.pack(pack, address)  # read and decoded once, kept by the reader; members checked on use


def _read_pack(reader: ChunkReader, columns: Columns, pack: int, leaves: np.ndarray, out: Arrays) -> None:
    """Leaves ``leaves`` (each one chunk, all in pack ``pack``) as views of the decoded pack."""
    refs = columns.chunks[columns.chunk_start[leaves]]
    digests = refs["digest"].tobytes()
    codes = columns.leaves["dtype"][leaves]
    dtypes = {int(code): dtype_from_name(DTYPE_NAMES[code]) for code in np.unique(codes).tolist()}
    buf = reader.pack(pack, columns.address(int(leaves[0])))
    shared = _overlapping(refs["offset"], refs["raw"]).tolist()
    for j, (i, code, offset, size) in enumerate(
        zip(leaves.tolist(), codes.tolist(), refs["offset"].tolist(), refs["raw"].tolist(), strict=True)
    ):
        chunk_digest = digests[32 * j : 32 * j + 32]
        part = reader.member(buf, offset, size, chunk_digest)
        if part is None:
            raise reader.mismatch(chunk_digest, columns.address(i))
        out[i] = _typed(part.copy() if shared[j] else part, offset, dtypes[code]).reshape(columns.shape(i))


def _overlapping(offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Which byte ranges ``[offset, offset + size)`` overlap one that starts before them (or at
    the same place, earlier in the list). A save never writes such members, but a manifest may
    name one member for two leaves: those get a copy, so that no two loaded leaves share memory."""
    starts = offsets.astype(np.int64)
    order = np.argsort(starts, kind="stable")
    reach = np.maximum.accumulate(starts[order] + sizes.astype(np.int64)[order])
    out = np.zeros(len(starts), bool)
    out[order[1:]] = starts[order[1:]] < reach[:-1]
    return out


def _typed(part: np.ndarray[Any, Any], offset: int, dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    """Bytes at ``offset`` of a decoded pack as ``dtype``: a view, or a copy when they are not
    aligned for it."""
    return (part if offset % dtype.itemsize == 0 else part.copy()).view(dtype)


Pieces = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # Columns.piece_rows of one leaf


def _packed(columns: Columns, pieces: Pieces) -> bool:
    """Whether every one of a leaf's pieces is one chunk inside a pack (small shards)."""
    _, _, first, count = pieces
    return bool(np.all(count == 1)) and bool(np.all(columns.chunks["pack"][first] >= 0))


def _read_packed_pieces(
    reader: ChunkReader, columns: Columns, pieces: Pieces, out: np.ndarray[Any, Any], address: str
) -> None:
    """A leaf saved in pieces that are each one chunk inside a pack, assembled into ``out``."""
    starts, shapes, first, _ = pieces
    boxes = [
        out[tuple(slice(a, a + n) for a, n in zip(start, shape, strict=True))]
        for start, shape in zip(starts.tolist(), shapes.tolist(), strict=True)
    ]
    copy_members(reader, columns, address, first, boxes)
