"""Reading any box of an array leaf from the pieces and chunks that hold it.

A piece's elements are in C order, so the rows of a piece (its first axis) that a box touches are
one contiguous byte range: only the chunks overlapping that range are read and decoded.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from treestore._engine.read import IN_PLACE_UP_TO, ChunkReader, allocate
from treestore._engine.threads import default_threads, run_all
from treestore._format.codecs import scratch
from treestore._format.dtypes import dtype_from_name
from treestore._format.manifest import ChunkRef, LeafEntry, Piece
from treestore.errors import OutOfBoundsError

Region = tuple[slice, ...]


def normalize(region: Any, shape: tuple[int, ...], address: str) -> Region:
    """A tuple of unit-step slices with concrete bounds, one per dimension."""
    items = tuple(region) if isinstance(region, tuple) else (region,)
    items = items + (slice(None),) * (len(shape) - len(items))
    out = []
    for item, dim in zip(items, shape, strict=True):
        start, stop, step = item.indices(dim)
        if step != 1:
            raise OutOfBoundsError(f"{address}: regions are unit-step slices, got {item}", address=address)
        out.append(slice(start, max(start, stop)))
    return tuple(out)


def piece_bytes(
    reader: ChunkReader,
    piece: Piece,
    start: int,
    stop: int,
    address: str,
    jobs: list[Callable[[], None]] | None = None,
    into: np.ndarray[Any, Any] | None = None,
) -> np.ndarray[Any, Any]:
    """Raw bytes [start, stop) of one piece, reading only the chunks that overlap them.

    With ``jobs``, the chunk reads are appended as callables instead of run (the caller runs
    them, possibly in parallel, before using the result).
    ``into`` (uint8, stop - start bytes) receives the bytes instead of a new buffer.
    """
    out = allocate(max(stop - start, 0), address, reader.name) if into is None else into
    for c, lo, hi in _overlapping(piece, start, stop):
        if start <= lo and hi <= stop:
            target = out[lo - start : hi - start]
            if jobs is None:
                reader.read_leaf_chunk(c, target, address)
            else:
                jobs.append(functools.partial(reader.read_leaf_chunk, c, target, address))
        else:
            a, b = max(lo, start), min(hi, stop)
            job = functools.partial(_read_part, reader, c, address, out[a - start : b - start], a - lo)
            if jobs is None:
                job()
            else:
                jobs.append(job)
    return out


def _overlapping(piece: Piece, start: int, stop: int) -> Iterator[tuple[ChunkRef, int, int]]:
    """The chunks of ``piece`` that overlap its bytes [start, stop), each with the bytes
    [lo, hi) of the piece it holds."""
    at = 0
    for c in piece.chunks:
        lo, hi = at, at + c.raw_size
        at = hi
        if lo < stop and hi > start:
            yield c, lo, hi


def _read_part(
    reader: ChunkReader, c: ChunkRef, address: str, target: np.ndarray[Any, Any], offset: int
) -> None:
    """Bytes [offset, offset + target.nbytes) of chunk ``c`` into ``target``: the whole chunk is
    decoded (its digest covers all of it) into a buffer of its raw size, then the part copied."""
    tmp = allocate(c.raw_size, address, reader.name)
    reader.read_leaf_chunk(c, tmp, address)
    target[:] = tmp[offset : offset + target.nbytes]


def plan_region(
    reader: ChunkReader,
    entry: LeafEntry,
    region: Region,
    out: np.ndarray[Any, Any],
    jobs: list[Callable[[], None]],
    fills: list[Callable[[], None]],
) -> None:
    """Queue the reads (``jobs``, independent) and copies (``fills``, after all jobs) that put the
    elements of ``entry`` in ``region`` into ``out``."""
    dtype = out.dtype
    for piece in entry.layout:
        inter = [
            slice(max(r.start, a), min(r.stop, a + n))
            for r, a, n in zip(region, piece.start, piece.shape, strict=True)
        ]
        if any(s.start >= s.stop for s in inter):
            continue
        if not piece.shape:  # a 0-d leaf
            data = piece_bytes(reader, piece, 0, dtype.itemsize, entry.address, jobs)
            fills.append(functools.partial(_fill, out, (), data, dtype, ()))
            continue
        row = math.prod(piece.shape[1:]) * dtype.itemsize
        r0, r1 = inter[0].start - piece.start[0], inter[0].stop - piece.start[0]
        whole_rows = all(
            r.start == a and r.stop == a + n
            for r, a, n in zip(region[1:], piece.start[1:], piece.shape[1:], strict=True)
        )
        if whole_rows and out.flags.c_contiguous:
            # The region's rows are whole rows of this piece (a device shard cut along the first
            # axis, or the whole piece): those rows are one byte range of the result, so the
            # chunks decode straight into it.
            at = (inter[0].start - region[0].start) * row
            into = out.reshape(-1).view(np.uint8)[at : at + (r1 - r0) * row]
            piece_bytes(reader, piece, r0 * row, r1 * row, entry.address, jobs, into=into)
            continue
        inner = tuple(slice(s.start - a, s.stop - a) for s, a in zip(inter[1:], piece.start[1:], strict=True))
        dst = tuple(slice(s.start - r.start, s.stop - r.start) for s, r in zip(inter, region, strict=True))
        cut = _Cut(out, dst, inner, dtype, piece.shape[1:], r0)
        _plan_cut(reader, piece, r0 * row, r1 * row, entry.address, cut, jobs, fills)


@dataclass(frozen=True)
class _Cut:
    """Where the rows of a piece go when a region cuts across them (a leaf sharded along a later
    axis, restored onto other devices): row ``first + k`` of the piece, ``inner`` taken of its
    other axes, is row ``dst[0].start + k`` of ``out[dst]``."""

    out: np.ndarray[Any, Any]
    dst: tuple[slice, ...]
    inner: tuple[slice, ...]
    dtype: np.dtype[Any]
    row_shape: tuple[int, ...]
    first: int

    @property
    def row(self) -> int:
        return math.prod(self.row_shape) * self.dtype.itemsize

    def place(self, rows: np.ndarray[Any, Any], at: int) -> None:
        """Put whole piece rows (their bytes, from piece row ``at``) where they go in ``out``."""
        n = rows.nbytes // self.row
        k = at - self.first + self.dst[0].start
        block = rows.view(self.dtype).reshape((n, *self.row_shape))[(slice(None), *self.inner)]
        self.out[(slice(k, k + n), *self.dst[1:])] = block


def _plan_cut(
    reader: ChunkReader,
    piece: Piece,
    start: int,
    stop: int,
    address: str,
    cut: _Cut,
    jobs: list[Callable[[], None]],
    fills: list[Callable[[], None]],
) -> None:
    """Queue the reads that put bytes [start, stop) of ``piece`` (whole rows) where ``cut``
    says: each chunk is decoded and verified in its thread's scratch and its whole rows copied
    into the result at once; a row split between two chunks is gathered in a row buffer and
    copied by ``fills``. No buffer of the piece's size is made."""
    row = cut.row
    edges: dict[int, np.ndarray[Any, Any]] = {}  # piece row -> its bytes, gathered from chunks
    for c, lo, hi in _overlapping(piece, start, stop):
        for edge in {max(lo, start) // row, (min(hi, stop) - 1) // row}:
            if not (lo <= edge * row and (edge + 1) * row <= hi) and edge not in edges:
                edges[edge] = allocate(row, address, reader.name)
        jobs.append(functools.partial(_decode_cut, reader, c, lo, start, stop, address, cut, edges))
    for edge, buf in edges.items():
        fills.append(functools.partial(cut.place, buf, edge))


def _decode_cut(
    reader: ChunkReader,
    c: ChunkRef,
    lo: int,
    start: int,
    stop: int,
    address: str,
    cut: _Cut,
    edges: dict[int, np.ndarray[Any, Any]],
) -> None:
    """Chunk ``c`` (bytes [lo, lo + raw size) of its piece) decoded into this thread's scratch,
    its whole rows within [start, stop) placed, and the parts of split rows kept in ``edges``."""
    # Scratch up to the size a chunk read in place uses (read.IN_PLACE_UP_TO): what a hostile
    # manifest declares beyond that is allocated, with its memory check, only for this chunk.
    if c.raw_size <= IN_PLACE_UP_TO:
        buf = scratch(c.raw_size, "cut")
    else:
        buf = allocate(c.raw_size, address, reader.name)
    reader.read_leaf_chunk(c, buf, address)
    row = cut.row
    a, b = max(lo, start), min(lo + c.raw_size, stop)
    first, end = -(-a // row), b // row  # the rows wholly in this chunk
    if first < end:
        cut.place(buf[first * row - lo : end * row - lo], first)
    for edge in {a // row, (b - 1) // row}:  # the parts of split rows this chunk holds
        into = edges.get(edge)
        if into is not None:
            x, y = max(a, edge * row), min(b, (edge + 1) * row)
            into[x - edge * row : y - edge * row] = buf[x - lo : y - lo]


def read_region(
    reader: ChunkReader, entry: LeafEntry, region: Region, threads: int = 0
) -> np.ndarray[Any, Any]:
    """The elements of ``entry`` in ``region`` (normalized), as a new C-ordered array.

    The chunks it needs are read, decoded and verified concurrently on ``threads`` of the
    process's reading threads (0: :func:`default_threads`), decoded straight into the result
    when the region is a whole piece.
    """
    return read_many(reader, [(entry, [region])], threads)[0][0]


def read_many(
    reader: ChunkReader, wanted: Sequence[tuple[LeafEntry, list[Region]]], threads: int = 0
) -> list[list[np.ndarray[Any, Any]]]:
    """:func:`read_region` of each region of several leaves (their device shards), all their
    chunks read and decoded concurrently: a leaf's few chunks alone would leave the reading
    threads waiting on the caller."""
    jobs: list[Callable[[], None]] = []
    fills: list[Callable[[], None]] = []
    results = []
    for entry, regions in wanted:
        assert entry.shape is not None
        dtype = dtype_from_name(entry.dtype, address=entry.address)
        outs = []
        for region in regions:
            out = allocate(tuple(r.stop - r.start for r in region), entry.address, reader.name, dtype)
            if out.size:
                plan_region(reader, entry, region, out, jobs, fills)
            outs.append(out)
        results.append(outs)
    # The copies write disjoint parts of the results (pieces tile their leaf): they run
    # concurrently too, once every chunk is decoded (numpy releases the GIL while it copies).
    for step in (jobs, fills):
        run_in_threads(step, threads or default_threads())
    return results


def _fill(
    out: np.ndarray[Any, Any],
    dst: Any,
    data: np.ndarray[Any, Any],
    dtype: np.dtype[Any],
    shape: tuple[int, ...],
    src: Any = (),
) -> None:
    out[dst] = data.view(dtype).reshape(shape)[src]


def run_in_threads(jobs: list[Callable[[], None]], threads: int) -> None:
    """Run jobs in the process's pool of ``threads`` reading threads."""
    run_all(jobs, threads, "read")
