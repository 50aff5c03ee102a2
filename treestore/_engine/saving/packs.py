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

Packed = tuple[ChunkRef, np.ndarray, np.ndarray]  # a pack's ref; its spans' leaves and statistics


@dataclass(slots=True)
class _Run:
    """Measured members side by side in a pack, of one dtype: measured in one call. A span is one
    leaf's bytes (its adjacent pieces together); the run keeps each span's first byte and leaf,
    as lists (a tuple per span cost a save of many small leaves a Python step each to unpack)."""

    dtype: np.dtype[Any]
    end: int  # the pack byte after its last span
    starts: list[int]  # each span's first byte in the pack
    leaves: list[int]  # each span's leaf index


@dataclass
class _Pack:
    buffer: bytearray  # pack_size bytes, filled from the start
    view: memoryview  # of buffer: slice assignment through it copies faster
    fill: int = 0
    width: int | None = None  # the plane width of every member (0: they differ); None: empty
    dtype: np.dtype[Any] | None = None  # the last member's
    runs: list[_Run] = field(default_factory=list)  # the measured leaves' bytes, in order


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
        dtype = data.dtype
        if dtype is not pack.dtype and dtype != pack.dtype:
            width = plane_width(dtype)
            pack.width = width if pack.width in (None, width) else 0
            pack.dtype = dtype
        if measure:
            run = pack.runs[-1] if pack.runs else None
            if run is not None and run.end == at and (run.dtype is dtype or run.dtype == dtype):
                if run.leaves[-1] != leaf:  # else the leaf's next piece: its span grows
                    run.starts.append(at)
                    run.leaves.append(leaf)
                run.end = at + n
            else:
                pack.runs.append(_Run(dtype, at + n, [at], [leaf]))
        return (digest(raw), n, 0, len(self._packs) - 1, at)

    def finish(self) -> list[cf.Future[Packed]]:
        """Hand every pack to the workers; their jobs, in pack order."""
        packs, self._packs = self._packs, []
        return [
            self._submit(_store, self._put, np.frombuffer(p.buffer, np.uint8, p.fill), p.width or 0, p.runs)
            for p in packs
        ]


def _store(put: Callable[..., ChunkRef], raw: np.ndarray[Any, Any], width: int, runs: list[_Run]) -> Packed:
    return (put(raw, width, private=True, pack=True), *_measure(raw, runs))


def _measure(raw: np.ndarray[Any, Any], runs: list[_Run]) -> tuple[np.ndarray, np.ndarray]:
    """The leaf of each span and its statistics (a ``stats`` column, a row per span), each run
    measured at once."""
    if not runs:
        return np.zeros(0, np.int64), np.zeros(0, _stats.STATS_DTYPE)
    tables, leaves = [], []
    for run in runs:
        first = run.starts[0]
        starts = (np.array(run.starts, np.int64) - first) // run.dtype.itemsize
        tables.append(_stats.measure_segments(raw[first : run.end].view(run.dtype), starts))
        leaves.append(np.array(run.leaves, np.int64))
    return np.concatenate(leaves), np.concatenate(tables)


__all__ = ["Packed", "Packer"]
