"""Hypothesis strategies for pytrees and their leaves, shared by the property tests.

One builder per kind of thing a test draws (arrays, Python scalars, trees of them), each with the
parameters a test needs to draw its own variant (the dtypes it saves, hostile integers, no NaN
where the assertion cannot compare one) rather than a copy of the strategy.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

ARRAY_DTYPES: tuple[Any, ...] = (
    np.bool_,
    np.int8,
    np.int32,
    np.uint8,
    np.uint16,
    np.float32,
    np.float64,
    np.complex64,
    ml_dtypes.bfloat16,
)
"""Dtypes of every item size whose every bit pattern is a value (and bool)."""

_UINTS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def arrays(
    dtypes: Sequence[Any] = ARRAY_DTYPES, *, max_dims: int = 3, max_side: int = 5
) -> st.SearchStrategy[np.ndarray]:
    """Arrays of any of ``dtypes`` (each of 1, 2, 4 or 8 bytes, every bit pattern a value, or
    bool) with 0 to ``max_dims`` axes of 0 to ``max_side`` items. Elements are the values
    hypothesis draws for a numpy dtype (0.5, inf, NaN, often one value repeated, which is what
    compression and deduplication see) or arbitrary bit patterns (NaN payloads, subnormals): the
    latter drawn as unsigned integers of the item size viewed as the dtype, so bfloat16 and the
    other ml_dtypes draw as freely as numpy's own."""
    shapes = hnp.array_shapes(min_dims=0, max_dims=max_dims, min_side=0, max_side=max_side)
    return st.sampled_from([np.dtype(d) for d in dtypes]).flatmap(lambda dtype: _arrays_of(dtype, shapes))


def _arrays_of(dtype: np.dtype, shapes: st.SearchStrategy[tuple[int, ...]]) -> st.SearchStrategy[np.ndarray]:
    if dtype == np.bool_:
        return hnp.arrays(dtype, shapes)
    bits = hnp.arrays(_UINTS[dtype.itemsize], shapes).map(lambda a: a.view(dtype))
    return bits if dtype.type.__module__.startswith("ml_dtypes") else hnp.arrays(dtype, shapes) | bits


INTS = st.integers() | st.integers(-(2**70), 2**70)
"""Integers: unbounded draws, and draws bounded past the 64-bit range (which reach its edges)."""


def scalars(
    *,
    ints: st.SearchStrategy[int] | None = None,
    nan: bool = True,
    complex_numbers: bool = True,
    max_size: int = 8,
) -> st.SearchStrategy[Any]:
    """The Python scalars a tree can hold as leaves: None, bool, int (``ints``, INTS by
    default), float and complex (infinities, and NaN unless ``nan`` is false; no complex where
    ``complex_numbers`` is false, as msgpack values cannot hold one), str and bytes of up to
    ``max_size`` characters or bytes."""
    options = [
        st.none(),
        st.booleans(),
        INTS if ints is None else ints,
        st.floats(allow_nan=nan),
        st.text(max_size=max_size),
        st.binary(max_size=max_size),
    ]
    if complex_numbers:
        options.append(st.complex_numbers(allow_nan=nan))
    return st.one_of(options)


KEYS = st.text(max_size=6) | st.integers(-5, 5)
"""Dict keys: short strings and small integers (so that keys like 1 and "1" meet in one dict)."""

Container = Callable[[st.SearchStrategy[Any], st.SearchStrategy[Any], int], st.SearchStrategy[Any]]

CONTAINERS: dict[str, Container] = {
    "list": lambda children, keys, n: st.lists(children, max_size=n),
    "tuple": lambda children, keys, n: st.lists(children, max_size=n).map(tuple),
    "dict": lambda children, keys, n: st.dictionaries(keys, children, max_size=n),
    "OrderedDict": lambda children, keys, n: st.dictionaries(keys, children, max_size=n).map(
        lambda d: collections.OrderedDict(d.items())
    ),
}


def trees(
    leaves: st.SearchStrategy[Any],
    *,
    keys: st.SearchStrategy[Any] = KEYS,
    containers: Sequence[str] = ("list", "tuple", "dict"),
    max_size: int = 3,
    max_leaves: int = 8,
) -> st.SearchStrategy[Any]:
    """Trees of ``leaves`` nested in ``containers`` (names of CONTAINERS: builtin nodes, empty
    ones included) of up to ``max_size`` children, dicts keyed by ``keys``; a bare leaf is a tree
    too. With containers ("list", "dict") and scalars that msgpack encodes, these are the
    values of metadata and of a record's fields."""
    nodes = [CONTAINERS[name] for name in containers]
    return st.recursive(
        leaves,
        lambda children: st.one_of([node(children, keys, max_size) for node in nodes]),
        max_leaves=max_leaves,
    )
