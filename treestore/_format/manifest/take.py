"""Leaves taken from manifests: the columns of chosen leaves of one or more manifests.

A derived checkpoint keeps some of its base's leaves and adds the leaves it sets, in the order
of its new tree. :func:`take_leaves` gathers their rows, dimensions, chunk refs, pieces, values
and statistics straight from the sources' columns (index arithmetic over whole columns, no
per-leaf object) and renumbers the packs they reference, keeping only those. The result is
the ``fields`` that :func:`treestore._format.manifest.codec.columns_from_fields` checks as
readers check a manifest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from treestore._format.manifest.codec import stored_values
from treestore._format.manifest.columns import ARRAY_CODES, IN_PIECES, Columns, concat_ranges, prefix_sums
from treestore._format.stats import STATS_DTYPE, UNKNOWN


def _starts(parts: Sequence[np.ndarray], sizes: Sequence[int]) -> np.ndarray:
    """Each source's per-row starts (``parts``, without their totals), shifted by the sizes of
    the sources before it: starts into the sources' columns laid end to end."""
    shift = prefix_sums(np.array(sizes, np.int64))
    return np.concatenate([p.astype(np.int64) + shift[k] for k, p in enumerate(parts)])


def take_leaves(sources: Sequence[Columns], source: np.ndarray, leaf: np.ndarray) -> dict[str, Any]:
    """The manifest arrays (``leaves``, ``shapes``, ``values``, the piece columns, ``chunks``,
    ``packs``, and ``stats`` when a source has statistics) of leaves ``leaf[k]`` of
    ``sources[source[k]]``, in that order. Packs are kept only when a taken chunk ref points
    into one, in source order then pack order. The sources must be complete (no pieces in
    parts not read)."""
    for s in sources:
        s.require_pieces()
    source = np.asarray(source, np.int64)
    g = prefix_sums(np.array([len(s) for s in sources], np.int64))[source] + np.asarray(leaf, np.int64)
    rows = np.concatenate([s.leaves for s in sources])[g]
    ndim = rows["ndim"].astype(np.int64)
    count = rows["chunks"].astype(np.int64)
    # Dimensions and chunk refs: each leaf's run, from the sources laid end to end.
    shape_at = _starts([s.shape_start[:-1] for s in sources], [len(s.shapes) for s in sources])
    shapes = np.concatenate([s.shapes for s in sources])[concat_ranges(shape_at[g], ndim)]
    chunk_at = _starts([s.chunk_start[:-1] for s in sources], [len(s.chunks) for s in sources])
    taken = concat_ranges(chunk_at[g], count)
    chunks = np.concatenate([s.chunks for s in sources])[taken]
    # Packs, renumbered: a source's pack p is p plus the packs of the sources before it.
    pack_shift = prefix_sums(np.array([len(s.packs) for s in sources], np.int64))
    chunk_source = np.repeat(source, count)
    inside = chunks["pack"] >= 0
    old = chunks["pack"][inside].astype(np.int64) + pack_shift[chunk_source[inside]]
    kept = np.unique(old)
    chunks["pack"][inside] = np.searchsorted(kept, old)
    packs = np.concatenate([s.packs for s in sources])[kept]
    # Pieces: those of each leaf saved in pieces, with their chunk counts, starts and shapes.
    in_pieces = (rows["flags"] & IN_PIECES) != 0
    ranks = [s._piece_index for s in sources]  # (rank, first piece, first chunk, first dim)
    rank = _starts([r[0] for r in ranks], [len(s.piece_counts) for s in sources])
    first = _starts([r[1][:-1] for r in ranks], [len(s.piece_chunks) for s in sources])
    dims = _starts([r[3][:-1] for r in ranks], [len(s.piece_start) for s in sources])
    which = rank[g[in_pieces]]
    piece_counts = np.concatenate([s.piece_counts for s in sources])[which]
    pieces = concat_ranges(first[which], piece_counts.astype(np.int64))
    piece_chunks = np.concatenate([s.piece_chunks for s in sources])[pieces]
    boxes = concat_ranges(dims[pieces], np.repeat(ndim[in_pieces], piece_counts.astype(np.int64)))
    piece_start = np.concatenate([s.piece_start for s in sources])[boxes]
    piece_shape = np.concatenate([s.piece_shape for s in sources])[boxes]
    # Scalar values, as stored, by their rank among each source's scalar leaves.
    stored = [stored_values(s) for s in sources]
    scalar = np.flatnonzero(rows["kind"] >= ARRAY_CODES).tolist()
    values = [stored[int(source[k])][int(sources[int(source[k])]._value_rank[leaf[k]])] for k in scalar]
    fields: dict[str, Any] = {
        "leaves": rows,
        "shapes": shapes,
        "values": values,
        "piece_counts": piece_counts,
        "piece_chunks": piece_chunks,
        "piece_start": piece_start,
        "piece_shape": piece_shape,
        "chunks": chunks,
        "packs": packs,
    }
    if any(s.stats is not None for s in sources):
        stats = np.concatenate(
            [s.stats if s.stats is not None else np.zeros(len(s), STATS_DTYPE) for s in sources]
        )[g]
        if (stats["kind"] != UNKNOWN).any():
            fields["stats"] = stats
    return fields
