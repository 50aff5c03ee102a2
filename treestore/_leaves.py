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
    """An array-like leaf ready to store: its kind, dtype name, and host data (C order, LE)."""

    kind: str
    dtype: str
    data: np.ndarray[Any, Any]
    prng_impl: str | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)


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
        if kind == "str" and not _encodable(value):  # type: ignore[arg-type]
            raise UnsupportedLeafError(
                f"{address or '(root)'}: str leaf is not valid Unicode text (lone surrogate)",
                address=address,
            )
        return ValueLeaf(kind, value)
    if isinstance(value, jax.Array):
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            impl = str(jax.random.key_impl(value))
            data = np.asarray(jax.random.key_data(value))
            return ArrayLeaf(PRNG_KEY, _checked_name(data.dtype, address), _host(data, copy), impl)
        data = np.asarray(value)
        return ArrayLeaf(JAX, _checked_name(data.dtype, address), _host(data, copy))
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


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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
    kind: str, data: np.ndarray[Any, Any], prng_impl: str | None, *, as_jax: bool | None = None
) -> object:
    """Turn host data back into the leaf type it was saved as (or as the template asks)."""
    if kind == PRNG_KEY:
        return jax.random.wrap_key_data(jax.numpy.asarray(data), impl=prng_impl)
    if kind == NPSCALAR and as_jax is not True:
        return data[()]
    if as_jax if as_jax is not None else kind == JAX:
        return jax.numpy.asarray(data)
    return data


PRNG_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
