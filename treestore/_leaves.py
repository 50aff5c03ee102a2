"""Leaves: what kinds of values treestore stores, and how each is turned into bytes and back.

Array-like leaves (numpy arrays, jax arrays, numpy scalars, typed PRNG key arrays) become a dtype,
a shape and C-ordered little-endian bytes. Python scalars (int, float, bool, complex, str, bytes)
are stored as values in the manifest and restored as the same type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import ml_dtypes
import numpy as np

from ._address import encodable
from ._errors import UnsupportedFormatError, UnsupportedLeafError

# Every dtype a store may name. Never resolved by eval or import: only looked up here.
_NUMPY_NAMES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
]
_ML_NAMES = [
    "bfloat16",
    "float8_e3m4",
    "float8_e4m3",
    "float8_e4m3b11fnuz",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn",
    "float6_e2m3fn",
    "float6_e3m2fn",
    "int2",
    "int4",
    "uint2",
    "uint4",
]
DTYPES: dict[str, np.dtype[Any]] = {n: np.dtype(n) for n in _NUMPY_NAMES}
DTYPES.update({n: np.dtype(getattr(ml_dtypes, n)) for n in _ML_NAMES if hasattr(ml_dtypes, n)})

# Leaf kinds, as written in the manifest.
NUMPY, JAX, NPSCALAR, PRNG_KEY = "numpy", "jax", "npscalar", "prng_key"
PY_KINDS = {
    bool: "bool",
    int: "int",
    float: "float",
    complex: "complex",
    str: "str",
    bytes: "bytes",
}
ARRAY_KINDS = (NUMPY, JAX, NPSCALAR, PRNG_KEY)


_NAMES: dict[np.dtype[Any], str | None] = {}


def dtype_name(dtype: np.dtype[Any]) -> str | None:
    """The store name of a dtype, or None when treestore cannot store it."""
    try:
        return _NAMES[dtype]
    except KeyError:
        pass
    name = dtype.name
    found = name if name in DTYPES and DTYPES[name] == dtype.newbyteorder("=") else None
    if len(_NAMES) < 1000:
        _NAMES[dtype] = found
    return found


def dtype_from_name(name: object, *, address: str = "", checkpoint: str | None = None) -> np.dtype[Any]:
    if isinstance(name, str) and name in DTYPES:
        return DTYPES[name]
    raise UnsupportedFormatError(
        f"{address or '(root)'}: unknown dtype {name!r}; this treestore knows {sorted(DTYPES)}",
        address=address,
        checkpoint=checkpoint,
    )


@dataclass(frozen=True)
class ArrayLeaf:
    """An array-like leaf ready to store: its kind, dtype name, and host data (C order, LE).

    A sharded jax.Array is not gathered: ``parts`` holds (start index, host data) of each shard
    this process owns (replica 0 only), ``data`` is None, and ``global_shape`` is its shape.
    """

    kind: str
    dtype: str
    data: np.ndarray[Any, Any] | None
    prng_impl: str | None = None
    parts: tuple[tuple[tuple[int, ...], np.ndarray[Any, Any]], ...] = ()
    global_shape: tuple[int, ...] | None = None
    weak_type: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        if self.global_shape is not None:
            return self.global_shape
        assert self.data is not None
        return tuple(self.data.shape)

    @property
    def sharded(self) -> bool:
        return self.global_shape is not None


@dataclass(frozen=True)
class ValueLeaf:
    """A Python scalar leaf, stored in the manifest as its value."""

    kind: str
    value: object


Leaf = ArrayLeaf | ValueLeaf


def _host(array: np.ndarray[Any, Any], copy: bool = False) -> np.ndarray[Any, Any]:
    """C-contiguous little-endian host data; the caller's array is never modified."""
    if array.dtype.byteorder == ">":
        return array.astype(array.dtype.newbyteorder("<"))
    return array.copy(order="C") if copy or not array.flags.c_contiguous else array


def prepare_leaf(value: object, address: str, *, copy: bool = False) -> Leaf:
    """Classify one leaf, or raise UnsupportedLeafError naming its address and type.

    jax arrays are copied to host here, once.
    """
    kind = PY_KINDS.get(type(value))
    if kind is not None:
        if kind == "str" and not encodable(value):  # type: ignore[arg-type]
            raise UnsupportedLeafError(
                f"{address or '(root)'}: str leaf is not valid Unicode text (lone surrogate)",
                address=address,
            )
        return ValueLeaf(kind, value)
    if isinstance(value, jax.Array):
        impl = None
        kind = JAX
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            kind, impl = PRNG_KEY, str(jax.random.key_impl(value))
            value = jax.random.key_data(value)
        name = _checked_name(np.dtype(value.dtype), address)
        weak = bool(getattr(value, "weak_type", False))
        parts = _owned_shards(value)
        if parts is None:
            return ArrayLeaf(kind, name, _host(_whole(value), copy), impl, weak_type=weak)
        shards = tuple((s, _host(d, copy)) for s, d in parts)
        return ArrayLeaf(kind, name, None, impl, shards, tuple(value.shape), weak)
    if isinstance(value, np.ndarray):
        return ArrayLeaf(NUMPY, _checked_name(value.dtype, address), _host(value, copy))
    if isinstance(value, np.generic):
        data = np.asarray(value)
        return ArrayLeaf(NPSCALAR, _checked_name(data.dtype, address), _host(data))
    raise UnsupportedLeafError(
        f"{address or '(root)'}: cannot store a leaf of type {type(value).__module__}."
        f"{type(value).__qualname__}; treestore stores numpy and jax arrays, numpy scalars, "
        "PRNG keys, and Python int, float, bool, complex, str and bytes",
        address=address,
    )


def _whole(x: jax.Array) -> np.ndarray[Any, Any]:
    """Host data of an unsharded or fully replicated array, copied from one device."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(x.addressable_data(0))


def _owned_shards(x: jax.Array) -> list[tuple[tuple[int, ...], np.ndarray[Any, Any]]] | None:
    """(start, host data) of the shards of ``x`` this process writes, or None when ``x`` is
    not sharded (one device, or every device holds all of it)."""
    sharding = x.sharding
    if sharding.is_fully_replicated or len(sharding.device_set) == 1:
        return None
    parts = []
    for shard in x.addressable_shards:
        if shard.replica_id != 0:  # one replica owner writes each distinct shard
            continue
        start = tuple(0 if s.start is None else int(s.start) for s in shard.index)
        parts.append((start, np.asarray(shard.data)))
    return parts


def _checked_name(dtype: np.dtype[Any], address: str) -> str:
    name = dtype_name(dtype)
    if name is None:
        raise UnsupportedLeafError(
            f"{address or '(root)'}: cannot store arrays of dtype {dtype}", address=address
        )
    return name


def value_to_record(kind: str, value: object) -> object:
    """A Python scalar as a msgpack-able value (big ints and complex numbers as text/pairs)."""
    if kind == "int":
        assert isinstance(value, int)
        return value if -(2**63) <= value < 2**64 else str(value)
    if kind == "complex":
        assert isinstance(value, complex)
        return [value.real, value.imag]
    return value


def value_from_record(kind: str, record: object) -> object:
    """The inverse of :func:`value_to_record`; raises ValueError on a record of the wrong type."""
    if kind == "bool" and type(record) is bool:
        return record
    if kind == "int" and type(record) is int:
        return record
    if kind == "int" and type(record) is str and len(record) <= 4300:
        return int(record)
    if kind == "float" and type(record) is float:
        return record
    if kind == "complex" and isinstance(record, list) and len(record) == 2:
        re_, im = record
        if type(re_) is float and type(im) is float:
            return complex(re_, im)
    if kind == "str" and type(record) is str:
        return record
    if kind == "bytes" and type(record) is bytes:
        return record
    raise ValueError(f"a {kind} leaf cannot hold {type(record).__name__}")


def restore_array(
    kind: str,
    data: np.ndarray[Any, Any],
    prng_impl: str | None,
    *,
    as_jax: bool | None = None,
    weak_type: bool = False,
) -> object:
    """Turn host data back into the leaf type it was saved as (or as the template asks)."""
    if kind == PRNG_KEY:
        return jax.random.wrap_key_data(jax.numpy.asarray(data), impl=prng_impl)
    if kind == NPSCALAR and as_jax is not True:
        return data[()]
    if as_jax if as_jax is not None else kind == JAX:
        array = jax.numpy.asarray(data)
        return _weakly_typed(array) if weak_type else array
    return data


def _weakly_typed(array: jax.Array) -> jax.Array:
    """``array`` as a weakly typed value (as Python scalars become in jax), so that a restored
    training state promotes dtypes exactly as the saved one did."""
    try:
        from jax._src.lax import lax as lax_internal  # no public API makes weak types

        return lax_internal._convert_element_type(array, array.dtype, weak_type=True)
    except (ImportError, AttributeError, TypeError):  # a jax without it: strongly typed
        return array


PRNG_IMPLS = {"threefry2x32": 2, "rbg": 4, "unsafe_rbg": 4}  # impl -> words of key data
NOT_IN_JAX = frozenset({"float6_e2m3fn", "float6_e3m2fn"})  # numpy holds them, jax does not
