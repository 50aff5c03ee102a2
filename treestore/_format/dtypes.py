"""The dtypes and leaf kinds a store may name, and how Python scalar leaves are recorded.

Every dtype is looked up in a table here, never resolved by eval or import."""

from __future__ import annotations

import re
from typing import Any

import ml_dtypes
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
