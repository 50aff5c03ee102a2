"""The dtypes and leaf kinds a store may name, and how Python scalar leaves are recorded.

Every dtype is looked up in a table here, never resolved by eval or import."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from treestore._format.limits import INT_END, INT_START, MAX_INT_DIGITS
from treestore.errors import UnsupportedFormatError

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


# The extended types ml_dtypes defines, with their item sizes (tests check these against ml_dtypes).
# They are named here so that reading a manifest never imports ml_dtypes: a fresh install of it
# takes most of a second to import, and only array bytes of these types need the class itself.
ML_ITEMSIZES = {
    "bfloat16": 2,
    "float8_e3m4": 1,
    "float8_e4m3": 1,
    "float8_e4m3b11fnuz": 1,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn": 1,
    "float6_e2m3fn": 1,
    "float6_e3m2fn": 1,
    "int2": 1,
    "int4": 1,
    "uint2": 1,
    "uint4": 1,
}
NUMPY_NAMES = frozenset(_NUMPY_NAMES)
ITEMSIZES: dict[str, int] = {n: np.dtype(n).itemsize for n in _NUMPY_NAMES} | ML_ITEMSIZES


class _Dtypes(Mapping[str, "np.dtype[Any]"]):
    """Store dtype name -> numpy dtype. Names are known without importing ml_dtypes; an extended
    type's class is looked up (and ml_dtypes imported) only when its dtype is asked for."""

    def __init__(self) -> None:
        self._resolved: dict[str, np.dtype[Any]] = {n: np.dtype(n) for n in _NUMPY_NAMES}

    def __getitem__(self, name: str) -> np.dtype[Any]:
        found = self._resolved.get(name)
        if found is not None:
            return found
        if name not in ML_ITEMSIZES:
            raise KeyError(name)
        import ml_dtypes  # the only import of it: see ML_ITEMSIZES

        kind = getattr(ml_dtypes, name, None)
        if kind is None:  # an older ml_dtypes than the store's writer had
            raise KeyError(name)
        found = self._resolved[name] = np.dtype(kind)
        return found

    def __contains__(self, name: object) -> bool:
        return name in ITEMSIZES

    def __iter__(self) -> Iterator[str]:
        return iter(ITEMSIZES)

    def __len__(self) -> int:
        return len(ITEMSIZES)


DTYPES: Mapping[str, np.dtype[Any]] = _Dtypes()

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
    # An extended dtype's array exists, so ml_dtypes is imported already: no import happens here
    # for a numpy dtype, whose name is never one of ML_ITEMSIZES.
    found = name if name in DTYPES and _resolves_to(name, dtype.newbyteorder("=")) else None
    if len(_NAMES) < 1000:
        _NAMES[dtype] = found
    return found


def _resolves_to(name: str, dtype: np.dtype[Any]) -> bool:
    if name in NUMPY_NAMES or "ml_dtypes" in sys.modules:
        try:
            return DTYPES[name] == dtype
        except KeyError:
            return False
    return False


def dtype_from_name(name: object, *, address: str = "", checkpoint: str | None = None) -> np.dtype[Any]:
    """The numpy dtype a store name stands for (importing ml_dtypes for an extended type)."""
    if isinstance(name, str):
        try:
            return DTYPES[name]
        except KeyError:
            pass
    raise UnsupportedFormatError(
        f"{address or '(root)'}: unsupported dtype {name!r}; this treestore knows {sorted(DTYPES)}",
        address=address,
        checkpoint=checkpoint,
    )


# Canonical decimal text of a big int: ASCII digits, no leading zero, no '+', '_' or spaces.
_DECIMAL = re.compile(r"-?[1-9][0-9]*")
# Ints whose text fits MAX_INT_DIGITS characters: below 10**4300, or above -10**4299 (the sign).
_TEXT_END, _TEXT_START = 10**MAX_INT_DIGITS, -(10 ** (MAX_INT_DIGITS - 1))


def int_to_record(value: int) -> int | str:
    """An int leaf as stored: itself in [-2**63, 2**64), else its decimal text; ValueError when
    that text would exceed the MAX_INT_DIGITS characters readers accept."""
    if INT_START <= value < INT_END:
        return value
    if not _TEXT_START < value < _TEXT_END:
        digits = int(value.bit_length() * 0.30103) + 1
        raise ValueError(
            f"an int of about {digits} digits is too large: an int outside [-2**63, 2**64) is "
            f"stored as decimal text of at most {MAX_INT_DIGITS} characters, a sign included"
        )
    return str(value)


def int_from_record(record: object) -> int:
    """The inverse of :func:`int_to_record`: only what it writes, else ValueError."""
    if type(record) is int:
        return record
    if type(record) is str and len(record) <= MAX_INT_DIGITS and _DECIMAL.fullmatch(record):
        value = int(record)
        if not INT_START <= value < INT_END:
            return value
    raise ValueError(
        f"an int leaf holds a msgpack int or the canonical decimal text of an int outside "
        f"[-2**63, 2**64) of at most {MAX_INT_DIGITS} characters, found {record!r:.60}"
    )


def value_to_record(kind: str, value: object) -> object:
    """A Python scalar as a msgpack-able value (big ints and complex numbers as text/pairs);
    ValueError for an int too large to store."""
    if kind == "int":
        assert isinstance(value, int)
        return int_to_record(value)
    if kind == "complex":
        assert isinstance(value, complex)
        return [value.real, value.imag]
    return value


def value_from_record(kind: str, record: object) -> object:
    """The inverse of :func:`value_to_record`; raises ValueError on a record of the wrong type."""
    if kind == "bool" and type(record) is bool:
        return record
    if kind == "int":
        return int_from_record(record)
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


PRNG_IMPLS = {"threefry2x32": 2, "rbg": 4, "unsafe_rbg": 4}  # impl -> words of key data


NOT_IN_JAX = frozenset({"float6_e2m3fn", "float6_e3m2fn"})  # numpy holds them, jax does not
