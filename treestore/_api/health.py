"""What a checkpoint's manifest says of its values: the statistics a save recorded of each leaf
(:class:`ValueStats`) and whether any leaf holds NaN or ±inf, read without reading any chunk.

Statistics come from the manifest's optional ``stats`` column (checked as hostile input when
decoded: see :mod:`treestore._format.stats`); a Python scalar leaf's come from its value, which
the manifest holds. A leaf without them (a checkpoint saved without statistics, of format 1, a
PRNG key leaf, a complex leaf saved before complex statistics existed, a record that made no
sense) is *unknown*, never taken for healthy or unhealthy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from treestore._format import stats as _stats
from treestore._format.dtypes import ITEMSIZES
from treestore._format.manifest.columns import Columns


@dataclass(frozen=True)
class ValueStats:
    """Statistics of one leaf's values, recorded when it was saved (see ``SaveOptions.stats``).

    ``min`` and ``max`` are over the finite elements (None when there is none); ``l2`` is the
    L2 norm of the finite elements, accumulated in float64. Integer and bool leaves have no
    non-finite elements. A complex leaf is described by its elements' real and imaginary parts,
    ``2 * size`` real numbers: the counts, ``min``, ``max`` and ``l2`` are theirs (``l2`` is the
    norm of the complex vector when every part is finite). They are read from the manifest alone
    and are advisory: shown, and used to decide retention, never to check data.

    Attributes:
        address: The leaf's address.
        dtype: Its numpy dtype name; ``"float"``, ``"int"`` or ``"bool"`` for a Python scalar.
        size: Its number of elements.
        nan: NaN elements (of a complex leaf: NaN parts).
        posinf: +inf elements (parts).
        neginf: -inf elements (parts).
        min: The smallest finite element (None when there is none).
        max: The largest finite element (None when there is none).
        l2: The L2 norm of the finite elements.

    Examples:
        >>> import numpy as np, treestore
        >>> w = np.array([3.0, np.nan, 4.0, -np.inf], np.float32)
        >>> _ = treestore.save("memory://doc/stats", {"w": w}, "a")
        >>> s = treestore.open("memory://doc/stats#a").stats()["w"]
        >>> s.nan, s.neginf, s.min, s.max, s.l2, s.healthy
        (1, 1, 3.0, 4.0, 5.0, False)
    """

    address: str
    dtype: str
    size: int
    nan: int
    posinf: int
    neginf: int
    min: float | int | None
    max: float | int | None
    l2: float

    @property
    def nonfinite(self) -> int:
        """Elements that are NaN, +inf or -inf."""
        return self.nan + self.posinf + self.neginf

    @property
    def finite(self) -> int:
        """Elements (of a complex leaf: parts) that are neither NaN nor ±inf."""
        return self.size * _stats.parts(self.dtype) - self.nonfinite

    @property
    def healthy(self) -> bool:
        """Whether every element is finite."""
        return self.nonfinite == 0

    @property
    def rms(self) -> float | None:
        """Root mean square of the finite elements (None when there is none)."""
        return self.l2 / math.sqrt(self.finite) if self.finite else None

    def to_json(self) -> dict[str, object]:
        """The statistics as plain data, ready for :func:`json.dumps`.

        Returns:
            A dict of the fields by name; min and max are finite or None, and an ``l2`` that
            overflowed to inf is None.
        """
        return {
            "address": self.address,
            "dtype": self.dtype,
            "size": self.size,
            "nan": self.nan,
            "posinf": self.posinf,
            "neginf": self.neginf,
            "min": self.min,
            "max": self.max,
            "l2": self.l2 if math.isfinite(self.l2) else None,
        }


def _of_value(address: str, kind: str, value: object) -> ValueStats | None:
    """The statistics of a Python scalar leaf (bool, int, float), from its value."""
    if kind == "float" and isinstance(value, float):
        nan, pos, neg = int(math.isnan(value)), int(value == math.inf), int(value == -math.inf)
        ok = math.isfinite(value)
        return ValueStats(
            address,
            "float",
            1,
            nan,
            pos,
            neg,
            value if ok else None,
            value if ok else None,
            abs(value) if ok else 0.0,
        )
    if kind in ("int", "bool") and isinstance(value, int):
        try:
            l2 = float(abs(value))
        except OverflowError:
            l2 = math.inf
        return ValueStats(address, kind, 1, 0, 0, 0, value, value, l2)
    return None


def _of_record(address: str, dtype: str, size: int, r: _stats.Record) -> ValueStats:
    kind, nan, pos, neg, lo, hi, sumsq = r
    finite = size * _stats.parts(dtype) - nan - pos - neg
    if kind == _stats.UINT and dtype == "bool":
        lo, hi = bool(lo), bool(hi)
    return ValueStats(
        address, dtype, size, nan, pos, neg, lo if finite else None, hi if finite else None, math.sqrt(sumsq)
    )


def leaf_stats(columns: Columns, which: Sequence[int] | None = None) -> dict[str, ValueStats]:
    """The statistics of leaves ``which`` (default: every leaf) that have them, by address, in
    leaf order; the others are left out (unknown)."""
    which = range(len(columns)) if which is None else which
    table = columns.stats
    out: dict[str, ValueStats] = {}
    for i in which:
        address = columns.address(i)
        if not columns.is_array[i]:
            found = _of_value(address, columns.kind(i), columns.value(i))
            if found is not None:
                out[address] = found
            continue
        if table is None or table["kind"][i] == _stats.UNKNOWN:
            continue
        (record,) = _stats.records(table[i : i + 1])
        dtype = columns.dtype_name(i)
        size = int(columns.leaf_nbytes[i]) // ITEMSIZES[dtype]
        out[address] = _of_record(address, dtype, size, record)
    return out


def nonfinite_leaves(columns: Columns) -> np.ndarray:
    """The indices of the leaves whose recorded values hold NaN or ±inf (Python scalars by their
    value), vectorised over the stats column: what a scan of hundreds of manifests asks."""
    found = np.zeros(len(columns), bool)
    table = columns.stats
    if table is not None:
        found |= np.isin(table["kind"], _stats.REAL) & (
            (table["nan"] | table["posinf"] | table["neginf"]) > 0
        )
    for i in np.flatnonzero(columns.of_kind("float")).tolist():
        value = columns.value(i)
        found[i] = isinstance(value, float) and not math.isfinite(value)
    return np.flatnonzero(found)


def _may_hold_nan(dtype: str) -> bool:
    """Whether arrays of ``dtype`` (a SPEC.md name) can hold NaN or ±inf: floating and complex."""
    return _stats.kind_of(dtype) in _stats.REAL


def health(columns: Columns) -> bool | None:
    """Whether a checkpoint is healthy: False when a leaf holds NaN or ±inf, True when every
    leaf that could hold them (floating and complex arrays with elements) has statistics and
    none does, None (unknown) otherwise: unknown is never taken for healthy."""
    if len(nonfinite_leaves(columns)):
        return False
    table = columns.stats
    if table is None:
        return None
    arrays = columns.is_array & (columns.leaf_nbytes > 0)
    unmeasured = arrays & columns.by_dtype(_may_hold_nan) & (table["kind"] == _stats.UNKNOWN)
    return None if unmeasured.any() else True


__all__ = ["ValueStats", "health", "leaf_stats", "nonfinite_leaves"]
