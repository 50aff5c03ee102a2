"""Reading any box of an array leaf from the pieces and chunks that hold it.

A piece's elements are in C order, so the rows of a piece (its first axis) that a box touches are
one contiguous byte range: only the chunks overlapping that range are read and decoded.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from treestore._engine.reading.memory import allocate, allocate_many
from treestore._engine.reading.read import IN_PLACE_UP_TO, ChunkReader
from treestore._engine.threads import default_threads, run_all
from treestore._format.dtypes import dtype_from_name
from treestore._format.manifest.columns import DTYPE_NAMES, IN_PIECES, Columns
from treestore._format.manifest.records import ChunkRef
from treestore._kernels.scratch import scratch
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


@dataclass(frozen=True)
class LeafPieces:
    """The pieces of one array leaf, column-wise from its manifest's columns: each piece's box
    (``starts`` and ``ends``, one row of ndim ints each) and its chunk refs (rows ``first`` to
    ``first + count`` of ``columns.chunks``). A leaf saved whole is one piece covering it. No
    object is made per piece: a read makes a :class:`ChunkRef` only for the chunks it reads."""

    columns: Columns
    address: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    starts: np.ndarray  # int64 [P, ndim]
    ends: np.ndarray  # int64 [P, ndim]
    first: np.ndarray  # int64 [P]
    count: np.ndarray  # int64 [P]

    def chunks(self, p: int, start: int, stop: int) -> Iterator[tuple[ChunkRef, int, int]]:
        """The chunks of piece ``p`` that overlap its raw bytes [start, stop), each with the
        bytes [lo, hi) of the piece it holds."""
        first = int(self.first[p])
        raw = self.columns.chunks["raw"][first : first + int(self.count[p])]
        ends = np.cumsum(raw, dtype=np.int64)
        lo = int(np.searchsorted(ends, start, side="right"))  # the first chunk ending after start
        for j in range(lo, len(ends)):
            hi = int(ends[j])
            at = hi - int(raw[j])
            if at >= stop:
                break
            yield self.columns.chunk_ref(first + j), at, hi


def leaf_pieces(columns: Columns, i: int) -> LeafPieces:
    """The pieces of array leaf ``i`` of ``columns``."""
    address = columns.address(i)
    shape = columns.shape(i)
    dtype = dtype_from_name(DTYPE_NAMES[columns.leaves["dtype"][i]], address=address)
    if columns.leaves["flags"][i] & IN_PIECES:
        starts, shapes, first, count = columns.piece_rows(i)
        starts = starts.astype(np.int64)
        ends = starts + shapes.astype(np.int64)
    else:
        starts = np.zeros((1, len(shape)), np.int64)
        ends = np.array([shape], np.int64).reshape(1, len(shape))
        a, b = int(columns.chunk_start[i]), int(columns.chunk_start[i + 1])
        first, count = np.array([a], np.int64), np.array([b - a], np.int64)
    return LeafPieces(
        columns, address, shape, dtype, starts, ends, first.astype(np.int64), count.astype(np.int64)
    )


Chunks = Iterable[tuple[ChunkRef, int, int]]  # chunks of a piece, each with the bytes [lo, hi) it holds


def chunk_bytes(
    reader: ChunkReader,
    chunks: Chunks,
    start: int,
    stop: int,
    address: str,
    jobs: list[Callable[[], None]] | None = None,
    into: np.ndarray[Any, Any] | None = None,
) -> np.ndarray[Any, Any]:
    """Raw bytes [start, stop) of a piece, reading only ``chunks``, its chunks that overlap them.

    With ``jobs``, the chunk reads are appended as callables instead of run (the caller runs
    them, possibly in parallel, before using the result).
    ``into`` (uint8, stop - start bytes) receives the bytes instead of a new buffer.
    """
    out = allocate(max(stop - start, 0), address, reader.name) if into is None else into
    for c, lo, hi in chunks:
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


def _read_part(
    reader: ChunkReader, c: ChunkRef, address: str, target: np.ndarray[Any, Any], offset: int
) -> None:
    """Bytes [offset, offset + target.nbytes) of chunk ``c`` into ``target``: the whole chunk is
    decoded (its digest covers all of it) into a buffer of its raw size, then the part copied."""
    tmp = allocate(c.raw_size, address, reader.name)
    reader.read_leaf_chunk(c, tmp, address)
    target[:] = tmp[offset : offset + target.nbytes]


Meeting = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _meeting(pieces: LeafPieces, regions: Sequence[Region]) -> Meeting:
    """Where each region meets each piece: the (region, piece) pairs that overlap, the box
    [lo, hi) of each pair, and which pairs are exactly a piece. Array operations over every
    pair at once, not a Python step per pair."""
    ndim = len(pieces.shape)
    n = len(regions)
    lo_r = np.array([[r.start for r in region] for region in regions], np.int64).reshape(n, ndim)
    hi_r = np.array([[r.stop for r in region] for region in regions], np.int64).reshape(n, ndim)
    lo = np.maximum(lo_r[:, None, :], pieces.starts[None, :, :])
    hi = np.minimum(hi_r[:, None, :], pieces.ends[None, :, :])
    meets = np.all(lo < hi, axis=2)  # [regions, pieces]
    same = meets & np.all(lo_r[:, None, :] == pieces.starts[None], axis=2)
    same &= np.all(hi_r[:, None, :] == pieces.ends[None], axis=2)
    r, p = np.nonzero(meets)
    return r, p, lo[r, p], hi[r, p], same[r, p]


def plan_regions(
    reader: ChunkReader,
    pieces: LeafPieces,
    regions: Sequence[Region],
    outs: Sequence[np.ndarray[Any, Any]],
    jobs: list[Callable[[], None]],
    fills: list[Callable[[], None]],
    known: dict[Any, Meeting] | None = None,
    uses: Counter[bytes] | None = None,
) -> None:
    """Queue the reads (``jobs``, independent) and copies (``fills``, after all jobs) that put the
    elements of the leaf in each of ``regions`` into the matching ``outs`` (non-empty arrays).
    ``known`` keeps where regions meet pieces for leaves saved and restored alike (the usual
    case), worked out once. ``uses`` counts the reads queued of each chunk not in a pack, by
    digest (for :meth:`ChunkReader.expect`)."""
    if not regions:
        return
    key = (pieces.starts.shape, pieces.starts.tobytes(), pieces.ends.tobytes(), tuple(map(_bounds, regions)))
    found = None if known is None else known.get(key)
    if found is None:
        found = _meeting(pieces, regions)
        if known is not None:
            known[key] = found
    r, p, lo, hi, same = found
    rows = pieces.first[p]
    member = (pieces.count[p] == 1) & (pieces.columns.chunks["pack"][rows] >= 0)
    if _whole_first(pieces, p, member, same):
        # Small pieces in packs, cut across by the regions (restored onto another mesh): the
        # leaf is assembled once from its members and each region copied out of it.
        _queue_packs(reader, pieces, pieces.first, jobs)
        fills.append(functools.partial(_cut_from_whole, reader, pieces, regions, outs))
        return
    # A region that is exactly a piece held in one pack member (small shards restored onto the
    # sharding they were saved with): copied out of the decoded pack, all of a leaf's at once.
    exact = same & member
    if exact.any():
        _queue_packs(reader, pieces, rows[exact], jobs)
        into = [outs[k] for k in r[exact].tolist()]
        fills.append(
            functools.partial(copy_members, reader, pieces.columns, pieces.address, rows[exact], into)
        )
    rest = np.flatnonzero(~exact)
    for k, rk, pk in zip(rest.tolist(), r[rest].tolist(), p[rest].tolist(), strict=True):
        box = (lo[k].tolist(), hi[k].tolist())
        _plan_piece(reader, pieces, pk, regions[rk], *box, outs[rk], jobs, fills, uses)


def objects_met(pieces: LeafPieces, region: Region) -> set[tuple[str, Any]]:
    """The stored objects a read of ``region`` of the leaf fetches: ``("pack", index)`` for a
    chunk in a pack, ``("chunk", digest)`` for one of its own (the rows of each piece the region
    meets, as :func:`plan_regions` reads them)."""
    out: set[tuple[str, Any]] = set()
    _, p, lo, hi, _ = _meeting(pieces, [region])
    itemsize = pieces.dtype.itemsize
    for pk, a, b in zip(p.tolist(), lo.tolist(), hi.tolist(), strict=True):
        start, end = pieces.starts[pk].tolist(), pieces.ends[pk].tolist()
        row = math.prod(e - s for s, e in zip(start[1:], end[1:], strict=True)) * itemsize
        first, stop = ((a[0] - start[0]) * row, (b[0] - start[0]) * row) if a else (0, itemsize)
        for c, _, _ in pieces.chunks(pk, first, stop):
            out.add(("chunk", c.digest) if c.pack is None else ("pack", c.pack))
    return out


def _whole_first(pieces: LeafPieces, p: np.ndarray, member: np.ndarray, same: np.ndarray) -> bool:
    """Whether to assemble the leaf before cutting the regions from it: every piece is met by
    some region and is one pack member, some region is not a piece, and the leaf is small."""
    if same.all() or not member.all() or len(np.unique(p)) != len(pieces.first):
        return False
    return math.prod(pieces.shape) * pieces.dtype.itemsize <= WHOLE_UP_TO


def _bounds(region: Region) -> tuple[tuple[int, int], ...]:
    return tuple((r.start, r.stop) for r in region)


WHOLE_UP_TO = 64 * 2**20  # bytes of a leaf in packed pieces assembled whole to be cut up


def _queue_packs(
    reader: ChunkReader, pieces: LeafPieces, rows: np.ndarray, jobs: list[Callable[[], None]]
) -> None:
    """Queue the decoding of the packs holding chunk ref ``rows`` (each read once per reader)."""
    for pack in np.unique(pieces.columns.chunks["pack"][rows]).tolist():
        jobs.append(functools.partial(_decode_pack, reader, pack, pieces.address))


def _decode_pack(reader: ChunkReader, pack: int, address: str) -> None:
    reader.pack(pack, address)  # read and decoded once, kept by the reader; members checked on use


def _cut_from_whole(
    reader: ChunkReader, pieces: LeafPieces, regions: Sequence[Region], outs: Sequence[np.ndarray[Any, Any]]
) -> None:
    """The leaf (every piece one pack member) assembled, then each region copied out of it."""
    whole = allocate(pieces.shape, pieces.address, reader.name, pieces.dtype)
    boxes = [
        whole[tuple(slice(a, e) for a, e in zip(start, end, strict=True))]
        for start, end in zip(pieces.starts.tolist(), pieces.ends.tolist(), strict=True)
    ]
    copy_members(reader, pieces.columns, pieces.address, pieces.first, boxes)
    for region, out in zip(regions, outs, strict=True):
        out[...] = whole[region]


def copy_members(
    reader: ChunkReader,
    columns: Columns,
    address: str,
    rows: np.ndarray,
    outs: Sequence[np.ndarray[Any, Any]],
) -> None:
    """Chunk ref ``rows[k]`` of ``columns`` (each a pack member) verified and copied into
    ``outs[k]`` (an array, or a view of one, of that many bytes); the packs are decoded by the
    reader already or now. One member alone is read alone when its pack is stored raw."""
    refs = columns.chunks[rows]
    digests = refs["digest"].tobytes()
    if len(outs) == 1:
        pack, offset, size = (int(refs[name][0]) for name in ("pack", "offset", "raw"))
        alone = reader.member_alone(pack, offset, size, digests, address)
        _copy_member(reader, alone, offset, outs[0], digests, address)
        return
    packs: dict[int, np.ndarray[Any, Any]] = {}
    for k, (pack, offset, size, out) in enumerate(
        zip(refs["pack"].tolist(), refs["offset"].tolist(), refs["raw"].tolist(), outs, strict=True)
    ):
        digest = digests[32 * k : 32 * k + 32]
        buf = packs.get(pack)
        if buf is None:
            buf = packs[pack] = reader.pack(pack, address)
        part = reader.member(buf, offset, size, digest)
        if part is None:
            raise reader.mismatch(digest, address)
        _copy_member(reader, part, offset, out, digest, address)


def _copy_member(
    reader: ChunkReader,
    part: np.ndarray[Any, Any],
    offset: int,
    out: np.ndarray[Any, Any],
    chunk_digest: bytes,
    address: str,
) -> None:
    """A member's verified bytes ``part`` (at ``offset`` of its pack) copied into ``out``."""
    if out.nbytes != part.nbytes:
        raise reader.mismatch(chunk_digest, address)
    if offset % out.dtype.itemsize or not part.flags.aligned:  # not aligned for its dtype
        part = part.copy()
    out[...] = part.view(out.dtype).reshape(out.shape)


def _plan_piece(
    reader: ChunkReader,
    pieces: LeafPieces,
    p: int,
    region: Region,
    lo: list[int],
    hi: list[int],
    out: np.ndarray[Any, Any],
    jobs: list[Callable[[], None]],
    fills: list[Callable[[], None]],
    uses: Counter[bytes] | None = None,
) -> None:
    """Queue what puts the box [lo, hi) where piece ``p`` meets ``region`` into ``out`` (each
    chunk read counted in ``uses``)."""
    dtype, address = out.dtype, pieces.address

    def chunks(start: int, stop: int) -> Chunks:
        found = list(pieces.chunks(p, start, stop))
        if uses is not None:
            uses.update(c.digest for c, _, _ in found if c.pack is None)
        return found

    if not lo:  # a 0-d leaf
        data = chunk_bytes(reader, chunks(0, dtype.itemsize), 0, dtype.itemsize, address, jobs)
        fills.append(functools.partial(_fill, out, (), data, dtype, ()))
        return
    start, end = pieces.starts[p].tolist(), pieces.ends[p].tolist()
    row_shape = tuple(e - a for a, e in zip(start[1:], end[1:], strict=True))
    row = math.prod(row_shape) * dtype.itemsize
    r0, r1 = lo[0] - start[0], hi[0] - start[0]
    whole_rows = all(
        r.start == a and r.stop == e for r, a, e in zip(region[1:], start[1:], end[1:], strict=True)
    )
    if whole_rows and out.flags.c_contiguous:
        # The region's rows are whole rows of this piece (a device shard cut along the first
        # axis, or the whole piece): those rows are one byte range of the result, so the
        # chunks decode straight into it.
        at = (lo[0] - region[0].start) * row
        into = out.reshape(-1).view(np.uint8)[at : at + (r1 - r0) * row]
        chunk_bytes(reader, chunks(r0 * row, r1 * row), r0 * row, r1 * row, address, jobs, into)
        return
    inner = tuple(slice(x - a, y - a) for x, y, a in zip(lo[1:], hi[1:], start[1:], strict=True))
    dst = tuple(slice(x - r.start, y - r.start) for x, y, r in zip(lo, hi, region, strict=True))
    cut = _Cut(out, dst, inner, dtype, row_shape, r0)
    _plan_cut(reader, chunks(r0 * row, r1 * row), r0 * row, r1 * row, address, cut, jobs, fills)


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
    chunks: Chunks,
    start: int,
    stop: int,
    address: str,
    cut: _Cut,
    jobs: list[Callable[[], None]],
    fills: list[Callable[[], None]],
) -> None:
    """Queue the reads that put bytes [start, stop) of a piece (whole rows; ``chunks``, those of
    its chunks that overlap them) where ``cut``
    says: each chunk is decoded and verified in its thread's scratch and its whole rows copied
    into the result at once; a row split between two chunks is gathered in a row buffer and
    copied by ``fills``. No buffer of the piece's size is made."""
    row = cut.row
    edges: dict[int, np.ndarray[Any, Any]] = {}  # piece row -> its bytes, gathered from chunks
    for c, lo, hi in chunks:
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
    reader: ChunkReader, pieces: LeafPieces, region: Region, threads: int = 0
) -> np.ndarray[Any, Any]:
    """The elements of the leaf in ``region`` (normalized), as a new C-ordered array.

    The chunks it needs are read, decoded and verified concurrently on ``threads`` of the
    process's reading threads (0: :func:`default_threads`), decoded straight into the result
    when the region is a whole piece. A leaf packed with others is copied out of its pack (or
    its own bytes of it, :meth:`ChunkReader.member_alone`), with nothing to plan or hand to
    another thread.
    """
    first = int(pieces.first[0])
    if len(pieces.first) == 1 and pieces.count[0] == 1 and pieces.columns.chunks["pack"][first] >= 0:
        out = allocate(pieces.shape, pieces.address, reader.name, pieces.dtype)
        copy_members(reader, pieces.columns, pieces.address, np.array([first]), [out])
        whole = all(r.start == 0 and r.stop == dim for r, dim in zip(region, pieces.shape, strict=True))
        return out if whole else out[region].copy()
    return read_many(reader, [(pieces, [region])], threads)[0][0]


def read_many(
    reader: ChunkReader, wanted: Sequence[tuple[LeafPieces, list[Region]]], threads: int = 0
) -> list[list[np.ndarray[Any, Any]]]:
    """:func:`read_region` of each region of several leaves (their device shards), all their
    chunks read and decoded concurrently: a leaf's few chunks alone would leave the reading
    threads waiting on the caller."""
    jobs: list[Callable[[], None]] = []
    fills: list[Callable[[], None]] = []
    results = []
    known: dict[Any, Meeting] = {}
    uses: Counter[bytes] = Counter()
    for pieces, regions in wanted:
        shapes = [tuple(r.stop - r.start for r in region) for region in regions]
        outs = allocate_many(shapes, pieces.address, reader.name, pieces.dtype)
        filled = [k for k, out in enumerate(outs) if out.size]
        plan_regions(
            reader, pieces, [regions[k] for k in filled], [outs[k] for k in filled], jobs, fills, known, uses
        )
        results.append(outs)
    # A chunk that several regions meet (a leaf saved whole, restored onto several devices) is
    # fetched and decoded once, not once per region.
    reader.expect({d: n for d, n in uses.items() if n > 1})
    # The copies run in this thread once every chunk is decoded, as a load's do: most are small
    # (a pack member per device shard, its digest checked), work that holds the GIL, so the
    # reading threads only took turns at it, spending several times the CPU one thread does
    # (profiled on the 64-device restores of docs/benchmarks.md, "Restoring onto many devices").
    run_in_threads(jobs, threads or default_threads())
    for fill in fills:
        fill()
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
