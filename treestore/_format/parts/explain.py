"""Why a multi-process save's merged pieces do not tile a leaf, naming the processes that sent them.

Only run once the merged manifest has failed the readers' checks (they alone decide): this finds
the leaf and the processes behind the failure, so the error says which process to look at.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from treestore._format.encoding import Bad
from treestore._format.manifest.rules import check_tiling

_PAIRS_UP_TO = 8192  # pieces of one leaf searched pairwise for an overlap
_BLOCK = 256


@dataclass(frozen=True, eq=False)
class Pieces:
    """Every process's pieces, ordered by leaf then start: the leaf, the sending process and the
    leaf's number of dimensions of each piece; their boxes, ndim entries per piece."""

    leaf: np.ndarray  # int64
    process: np.ndarray  # int64
    ndim: np.ndarray  # int64
    start: np.ndarray  # uint64
    shape: np.ndarray  # uint64

    def boxes(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(start, shape) of pieces ``rows`` (all of one leaf), one int64 row per piece."""
        d = int(self.ndim[rows[0]]) if len(rows) else 0
        first = np.zeros(len(self.ndim) + 1, np.int64)
        np.cumsum(self.ndim, out=first[1:])
        at = (first[rows][:, None] + np.arange(d)).ravel()
        return self.start[at].astype(np.int64).reshape(-1, d), self.shape[at].astype(np.int64).reshape(-1, d)


def process_names(processes: np.ndarray | Sequence[int]) -> str:
    """``process 3`` or ``processes 1, 2 and 40 more``: at most 12 named."""
    found = [int(p) for p in processes]
    text = ", ".join(map(str, found[:12])) + (f" and {len(found) - 12} more" if len(found) > 12 else "")
    return f"process {text}" if len(found) == 1 else f"processes {text}"


def _overlap(start: np.ndarray, shape: np.ndarray) -> tuple[int, int] | None:
    """The first two boxes (rows) that overlap, or None."""
    end = start + shape
    for a in range(0, len(start), _BLOCK):
        lo, hi = start[a : a + _BLOCK, None, :], end[a : a + _BLOCK, None, :]
        hit = np.all((lo < end[None]) & (start[None] < hi), axis=2)
        hit &= np.arange(len(start))[None, :] > np.arange(a, a + len(lo))[:, None]
        if hit.any():
            i, j = np.unravel_index(int(np.argmax(hit)), hit.shape)
            return a + int(i), int(j)
    return None


def explain(
    pieces: Pieces,
    in_pieces: np.ndarray,
    counts: np.ndarray,
    shapes: np.ndarray,
    shape_start: np.ndarray,
    processes: int,
) -> tuple[int, str] | None:
    """(leaf, why) for the first leaf whose pieces do not tile it, or None when every leaf's do.
    ``in_pieces`` marks the leaves stored in pieces, ``counts`` their numbers of pieces, ``shapes``
    and ``shape_start`` every leaf's dimensions."""
    none = np.flatnonzero(in_pieces & (counts == 0))
    if len(none):
        return int(none[0]), f"no process sent a piece of it (of {processes} processes)"
    leaf, process = pieces.leaf, pieces.process
    n = len(in_pieces)
    entry = np.repeat(np.arange(len(leaf)), pieces.ndim)
    first = shape_start[leaf]
    within = np.arange(len(entry)) - np.repeat(np.cumsum(pieces.ndim) - pieces.ndim, pieces.ndim)
    dims = shapes[first[entry] + within] if len(entry) else shapes[:0]
    out = (pieces.start > dims) | (pieces.shape > dims - np.minimum(pieces.start, dims))
    outside = (np.bincount(entry, out, len(leaf)) > 0) & in_pieces[leaf]
    if outside.any():
        j = int(np.argmax(outside))
        start, shape = (tuple(b[0].tolist()) for b in pieces.boxes(np.array([j])))
        whole = tuple(shapes[shape_start[leaf[j]] : shape_start[leaf[j] + 1]].tolist())
        return int(leaf[j]), (
            f"a piece from process {int(process[j])} at {start} of shape {shape} lies outside "
            f"its shape {whole}"
        )
    volume = np.ones(len(leaf))
    np.multiply.at(volume, entry, pieces.shape.astype(np.float64))
    size = np.ones(n)
    np.multiply.at(size, np.repeat(np.arange(n), np.diff(shape_start)), shapes.astype(np.float64))
    covered = np.bincount(leaf, volume, n)
    for i in np.flatnonzero(in_pieces & (covered < size)).tolist():
        senders = np.unique(process[leaf == i])
        silent = np.setdiff1d(np.arange(processes), senders)
        return i, (
            f"its pieces cover {covered[i]:.0f} of its {size[i]:.0f} elements: {process_names(senders)} sent "
            f"pieces of it, {process_names(silent) if len(silent) else 'none of the others'} sent none"
        )
    over = np.flatnonzero(in_pieces & (covered > size)).tolist()
    rest = np.flatnonzero(in_pieces & (covered == size) & (counts > 1)).tolist()
    for i in over + rest:
        rows = np.flatnonzero(leaf == i)
        lo, extent = pieces.boxes(rows)
        if i in rest:
            try:
                check_tiling(lo, extent, tuple(shapes[shape_start[i] : shape_start[i + 1]].tolist()))
                continue
            except Bad:
                pass
        pair = _overlap(lo, extent) if len(rows) <= _PAIRS_UP_TO else None
        if pair is None:
            return i, f"its pieces overlap; {process_names(np.unique(process[rows]))} sent pieces of it"
        a, b = pair
        who = (
            f"two pieces from process {int(process[rows[a]])}"
            if process[rows[a]] == process[rows[b]]
            else f"pieces from processes {int(process[rows[a]])} and {int(process[rows[b]])}"
        )
        return i, (
            f"{who} overlap: at {tuple(lo[a].tolist())} of shape {tuple(extent[a].tolist())} "
            f"and at {tuple(lo[b].tolist())} of shape {tuple(extent[b].tolist())}"
        )
    return None
