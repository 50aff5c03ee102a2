"""Packs: small leaves, and the small pieces of sharded leaves, copied side by side into buffers
of ``pack_size`` bytes, each stored as one chunk object (SPEC 5, 6.5).

Each member is copied once (``tobytes``), hashed, and written into its pack's buffer, on the
saving thread before any worker runs: thousands of tiny copies and hashes interleaved with the
workers would spend their time handing the GIL back and forth. The
statistics of the members are measured on the workers, from the pack's own bytes: the members of
one leaf lie side by side in a pack, so a leaf costs one measurement per pack it spans however
many pieces it has.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from treestore._format import stats as _stats
from treestore._format.codecs import plane_width
from treestore._format.manifest.leaf_table import Ref
from treestore._format.manifest.records import ChunkRef
from treestore._kernels.digest import digest

Span = tuple[int, np.dtype[Any], int, int]  # (leaf index, dtype, first byte, end byte) in a pack
Packed = tuple[ChunkRef, np.ndarray, np.ndarray]  # a pack's ref; its spans' leaves and statistics


@dataclass
class _Pack:
    buffer: bytearray  # pack_size bytes, filled from the start
    view: memoryview  # of buffer: slice assignment through it copies faster
    fill: int = 0
    width: int | None = None  # the plane width of every member (0: they differ); None: empty
    dtype: np.dtype[Any] | None = None  # the last member's
    spans: list[Span] = field(default_factory=list)  # the measured leaves' bytes, in order


class Packer:
    """Members laid out pack after pack, in the order they are added. :meth:`finish` hands
    each pack to ``submit(fn, *args)``, to be measured and stored with ``put(raw, width,
    private=True)``: in byte planes when every member is a floating-point
    array of one plane width (each member's bytes are whole elements, so every offset is a
    multiple of it), as a chunk of one such leaf would be."""

    def __init__(
        self,
        pack_size: int,
        submit: Callable[..., cf.Future[Packed]],
        put: Callable[..., ChunkRef],
    ) -> None:
        self._size = pack_size
        self._submit = submit
        self._put = put
        self._packs: list[_Pack] = []

    def add(self, data: np.ndarray[Any, Any], leaf: int, measure: bool) -> Ref:
        """Copy ``data`` (0 < nbytes <= pack size) into the current pack, or a new one when it
        does not fit; returns its chunk ref (digest, raw size, stored size unknown: 0, pack
        index, offset). With ``measure``, its bytes join the leaf's span for statistics."""
        raw = data.tobytes()  # a copy: the bytes hashed are the bytes packed and measured
        n = len(raw)
        if not self._packs or self._packs[-1].fill + n > self._size:
            buffer = bytearray(self._size)
            self._packs.append(_Pack(buffer, memoryview(buffer)))
        pack = self._packs[-1]
        at = pack.fill
        pack.view[at : at + n] = raw
        pack.fill = at + n
        if data.dtype != pack.dtype:
            width = plane_width(data.dtype)
            pack.width = width if pack.width in (None, width) else 0
            pack.dtype = data.dtype
        if measure:
            last = pack.spans[-1] if pack.spans else None
            if last is not None and last[0] == leaf and last[3] == at:  # the leaf's next piece
                pack.spans[-1] = (leaf, last[1], last[2], at + n)
            else:
                pack.spans.append((leaf, data.dtype, at, at + n))
        return (digest(raw), n, 0, len(self._packs) - 1, at)

    def finish(self) -> list[cf.Future[Packed]]:
        """Hand every pack to the workers; their jobs, in pack order."""
        packs, self._packs = self._packs, []
        return [
            self._submit(_store, self._put, np.frombuffer(p.buffer, np.uint8, p.fill), p.width or 0, p.spans)
            for p in packs
        ]


def _store(put: Callable[..., ChunkRef], raw: np.ndarray[Any, Any], width: int, spans: list[Span]) -> Packed:
    return (put(raw, width, private=True, pack=True), *_measure(raw, spans))


def _measure(raw: np.ndarray[Any, Any], spans: list[Span]) -> tuple[np.ndarray, np.ndarray]:
    """The leaf of each span and its statistics (a ``stats`` column, a row per span): each run
    of adjacent spans of one dtype measured at once."""
    tables = []
    i = 0
    while i < len(spans):
        j = i + 1
        while j < len(spans) and spans[j][1] == spans[i][1] and spans[j][2] == spans[j - 1][3]:
            j += 1
        dtype, first, end = spans[i][1], spans[i][2], spans[j - 1][3]
        starts = np.array([s[2] - first for s in spans[i:j]], np.int64) // dtype.itemsize
        tables.append(_stats.measure_segments(raw[first:end].view(dtype), starts))
        i = j
    leaves = np.array([s[0] for s in spans], np.int64)
    return leaves, np.concatenate(tables) if tables else np.zeros(0, _stats.STATS_DTYPE)


__all__ = ["Packed", "Packer"]
