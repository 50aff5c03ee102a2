"""How much a leaf changed between two checkpoints, in numbers (:class:`ValueChange`): read chunk by
chunk where both are stored alike, a chunk whose digest is the same in both read once; measured
over the elements finite in both, with the non-finite ones counted apart."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from treestore._api.checkpoint import Checkpoint
from treestore._api.lazy_leaf import LazyLeaf
from treestore._engine.reading.region import chunk_bytes, leaf_pieces


@dataclass(frozen=True)
class ValueChange:
    """Numeric change of one leaf between a and b (over all its elements).

    ``rel_l2`` is measured over the elements finite in both, so one inf or NaN does not hide
    the change of the others (‖inf‖ made every change 0.0, a NaN made it NaN); the elements
    it leaves out that changed (to, from or between non-finite values) are counted in
    ``nonfinite_changed``, and the NaN and Inf elements of each side in ``nan_a`` to ``inf_b``.

    Attributes:
        max_abs: The largest ``|b - a|`` of an element; inf when an element changed to, from or
            between NaN and ±inf.
        mean_abs: ``|b - a|`` summed over the elements that differ, divided by the number of
            elements (inf as for ``max_abs``).
        rel_l2: ``‖b - a‖ / ‖a‖`` over the elements finite in both; inf when that ``‖a‖`` is 0
            and b differs there.
        frac_changed: The fraction of elements that differ (NaN equals NaN).
        nan_a: NaN elements in a.
        nan_b: NaN elements in b.
        inf_a: ±inf elements in a.
        inf_b: ±inf elements in b.
        nonfinite_changed: Elements that differ and are NaN or ±inf in a or b.
    """

    max_abs: float
    mean_abs: float
    rel_l2: float
    frac_changed: float
    nan_a: int
    nan_b: int
    inf_a: int
    inf_b: int
    nonfinite_changed: int = 0


class _Norm:
    """A Euclidean norm summed over pieces without overflow or underflow: the sum of squares is
    kept relative to the largest magnitude seen (as BLAS's nrm2), so 1e200 and 1e-200 count."""

    def __init__(self) -> None:
        self.scale = 0.0
        self.ssq = 0.0

    def add(self, x: np.ndarray[Any, Any]) -> None:
        m = np.abs(x)
        top = float(m.max()) if m.size else 0.0
        if top == 0:
            return
        if top > self.scale:
            self.ssq *= (self.scale / top) ** 2
            self.scale = top
        self.ssq += float(np.sum((m / self.scale) ** 2))

    @property
    def value(self) -> float:
        return self.scale * math.sqrt(self.ssq)


def _where(x: np.ndarray[Any, Any], keep: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The elements of ``x`` that ``keep`` marks (``x`` itself, uncopied, when it marks all)."""
    return x if keep.all() else x[keep]


class _Accumulator:
    def __init__(self) -> None:
        self.max_abs = 0.0
        self.sum_abs = 0.0
        self.norm_a = _Norm()  # over the elements finite in both
        self.norm_delta = _Norm()  # of (b - a) / 2 there (halved: the difference cannot overflow)
        self.changed = self.count = self.nonfinite_changed = 0
        self.nan_a = self.nan_b = self.inf_a = self.inf_b = 0

    def add(self, xa: np.ndarray[Any, Any], xb: np.ndarray[Any, Any] | None) -> None:
        fa = xa.astype(np.complex128 if np.iscomplexobj(xa) else np.float64)
        self.count += fa.size
        nan_a, inf_a = int(np.isnan(fa).sum()), int(np.isinf(fa).sum())
        self.nan_a += nan_a
        self.inf_a += inf_a
        if xb is None:  # identical chunk
            self.nan_b += nan_a
            self.inf_b += inf_a
            self.norm_a.add(_where(fa, np.isfinite(fa)))
            return
        fb = xb.astype(fa.dtype)
        self.nan_b += int(np.isnan(fb).sum())
        self.inf_b += int(np.isinf(fb).sum())
        both_nan = np.isnan(fa) & np.isnan(fb)
        differs = (fa != fb) & ~both_nan
        finite = np.isfinite(fa) & np.isfinite(fb)
        self.changed += int(differs.sum())
        self.nonfinite_changed += int((differs & ~finite).sum())
        ma, mb = _where(fa, finite), _where(fb, finite)
        self.norm_a.add(ma)
        self.norm_delta.add(mb * 0.5 - ma * 0.5)
        with np.errstate(invalid="ignore", over="ignore"):
            delta = np.abs(np.where(differs, fb - fa, 0))
        finite_delta = delta[np.isfinite(delta)]
        if delta.size and finite_delta.size != delta.size:
            self.max_abs = math.inf
        if finite_delta.size:
            self.max_abs = max(self.max_abs, float(finite_delta.max()))
            self.sum_abs += float(finite_delta.sum())
        if finite_delta.size != delta.size:
            self.sum_abs = math.inf

    def result(self) -> ValueChange:
        n = max(self.count, 1)
        norm_a, half = self.norm_a.value, self.norm_delta.value
        with np.errstate(over="ignore"):
            rel = float(np.float64(half) / np.float64(norm_a) * 2) if norm_a else (math.inf if half else 0.0)
        return ValueChange(
            self.max_abs,
            self.sum_abs / n,
            rel,
            self.changed / n,
            self.nan_a,
            self.nan_b,
            self.inf_a,
            self.inf_b,
            self.nonfinite_changed,
        )


def whole_change(a: LazyLeaf, b: LazyLeaf, tick: Callable[[int], None] | None = None) -> ValueChange:
    """The statistics of two leaves of one shape and dtype, compared whole; ``tick`` is told
    the raw bytes of both once they are compared."""
    acc = _Accumulator()
    acc.add(np.asarray(a).reshape(-1), np.asarray(b).reshape(-1))
    if tick is not None:
        tick(a.nbytes + b.nbytes)
    return acc.result()


def chunk_change(
    a: Checkpoint, i: int, b: Checkpoint, j: int, tick: Callable[[int], None] | None = None
) -> ValueChange:
    """The statistics of leaf i of a and leaf j of b, cut into chunks alike, read chunk by chunk:
    a chunk whose digest is the same in both is read once (for the norm of a). ``tick`` is told
    the raw bytes of both sides of each chunk once it is compared."""
    acc = _Accumulator()
    pa, pb = leaf_pieces(a._columns, i), leaf_pieces(b._columns, j)  # the same pieces, chunk for chunk
    ra, rb = a._columns.chunks, b._columns.chunks
    for p in range(len(pa.first)):
        at = 0
        for ja, jb in zip(
            range(int(pa.first[p]), int(pa.first[p] + pa.count[p])),
            range(int(pb.first[p]), int(pb.first[p] + pb.count[p])),
            strict=True,
        ):
            end = at + int(ra["raw"][ja])
            xa = chunk_bytes(a._reader, pa.chunks(p, at, end), at, end, pa.address).view(pa.dtype)
            same = ra["digest"][ja] == rb["digest"][jb]
            xb = (
                None
                if same
                else chunk_bytes(b._reader, pb.chunks(p, at, end), at, end, pb.address).view(pb.dtype)
            )
            acc.add(xa, xb)
            if tick is not None:
                tick(2 * (end - at))
            at = end
    return acc.result()
