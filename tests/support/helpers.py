"""Assertions shared by the tests."""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np


def same_bytes(a: Any, b: Any) -> bool:
    """Equal dtype, shape and bytes (NaN-safe, works for bfloat16 and other ml_dtypes)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _scalar_bytes(x: Any) -> bytes:
    if type(x) is float:
        return np.float64(x).tobytes()
    if type(x) is complex:
        return np.complex128(x).tobytes()
    return repr(x).encode()


def is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def assert_leaf_equal(a: Any, b: Any, path: str = "") -> None:
    """Same leaf type; arrays: same dtype, shape and bytes (NaN-safe); scalars: same type and bits."""
    assert type(a) is type(b), f"{path or '(root)'}: {type(a)!r} != {type(b)!r}"
    if is_key(a):
        assert a.dtype == b.dtype, f"{path}: {a.dtype} != {b.dtype}"
        assert str(jax.random.key_impl(a)) == str(jax.random.key_impl(b)), path
        assert_leaf_equal(jax.random.key_data(a), jax.random.key_data(b), path)
    elif isinstance(a, (np.ndarray, np.generic, jax.Array)):
        x, y = np.asarray(a), np.asarray(b)
        assert x.dtype == y.dtype, f"{path}: dtype {x.dtype} != {y.dtype}"
        assert x.shape == y.shape, f"{path}: shape {x.shape} != {y.shape}"
        assert x.tobytes() == y.tobytes(), f"{path}: values differ:\n{x!r}\n{y!r}"
    elif isinstance(a, (bool, int, float, complex, str, bytes)):
        assert _scalar_bytes(a) == _scalar_bytes(b), f"{path}: {a!r} != {b!r}"
    else:
        raise AssertionError(f"{path}: unexpected leaf {a!r}")


def assert_tree_equal(a: Any, b: Any, path: str = "") -> None:
    """Same container types (recursively), same dict key order, and equal leaves."""
    assert type(a) is type(b), f"{path or '(root)'}: {type(a)!r} != {type(b)!r}"
    if a is None:
        return
    if isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_tree_equal(a[k], b[k], f"{path}/{k!r}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_tree_equal(x, y, f"{path}/{i}")
    elif isinstance(a, (np.ndarray, np.generic, jax.Array, bool, int, float, complex, str, bytes)):
        assert_leaf_equal(a, b, path)
    else:  # a registered custom node: same treedef, equal leaves
        ta, tb = jax.tree_util.tree_structure(a), jax.tree_util.tree_structure(b)
        assert ta == tb, f"{path}: {ta} != {tb}"
        for (p, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b), strict=True):
            assert_leaf_equal(x, y, f"{path}/{jax.tree_util.keystr(p)}")


def read_events(path: Any) -> list[tuple[str, str]]:
    """The ``WORD rest`` lines a test subprocess wrote to ``path`` (none if it wrote nothing)."""
    if not path.exists():
        return []
    return [(word, rest) for word, _, rest in (line.partition(" ") for line in path.read_text().splitlines())]


def in_use(url: str) -> str:
    """``url``, with every chunk folder made where it is a local folder, as in a store that has
    been saved to for a while: a save then asks about each chunk it does not trust (into a
    folder it makes itself, a save asks nothing: no chunk can be there yet)."""
    if "://" not in url:
        for i in range(256):
            os.makedirs(os.path.join(url, "chunks", f"{i:02x}"), exist_ok=True)
    return url
