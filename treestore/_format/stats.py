"""Per-leaf statistics of the values a save stored (the optional ``stats`` column of a version-2
manifest): how many elements are NaN, +inf and -inf, the smallest and largest finite element,
and the sum of the squares of the finite elements (the L2 norm squared), accumulated in float64.
A complex leaf is measured as the real numbers that make it up (each element's real and imaginary
parts): its counts are of parts, and its L2 norm is the norm of the complex vector.

A save measures each chunk on the thread that hashes and compresses it (the bytes are in cache
then) and combines the chunks' records into the leaf's exactly: counts add, minima and maxima
combine, sums of squares add. A multi-process save combines each process's records of its
pieces the same way (:func:`combine`), and since a process stores only the shards of replica 0,
every element is counted once.

Readers treat the column as hostile input (:func:`check_column`): a column of the wrong size is
ignored whole, a record that makes no sense for its leaf (a count beyond its elements, a negative
or NaN sum of squares, a minimum above the maximum, a kind that is not its dtype's) is ignored
alone, and the rest of the manifest is read as always. Statistics are shown and may steer
retention; nothing else trusts them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from treestore._kernels import float_pass as _float_pass
from treestore._kernels.scratch import scratch

# Record kinds: how ``min`` and ``max`` are read (the 8 bytes as float64, int64 or uint64).
# COMPLEX: a complex leaf's parts (2 per element) measured as FLOAT ones.
UNKNOWN, FLOAT, INT, UINT, COMPLEX = 0, 1, 2, 3, 4
REAL = (FLOAT, COMPLEX)  # kinds of real numbers: NaN/inf counts, float64 min and max
STATS_DTYPE = np.dtype(
    [
        ("kind", "u1"),
        ("nan", "<u8"),
        ("posinf", "<u8"),
        ("neginf", "<u8"),
        ("min", "<i8"),  # the bits of a float64 (FLOAT), an int64 (INT) or a uint64 (UINT)
        ("max", "<i8"),
        ("sumsq", "<f8"),  # sum of the squares of the finite elements, in float64
    ]
)
assert STATS_DTYPE.itemsize == 49

_FLOATS = [
    "float16",
    "float32",
    "float64",
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
]
_INTS = {"int8": 8, "int16": 16, "int32": 32, "int64": 64, "int2": 2, "int4": 4}
_UINTS = {"bool": 1, "uint8": 8, "uint16": 16, "uint32": 32, "uint64": 64, "uint2": 2, "uint4": 4}
_SUB_BYTE = {"int2": np.int8, "int4": np.int8, "uint2": np.uint8, "uint4": np.uint8}
_PARTS = {"complex64": np.float32, "complex128": np.float64}  # the real type of a complex one
KIND_OF: dict[str, int] = (
    {n: FLOAT for n in _FLOATS}
    | dict.fromkeys(_INTS, INT)
    | dict.fromkeys(_UINTS, UINT)
    | dict.fromkeys(_PARTS, COMPLEX)
)

# A record is (kind, nan, posinf, neginf, min, max, sumsq) with min and max as Python numbers.
Record = tuple[int, int, int, int, Any, Any, float]
_EMPTY: dict[int, Record] = {
    FLOAT: (FLOAT, 0, 0, 0, math.inf, -math.inf, 0.0),
    COMPLEX: (COMPLEX, 0, 0, 0, math.inf, -math.inf, 0.0),
    INT: (INT, 0, 0, 0, 2**63 - 1, -(2**63), 0.0),
    UINT: (UINT, 0, 0, 0, 2**64 - 1, 0, 0.0),
}
UNKNOWN_RECORD: Record = (UNKNOWN, 0, 0, 0, 0, 0, 0.0)
ROW = 8192  # elements per dot product (OpenBLAS runs a longer one on threads of its own, which
# fight the save's threads for the cores: a whole chunk's dot costs ten times a loop of short ones)
SPAN = 32 * ROW  # elements converted per step (their float64 copy, 2 MiB, stays in the core's cache)


def kind_of(dtype_name: str) -> int:
    """The record kind of a leaf of dtype ``dtype_name`` (UNKNOWN for a dtype without one)."""
    return KIND_OF.get(dtype_name, UNKNOWN)


def empty(kind: int) -> Record:
    """The record of no elements: what :func:`combine` starts from."""
    return _EMPTY.get(kind, UNKNOWN_RECORD)


def _buffer(name: str, dtype: type, size: int) -> np.ndarray:
    """This thread's scratch array ``name`` of ``size`` (at most SPAN) elements."""
    return scratch(size * np.dtype(dtype).itemsize, f"stats_{name}").view(dtype)


def _sumsq(x: np.ndarray) -> float:
    """Sum of squares of the (finite, real) elements of ``x`` (1-D, contiguous) in float64: spans
    of SPAN elements are converted into a per-thread buffer (a float64 copy of a whole chunk would
    cost more than the rest of the statistics together) and squared and summed there, ROW elements
    per dot product, all of a span's in one call. Squares beyond float64 make it inf (float64
    leaves of elements over 1e154)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return _sumsq_blocks(x)


def _sumsq_blocks(x: np.ndarray) -> float:
    total = 0.0
    for i in range(0, x.size, SPAN):
        part = x[i : i + SPAN]
        if part.dtype != np.float64:
            wide = _buffer("wide", np.float64, part.size)
            np.copyto(wide, part, casting="unsafe")
            part = wide
        total += _dots(part)
    return total


def _dots(b: np.ndarray) -> float:
    """The sum of the squares of float64 ``b`` (at most SPAN elements): a stacked product of its
    rows of ROW elements, each a short dot product, and one for the rest."""
    whole = b.size - b.size % ROW
    total = 0.0
    if whole:
        rows = b[:whole].reshape(-1, 1, ROW)
        total += float(np.matmul(rows, rows.transpose(0, 2, 1)).sum())
    if whole < b.size:
        rest = b[whole:]
        total += float(np.dot(rest, rest))
    return total


def _as_float(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``x`` as float32 or float64, every value exact (bfloat16 by moving its bits: numpy's
    conversion of extended types is far slower); into ``out`` (uint32, ``x``'s size) if given."""
    if x.dtype in (np.float32, np.float64):
        return x
    if x.dtype.name == "bfloat16":
        if out is None:
            out = np.empty(x.size, np.uint32)
        np.copyto(out, x.view(np.uint16))
        out <<= 16  # in place: one float32-sized array, not two
        return out.view(np.float32)
    if out is None:
        return x.astype(np.float32)
    wide = out.view(np.float32)
    np.copyto(wide, x, casting="unsafe")
    return wide


def _numeric(flat: np.ndarray, kind: int) -> np.ndarray:
    """``flat`` as a dtype numpy reduces: floats as float32 or float64 (:func:`_as_float`),
    bools as uint8, sub-byte integers widened to a byte."""
    if kind == FLOAT:
        return _as_float(flat)
    if flat.dtype == np.bool_:
        return flat.view(np.uint8)
    if flat.dtype.name in _SUB_BYTE:
        return flat.astype(_SUB_BYTE[flat.dtype.name])
    return flat


def parts(dtype_name: str) -> int:
    """The real numbers a record counts per element of ``dtype_name``: 2 for a complex dtype."""
    return 2 if dtype_name in _PARTS else 1


def measure(values: np.ndarray) -> Record:
    """The record of the elements of ``values`` (any shape; UNKNOWN for a dtype without one)."""
    kind = kind_of(values.dtype.name)
    if kind == UNKNOWN or values.size == 0:
        return empty(kind)
    flat = values.reshape(-1)
    if kind == COMPLEX:  # its parts, as a float leaf of twice the elements
        return (COMPLEX, *measure(flat.view(_PARTS[flat.dtype.name]))[1:])
    if kind != FLOAT:
        x = _numeric(flat, kind)
        return (kind, 0, 0, 0, int(x.min()), int(x.max()), _sumsq(x))
    found = _float_pass.measure(flat)  # one compiled pass, where it was built
    if found is not None:
        lo, hi, total = found  # a NaN or inf makes the sum NaN or inf
        if math.isfinite(total):
            return (FLOAT, 0, 0, 0, lo, hi, total)
        return _measure_nonfinite(_as_float(flat))
    # a span at a time (narrow floats widened to float32 in this thread's buffer), so that each
    # pass after the first reads the span from the core's cache
    narrow = flat.dtype not in (np.float32, np.float64)
    lo, hi, total = math.inf, -math.inf, 0.0
    for i in range(0, flat.size, SPAN):
        part = flat[i : i + SPAN]
        x = _as_float(part, _buffer("narrow", np.uint32, part.size)) if narrow else part
        a, b = float(x.min()), float(x.max())  # NaN when any element is NaN, ±inf when any is
        if not (math.isfinite(a) and math.isfinite(b)):
            return _measure_nonfinite(_as_float(flat))
        lo, hi, total = min(lo, a), max(hi, b), total + _sumsq(x)
    return (FLOAT, 0, 0, 0, lo, hi, total)


def _measure_nonfinite(x: np.ndarray) -> Record:
    """The record of float32 or float64 ``x`` (1-D) that holds a NaN or an infinity."""
    finite = np.isfinite(x)
    nan = int(np.count_nonzero(np.isnan(x)))
    posinf = int(np.count_nonzero(x == np.inf))
    kept = x[finite]
    if not kept.size:
        return (FLOAT, nan, posinf, x.size - nan - posinf, math.inf, -math.inf, 0.0)
    neginf = x.size - kept.size - nan - posinf
    return (FLOAT, nan, posinf, neginf, float(kept.min()), float(kept.max()), _sumsq(kept))


def measure_segments(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The records of the consecutive segments of ``values`` (1-D, one dtype; segment k is
    ``values[starts[k]:starts[k + 1]]``, the last running to the end, none empty), each what
    :func:`measure` gives it, as rows of a ``stats`` column (:func:`column`), in a few passes
    over all of them and no Python object per segment: a pack of thousands of small leaves
    costs about what one leaf of its size does. Sums of squares are of float64 squares, added
    in float64."""
    kind = kind_of(values.dtype.name)
    out = np.zeros(len(starts), STATS_DTYPE)
    if kind == UNKNOWN:
        return out
    if kind == COMPLEX:
        out = measure_segments(values.view(_PARTS[values.dtype.name]), starts * 2)
        out["kind"] = COMPLEX
        return out
    x = _numeric(values, kind)
    lo, hi = np.minimum.reduceat(x, starts), np.maximum.reduceat(x, starts)
    if kind == FLOAT and not (np.isfinite(lo).all() and np.isfinite(hi).all()):
        ends = [*starts[1:].tolist(), values.size]
        return column([measure(values[a:b]) for a, b in zip(starts.tolist(), ends, strict=True)])
    with np.errstate(over="ignore", invalid="ignore"):
        squares = x.astype(np.float64)
        out["sumsq"] = np.add.reduceat(np.square(squares, out=squares), starts)
    out["kind"] = kind
    bits = {FLOAT: "<f8", INT: "<i8", UINT: "<u8"}[kind]
    out["min"], out["max"] = lo.astype(bits).view("<i8"), hi.astype(bits).view("<i8")
    return out


def combine(records: Any, kind: int) -> Record:
    """The record of the union of the elements ``records`` describe (records of one leaf, of
    kind ``kind``): exact, whatever their order; UNKNOWN when any record is."""
    out = empty(kind)
    if kind == UNKNOWN:
        return out
    if type(records) is list and len(records) == 1 and records[0] is not None and records[0][0] == kind:
        return records[0]  # a leaf in one chunk or pack member (most leaves of a big tree)
    for r in records:
        if r is None or r[0] != kind:
            return UNKNOWN_RECORD
        out = (
            kind,
            out[1] + r[1],
            out[2] + r[2],
            out[3] + r[3],
            min(out[4], r[4]),
            max(out[5], r[5]),
            out[6] + r[6],
        )
    return out


def column(records: list[Record]) -> np.ndarray:
    """Records as the ``stats`` column (STATS_DTYPE, one per leaf)."""
    out = np.zeros(len(records), STATS_DTYPE)
    if not records:
        return out
    kinds = np.array([r[0] for r in records], np.uint8)
    out["kind"] = kinds
    for j, name in ((1, "nan"), (2, "posinf"), (3, "neginf")):
        out[name] = [r[j] for r in records]
    out["sumsq"] = [r[6] for r in records]
    for j, name in ((4, "min"), (5, "max")):
        for kind, dtype in ((FLOAT, "<f8"), (COMPLEX, "<f8"), (INT, "<i8"), (UINT, "<u8")):
            rows = np.flatnonzero(kinds == kind)
            if len(rows):
                out[name][rows] = np.array([records[i][j] for i in rows.tolist()], dtype).view("<i8")
    return out


def records(table: np.ndarray) -> list[Record]:
    """The ``stats`` column as records (the inverse of :func:`column`)."""
    out: list[Record] = []
    f_lo, f_hi = table["min"].view("<f8"), table["max"].view("<f8")
    u_lo, u_hi = table["min"].view("<u8"), table["max"].view("<u8")
    for i, kind in enumerate(table["kind"].tolist()):
        if kind in REAL:
            lo, hi = float(f_lo[i]), float(f_hi[i])
        elif kind == UINT:
            lo, hi = int(u_lo[i]), int(u_hi[i])
        else:
            lo, hi = int(table["min"][i]), int(table["max"][i])
        row = table[i]
        out.append(
            (kind, int(row["nan"]), int(row["posinf"]), int(row["neginf"]), lo, hi, float(row["sumsq"]))
        )
    return out


def combine_columns(tables: list[np.ndarray], kinds: np.ndarray) -> np.ndarray:
    """Row by row, the records of the union of the elements the rows of ``tables`` describe
    (each table a column of one process's records of the same leaves, of kinds ``kinds``):
    :func:`combine` over whole columns at once, UNKNOWN where any process's record is not of
    its leaf's kind."""
    out = column([empty(int(k)) for k in kinds.tolist()])
    if not tables:
        return out
    stack = np.stack(tables)  # processes × leaves
    known = np.all(stack["kind"] == kinds, axis=0) & (kinds != UNKNOWN)
    for name in ("nan", "posinf", "neginf"):
        out[name] = stack[name].sum(axis=0, dtype=np.uint64)
    out["sumsq"] = stack["sumsq"].sum(axis=0)
    for name, pick in (("min", np.min), ("max", np.max)):
        for kind, dtype in ((FLOAT, "<f8"), (COMPLEX, "<f8"), (INT, "<i8"), (UINT, "<u8")):
            rows = np.flatnonzero(kinds == kind)
            if len(rows):
                out[name][rows] = pick(stack[name][:, rows].view(dtype), axis=0).view("<i8")
    out[~known] = np.zeros(1, STATS_DTYPE)
    return out


def _int_bounds(name: str) -> tuple[int, int]:
    if name in _INTS:
        bits = _INTS[name]
        return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    return 0, 2 ** _UINTS[name] - 1


def check_column(
    found: object, names: tuple[str, ...], codes: np.ndarray, measured: np.ndarray, elements: np.ndarray
) -> tuple[np.ndarray | None, str | None]:
    """The ``stats`` field of a manifest, checked as hostile input: (the column, with every record
    that makes no sense for its leaf made UNKNOWN; a note saying how many were, or None) or
    (None, why the whole field is ignored; None when there is none). Leaf i has dtype
    ``names[codes[i]]``, is measured at all when ``measured[i]`` (an array leaf that is not a PRNG
    key) and has ``elements[i]`` elements."""
    n = len(elements)
    if found is None:
        return None, None
    if isinstance(found, np.ndarray):
        found = found.tobytes()
    if type(found) is not bytes or len(found) != n * STATS_DTYPE.itemsize:
        held = f"{len(found)} bytes" if type(found) is bytes else f"a {type(found).__name__}"
        return (
            None,
            f"statistics ignored: the field holds {held}, not {n} records of {STATS_DTYPE.itemsize} bytes",
        )
    table = np.frombuffer(found, STATS_DTYPE).copy()
    by_code = np.array([kind_of(name) for name in names], np.uint8)
    expect = np.where(measured, by_code[np.minimum(codes, len(names) - 1)], UNKNOWN)
    # each field as a contiguous array: the records are 49 bytes, unaligned, and every step below
    # over a strided field view cost several times its contiguous pass
    kind = table["kind"].copy()
    ok = (kind == expect) | (kind == UNKNOWN)
    size = elements.astype(np.uint64) * np.where(kind == COMPLEX, 2, 1).astype(np.uint64)  # real parts
    nan, pos, neg = table["nan"].copy(), table["posinf"].copy(), table["neginf"].copy()
    with np.errstate(over="ignore"):
        ok &= (nan <= size) & (pos <= size - np.minimum(nan, size))
        used = np.minimum(nan + pos, size)
        ok &= neg <= size - used
        finite = size - np.minimum(nan + pos + neg, size)
    sumsq = table["sumsq"].copy()
    ok &= ~np.isnan(sumsq) & (sumsq >= 0)
    floats = np.isin(kind, REAL)
    ok &= floats | ((nan == 0) & (pos == 0) & (neg == 0))
    has = finite > 0
    ok &= has | (sumsq == 0)
    lo_f, hi_f = table["min"].copy().view("<f8"), table["max"].copy().view("<f8")
    with np.errstate(invalid="ignore", over="ignore"):
        ok &= ~(floats & has) | (np.isfinite(lo_f) & np.isfinite(hi_f) & (lo_f <= hi_f))
        top = np.maximum(np.abs(lo_f), np.abs(hi_f))
        big = top * top
        # Every finite square lies between the largest one and that times the count.
        slack = 1e-6 * big + 1e-300
        low = np.where(np.isinf(big), np.inf, big - slack)
        high = np.where(np.isinf(big), np.inf, big * finite.astype(np.float64) + slack)
        ok &= ~(floats & has) | ((sumsq >= low) & (sumsq <= high))
    for code in (INT, UINT):
        rows = np.flatnonzero((kind == code) & has & ok)
        for i in rows.tolist():
            lo, hi = (int(table["min"][i]), int(table["max"][i]))
            if code == UINT:
                lo, hi = lo % 2**64, hi % 2**64
            bounds = _int_bounds(names[int(codes[i])])
            if not bounds[0] <= lo <= hi <= bounds[1]:
                ok[i] = False
    bad = int(np.count_nonzero(~ok & (kind != UNKNOWN)))
    table[~ok] = np.zeros(1, STATS_DTYPE)
    note = f"statistics of {bad} leaves ignored: they make no sense for their leaves" if bad else None
    table.flags.writeable = False
    return table, note


__all__ = [
    "COMPLEX",
    "FLOAT",
    "INT",
    "REAL",
    "STATS_DTYPE",
    "UINT",
    "UNKNOWN",
    "UNKNOWN_RECORD",
    "Record",
    "check_column",
    "column",
    "combine",
    "combine_columns",
    "empty",
    "kind_of",
    "measure",
    "parts",
    "records",
]
