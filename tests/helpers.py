"""Assertions shared by the tests."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def same_bytes(a: Any, b: Any) -> bool:
    """Equal dtype, shape and bytes (NaN-safe, works for bfloat16 and other ml_dtypes)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def assert_tree_equal(a: Any, b: Any, path: str = "") -> None:
    """Same container types, keys and order, leaf types, and leaf bytes."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_tree_equal(a[k], b[k], f"{path}/{k!r}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_tree_equal(x, y, f"{path}/{i}")
    elif isinstance(a, jax.Array) and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        assert a.dtype == b.dtype
        assert same_bytes(jax.random.key_data(a), jax.random.key_data(b)), path
    elif isinstance(a, (np.ndarray, np.generic, jax.Array)):
        assert same_bytes(a, b), f"{path}: {a!r} != {b!r}"
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
