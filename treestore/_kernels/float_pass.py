"""The compiled one-pass statistics of float32 and bfloat16 chunks (``_planes.c``'s
``float_stats``, built at install on x86-64): the smallest and largest element and the float64 sum
of squares in one read of the chunk. What a record holds, and numpy's passes where this is not
built, are treestore._format.stats'."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

_PassFn = Callable[[Any, int], tuple[float, float, float]]
WIDTHS = {"float32": 4, "bfloat16": 2}  # dtypes the compiled pass measures, by element width


def compiled() -> _PassFn | None:
    """The compiled pass (``float_stats(src, width) -> (min, max, sum of squares)``); None where
    it was not built or fails :func:`same_as_numpy` (numpy's passes then)."""
    try:
        from treestore._kernels import _planes
    except ImportError:
        return None
    fn = getattr(_planes, "float_stats", None)  # built only where SSE2 runs it faster than numpy
    return fn if fn is not None and same_as_numpy(fn) else None


def same_as_numpy(fn: _PassFn) -> bool:
    """Whether ``fn`` gives numpy's minimum and maximum exactly and its sum of squares to float64
    rounding, and a sum that is not finite wherever an element is NaN or infinite."""
    x32 = (np.random.default_rng(0).standard_normal(1003) * 3).astype(np.float32)
    bf16 = (x32.view(np.uint32) >> 16).astype(np.uint16)  # bfloat16 bits, without ml_dtypes
    for x, wide in ((x32, x32), (bf16, (bf16.astype(np.uint32) << 16).view(np.float32))):
        wide = wide.astype(np.float64)
        lo, hi, total = fn(x, x.itemsize)
        want = float(np.dot(wide, wide))
        if (lo, hi) != (wide.min(), wide.max()) or not abs(total - want) <= 1e-12 * want:
            return False
        for bad in (np.nan, np.inf, -np.inf):
            y = x32.copy()
            y[1000] = bad
            if x.itemsize == 2:
                y = (y.view(np.uint32) >> 16).astype(np.uint16)
            if math.isfinite(fn(y, y.itemsize)[2]):
                return False
    return True


COMPILED = compiled()


def measure(flat: np.ndarray[Any, Any]) -> tuple[float, float, float] | None:
    """(minimum, maximum, sum of squares in float64) of the elements of ``flat`` (1-D) in one
    compiled pass; a NaN or an infinity makes the sum NaN or infinite. None where the pass does
    not apply: not built, a dtype other than float32 and bfloat16, or ``flat`` not contiguous."""
    width = WIDTHS.get(flat.dtype.name)
    if COMPILED is None or width is None or not flat.flags.c_contiguous:
        return None
    return COMPILED(flat, width)
