"""The merge of a manifest's frame and every process's part into one version-2 manifest, with
numpy alone (SPEC.md, section 8.7).

The frame says what every leaf is (:class:`FrameLeaves`: the primary's, from its leaf entries when it
commits, or a reader's, from a decoded frame); the parts are concatenated (process 0's first) and
checked together (:func:`gather`); pack indices are renumbered (each part's packs follow the
frame's and the earlier parts'), pieces are ordered by leaf and then by start, each leaf's chunk
refs are placed among the frame's own leaves', and the resulting columns are checked exactly as
readers check a manifest (:func:`treestore._format.manifest.codec.columns_from_fields`). No piece
becomes a Python object: the work grows with the number of pieces only through vectorised
operations.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from treestore._format.manifest.codec import columns_from_fields, stored_values
from treestore._format.manifest.columns import (
    CHUNK_DTYPE,
    IN_PIECES,
    Columns,
    concat_ranges,
    prefix_sums,
)
from treestore._format.manifest.frame import Frame, ListedPart
from treestore._format.parts.explain import Pieces, explain
from treestore._format.parts.part import Part
from treestore.errors import InvalidInputError

PACK_INDEX_END = 2**31  # pack indices are i4 in a manifest
_REF_WORDS = CHUNK_DTYPE.itemsize // 4  # a chunk ref as u4 words: digest, raw, stored, pack, offset
_PACK_WORD = _REF_WORDS - 2
assert CHUNK_DTYPE.names is not None and CHUNK_DTYPE.names[-2:] == ("pack", "offset")


def _words(table: np.ndarray) -> np.ndarray:
    """CHUNK_DTYPE records as rows of u4 words: numpy copies and gathers those far faster."""
    return table.view("<u4").reshape(-1, _REF_WORDS)


@dataclass(frozen=True, eq=False)
class FrameLeaves:
    """What a manifest's frame says of every leaf: the leaf rows (``chunks`` 0 and no IN_PIECES
    flag for sharded leaves), shapes, values and the chunk refs of leaves that are not sharded,
    leaf after leaf, and the packs those refs index."""

    tree: object
    address: Callable[[int], str]
    leaves: np.ndarray  # LEAF_DTYPE
    shapes: np.ndarray  # uint64
    shape_start: np.ndarray  # int64 [n + 1]
    ndim: np.ndarray  # int64 per leaf
    values: tuple[object, ...]  # scalar leaves' values as stored
    chunks: np.ndarray  # CHUNK_DTYPE: the refs of every leaf that is not sharded
    packs: np.ndarray  # PACK_DTYPE: the packs ``chunks`` index
    sharded: np.ndarray  # bool per leaf


def frame_leaves_from_fields(
    tree: object, address: Callable[[int], str], fields: Mapping[str, Any], sharded: Sequence[bool]
) -> FrameLeaves:
    """The primary's :class:`FrameLeaves`, from the manifest arrays of what it wrote (every leaf, in
    leaf order, as :func:`treestore._format.parts.part.part_from_fields` takes them) and its packs:
    a sharded leaf lists no chunk ref (its pieces are in the parts)."""
    leaves = fields["leaves"].copy()
    split = np.asarray(sharded, bool)
    chunks = fields["chunks"][~np.repeat(split, leaves["chunks"].astype(np.int64))]
    leaves["chunks"][split] = 0
    leaves["flags"] &= ~np.uint8(IN_PIECES)
    ndim = leaves["ndim"].astype(np.int64)
    return FrameLeaves(
        tree,
        address,
        leaves,
        fields["shapes"],
        prefix_sums(ndim),
        ndim,
        tuple(fields["values"]),
        chunks,
        fields["packs"],
        split,
    )


def frame_leaves_of(frame: Columns) -> FrameLeaves:
    """A reader's :class:`FrameLeaves`, from the validated frame of a manifest stored in parts."""
    sharded = (frame.leaves["flags"] & IN_PIECES) != 0
    leaves = frame.leaves.copy()
    leaves["flags"] &= ~np.uint8(IN_PIECES)
    values = tuple(stored_values(frame))
    ndim = leaves["ndim"].astype(np.int64)
    return FrameLeaves(
        frame.nodes,
        frame.address,
        leaves,
        frame.shapes,
        frame.shape_start,
        ndim,
        values,
        frame.chunks,
        frame.packs,
        sharded,
    )


def frame_of(
    frame_leaves: FrameLeaves, header: Mapping[str, Any], layout: bytes, parts: Sequence[ListedPart]
) -> Frame:
    """The frame of the manifest a multi-process save commits: ``frame_leaves`` (the primary's leaves),
    ``header`` (``name``, ``created``, ``metadata``, ``codec``, ``chunk_size``) and its parts,
    checked as readers check a frame (InvalidInputError naming the checkpoint otherwise)."""
    rows = frame_leaves.leaves.copy()
    rows["flags"][frame_leaves.sharded] |= IN_PIECES
    none = np.zeros(0, "<u4")
    fields = {
        **header,
        "leaves": rows,
        "shapes": frame_leaves.shapes,
        "values": list(frame_leaves.values),
        "piece_counts": none,
        "piece_chunks": none,
        "piece_start": none.astype("<u8"),
        "piece_shape": none.astype("<u8"),
        "chunks": frame_leaves.chunks,
        "packs": frame_leaves.packs,
    }
    return Frame(columns_from_fields(fields, frame_leaves.tree, unread=True), layout, tuple(parts))


@dataclass(frozen=True, eq=False)
class PartPieces:
    """Every process's part concatenated, process 0's first: per piece its leaf, process and
    number of chunk refs; the pieces' starts and shapes (their leaf's ndim entries each); the
    chunk refs as u4 rows, pack indices renumbered into ``packs``."""

    processes: int
    leaf: np.ndarray
    process: np.ndarray
    counts: np.ndarray
    start: np.ndarray
    shape: np.ndarray
    refs: np.ndarray
    packs: np.ndarray


def gather(
    frame_leaves: FrameLeaves,
    parts: Sequence[Part],
    ranges: np.ndarray,
    keep: np.ndarray | None = None,
) -> tuple[PartPieces | None, dict[int, str]]:
    """The parts (part k being process k's, each decoded; an empty part for one not
    read) concatenated and checked together: (the combination, {}) or (None, what is wrong with
    each process's part). Part k's pieces must lie in the leaves ``ranges[k]`` (int64 ``[first,
    end)``, as its frame lists it). ``keep`` (a bool mask over the leaves): only their pieces
    are kept, once every piece is checked."""
    n = len(frame_leaves.leaves)
    pieces = np.array([len(s.piece_leaves) for s in parts], np.int64)
    nrefs = np.array([len(s.chunks) for s in parts], np.int64)
    npacks = np.array([len(s.packs) for s in parts], np.int64)
    process = np.repeat(np.arange(len(parts)), pieces)
    leaf = np.concatenate([s.piece_leaves for s in parts]).astype(np.int64)
    counts = np.concatenate([s.piece_chunks for s in parts]).astype(np.int64)
    refs = np.concatenate([_words(s.chunks) for s in parts])
    pack = refs[:, _PACK_WORD].view(np.int32).astype(np.int64)
    owner = np.repeat(np.arange(len(parts)), nrefs)
    problems: dict[int, str] = {}

    def refuse(bad: np.ndarray, who: np.ndarray, why: str) -> None:
        for k in np.unique(who[bad]).tolist():
            problems.setdefault(int(k), f"its part is malformed: {why}")

    refuse(leaf >= n, process, f"a piece names a leaf beyond the tree's {n}")
    bounds = ranges[process]
    outside = (leaf < bounds[:, 0]) | (leaf >= bounds[:, 1])
    refuse(outside, process, "a piece lies outside the leaves its frame lists")
    known = np.minimum(leaf, max(n - 1, 0))
    if n:
        refuse(~frame_leaves.sharded[known], process, "it holds a piece of a leaf that is not sharded")
    dims = np.bincount(process, frame_leaves.ndim[known] if n else None, len(parts)).astype(np.int64)
    held = np.array([[len(s.piece_start), len(s.piece_shape)] for s in parts], np.int64).reshape(-1, 2)
    refuse(
        np.any(held != dims[:, None], axis=1),
        np.arange(len(parts)),
        "its piece boxes do not match its pieces",
    )
    listed = np.bincount(process, counts, len(parts)).astype(np.int64)
    refuse(listed != nrefs, np.arange(len(parts)), "its pieces do not list its chunk refs")
    refuse((pack < -1) | (pack >= npacks[owner]), owner, "a pack index is out of range")
    if problems:
        return None, problems
    base = prefix_sums(npacks) + len(frame_leaves.packs)  # each part's packs follow the frame's
    if base[-1] > len(frame_leaves.packs):
        moved = np.where(pack < 0, -1, np.minimum(pack + base[owner], PACK_INDEX_END - 1))
        refs[:, _PACK_WORD] = moved.astype(np.int32).view(np.uint32)
    start = np.concatenate([s.piece_start for s in parts])
    shape = np.concatenate([s.piece_shape for s in parts])
    packs = np.concatenate([frame_leaves.packs, *(s.packs for s in parts)])
    if keep is not None:  # a reader of some leaves: the others' pieces go
        kept = keep[leaf]
        boxes = np.repeat(kept, frame_leaves.ndim[leaf])
        refs = refs[np.repeat(kept, counts)]
        leaf, process, counts = leaf[kept], process[kept], counts[kept]
        start, shape = start[boxes], shape[boxes]
    return PartPieces(len(parts), leaf, process, counts, start, shape, refs, packs), {}


def _in_order(leaf: np.ndarray, grid: np.ndarray) -> bool:
    """Whether rows of one leaf (adjacent in ``leaf``) are in lexicographic order of ``grid``."""
    same = leaf[1:] == leaf[:-1]
    before = np.zeros(len(same), bool)
    equal = np.ones(len(same), bool)
    for d in range(grid.shape[1]):
        a, b = grid[:-1, d], grid[1:, d]
        before |= equal & (a < b)
        equal &= a == b
    return bool(np.all(before | equal | ~same))


def _ordered(frame_leaves: FrameLeaves, c: PartPieces) -> tuple[Pieces, np.ndarray, np.ndarray]:
    """The pieces ordered by leaf, then by start in lexicographic order (ties in process order),
    with each one's number of chunk refs and the chunk refs (u4 rows) in that order.

    Boxes are sorted as rows of their leaf's rank, rank by rank: never padded to the widest
    rank, which would let a part of many small pieces allocate their count times 64 words."""
    leaf = c.leaf
    ndim = frame_leaves.ndim[leaf]
    widths = np.unique(ndim).tolist()
    if len(widths) <= 1:  # the usual case: boxes of one width are rows
        width = widths[0] if widths else 0
        grid = c.start.reshape(len(leaf), width)
        order = np.argsort(leaf, kind="stable")  # each process's pieces come leaf by leaf: cheap
        if not _in_order(leaf[order], np.take(grid, order, axis=0)):
            order = np.lexsort((*(grid[:, d] for d in reversed(range(width))), leaf))
        boxes = (
            np.take(grid, order, axis=0).ravel(),
            np.take(c.shape.reshape(len(leaf), width), order, axis=0).ravel(),
        )
    else:  # each leaf has one rank: sort each rank's pieces, then bring the leaves together
        first = prefix_sums(ndim)[:-1]
        sorted_rows = []
        for width in widths:
            at = np.flatnonzero(ndim == width)
            grid = c.start[concat_ranges(first[at], ndim[at])].reshape(len(at), width)
            sorted_rows.append(at[np.lexsort((*(grid[:, d] for d in reversed(range(width))), leaf[at]))])
        merged = np.concatenate(sorted_rows)
        order = merged[np.argsort(leaf[merged], kind="stable")]
        entries = concat_ranges(first[order], ndim[order])
        boxes = (c.start[entries], c.shape[entries])
    counts = c.counts[order]
    if np.all(counts == 1):
        refs = np.take(c.refs, order, axis=0)
    else:
        refs = np.take(c.refs, concat_ranges(prefix_sums(c.counts)[:-1][order], counts), axis=0)
    return Pieces(leaf[order], c.process[order], ndim[order], *boxes), counts, refs


def merge(
    frame_leaves: FrameLeaves,
    gathered: PartPieces,
    header: Mapping[str, Any],
    unread: np.ndarray | None = None,
) -> Columns:
    """The version-2 manifest of a multi-process save: ``frame_leaves`` (the primary's leaves), every
    process's pieces (``gathered``) and ``header`` (``name``, ``created``, ``metadata``,
    ``codec``, ``chunk_size``), checked as readers check a manifest. ``unread`` (a bool mask):
    the sharded leaves whose pieces were left out (a reader's of other leaves); they list none.

    A sharded leaf whose one piece covers all of it is stored as a plain leaf (SPEC.md, section
    6.6). InvalidInputError when readers would refuse the manifest, naming the leaf and the
    processes whose pieces make it unreadable where that is the cause.
    """
    n = len(frame_leaves.leaves)
    unread = np.zeros(n, bool) if unread is None else unread & frame_leaves.sharded
    pieces, piece_chunks, piece_refs = _ordered(frame_leaves, gathered)
    leaf, ndim = pieces.leaf, pieces.ndim
    counts = np.bincount(leaf, minlength=n)
    in_pieces = frame_leaves.sharded.copy()
    single = np.flatnonzero(counts[leaf] == 1)
    if len(single):  # one piece that is the whole leaf (start 0, the leaf's shape): a plain leaf
        entries = concat_ranges(prefix_sums(ndim)[:-1][single], ndim[single])
        dims = frame_leaves.shapes[concat_ranges(frame_leaves.shape_start[leaf[single]], ndim[single])]
        off = (pieces.shape[entries] != dims) | (pieces.start[entries] != 0)
        partial = np.bincount(np.repeat(np.arange(len(single)), ndim[single]), off, len(single)) > 0
        in_pieces[leaf[single[~partial]]] = False
    nchunks = frame_leaves.leaves["chunks"].astype(np.int64)
    nchunks[frame_leaves.sharded] = np.bincount(leaf, piece_chunks, n).astype(np.int64)[frame_leaves.sharded]
    if len(frame_leaves.chunks):
        chunk_start = prefix_sums(nchunks)
        words = np.empty((int(chunk_start[-1]), _REF_WORDS), np.uint32)
        for mask, refs in (
            (~frame_leaves.sharded, _words(frame_leaves.chunks)),
            (frame_leaves.sharded, piece_refs),
        ):
            words[concat_ranges(chunk_start[:-1][mask], nchunks[mask])] = refs  # pieces come leaf by leaf
    else:  # every chunk ref is a piece's
        words = piece_refs
    rows = frame_leaves.leaves.copy()
    rows["flags"][in_pieces] |= IN_PIECES
    rows["chunks"] = np.minimum(nchunks, 2**32 - 1)  # beyond u32: refused as a count mismatch
    keep = in_pieces[leaf]
    start, shape, per_piece = pieces.start, pieces.shape, piece_chunks.astype("<u4")
    if not keep.all():
        entry = np.repeat(keep, ndim)
        start, shape, per_piece = start[entry], shape[entry], per_piece[keep]
    fields = {
        **header,
        "leaves": rows,
        "shapes": frame_leaves.shapes,
        "values": list(frame_leaves.values),
        "piece_counts": np.minimum(counts[in_pieces & ~unread], 2**32 - 1).astype("<u4"),
        "piece_chunks": per_piece,
        "piece_start": start,
        "piece_shape": shape,
        "chunks": words.view(CHUNK_DTYPE).ravel(),
        "packs": gathered.packs,
    }
    try:
        return columns_from_fields(fields, frame_leaves.tree, unread=unread)
    except InvalidInputError as exc:
        listed = in_pieces & ~unread
        found = explain(
            pieces, listed, counts, frame_leaves.shapes, frame_leaves.shape_start, gathered.processes
        )
        if found is None:
            raise
        i, why = found
        address = frame_leaves.address(i)
        raise InvalidInputError(
            f"multi-process save of checkpoint {header['name']!r}: leaf {address or '(root)'}: {why} "
            f"({exc.message})",
            checkpoint=header["name"],
            address=address,
        ) from None


__all__ = [
    "PACK_INDEX_END",
    "FrameLeaves",
    "PartPieces",
    "frame_leaves_from_fields",
    "frame_leaves_of",
    "frame_of",
    "gather",
    "merge",
]
