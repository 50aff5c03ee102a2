"""Templates for ``like=`` that hold none of the saved data.

A test that passes the saved tree itself as the template cannot tell a load that reads the store
from one that hands back the template's leaves. :func:`blank` keeps the template's structure,
leaf types, shapes, dtypes (weak types and shardings too) and replaces every value: arrays by
zeros, or with ``shapes=True`` jax arrays by ``jax.ShapeDtypeStruct``; Python scalars by their
type's zero. Save trees whose values are not all zeros, so that a template's value is never the
saved one by chance.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def blank_leaf(x: Any, *, shapes: bool = False) -> Any:
    """One template leaf of ``x``'s type, shape and dtype, holding zeros."""
    if _is_key(x):
        data = jnp.zeros_like(jax.random.key_data(x))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    if isinstance(x, jax.Array):
        if shapes:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=x.weak_type)
        return jax.device_put(jnp.zeros_like(x), x.sharding)
    if isinstance(x, np.ndarray):
        return np.zeros_like(x)
    if isinstance(x, np.generic):
        return x.dtype.type(0)
    if isinstance(x, (bool, int, float, complex, str, bytes)):
        return type(x)()
    return x  # a template leaf of another kind (a ShapeDtypeStruct, an unsupported object)


def blank(tree: Any, *, shapes: bool = False) -> Any:
    """``tree`` as a template without its data (see the module docstring)."""
    return jax.tree.map(lambda x: blank_leaf(x, shapes=shapes), tree)
