"""Statistics of jax arrays measured where they live: on the accelerator, not on the host.

The records are those of :mod:`treestore._format.stats` (SPEC.md §6.8). A jitted function cuts
a leaf's elements into blocks of :data:`BLOCK` and gives, per block, its NaN, +inf and -inf
counts, its finite minimum and maximum, and the sum of the squares of its finite elements scaled
by a power of two (so that no square overflows or underflows in float32), with that power. The
host adds the blocks' counts as integers and their sums of squares in float64, each scaled back
exactly, so counts, minima and maxima equal the host's and the L2 norm agrees to float32's
rounding of each block's sum (relative 10⁻⁶ at worst; sums are taken 256 elements at a time).

Only floating dtypes of at most 32 bits are measured here: their every value is exact in
float32. Other dtypes (integers, float64) keep the host's measurement as their chunks are
hashed. The function is compiled once per (shape, dtype, sharding) and kept for the process;
the shapes a save meets for the first time are compiled side by side, at most
:data:`COMPILE_THREADS` at once (on a TPU each compile takes a second or two, a model has a
handful of leaf shapes, and each compile in flight holds tens of MB of host memory, which a save
keeps within a fraction of the tree's bytes), and the memory the compilers worked in is given
back to the system after them. Every leaf's block results travel to
the host in one transfer.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import math
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from treestore._engine import libc as _libc
from treestore._engine import threads as _threads
from treestore._format import stats as _stats
from treestore._tree.jax_import import jax

BLOCK = 256 * 256  # elements per block: counts stay exact in float32 (< 2**24)
COMPILE_THREADS = 4  # new leaf shapes compiled at once, at most (and at most one per core)
_FIELDS = 7  # nan, posinf, neginf, min, max, scaled sum of squares, exponent of the scale


def measurable(dtype: np.dtype[Any]) -> bool:
    """Whether leaves of ``dtype`` are measured on the device (floats of at most 32 bits)."""
    return _stats.kind_of(dtype.name) == _stats.FLOAT and dtype.itemsize <= 4


@functools.cache
def _kernel() -> Any:
    jnp = jax.numpy

    def blocks(x: Any) -> Any:
        flat = x.reshape(-1).astype(jnp.float32)
        n = flat.size
        count = max(1, -(-n // BLOCK))
        # Padded with NaN: the host takes the padding off the last block's NaN count, and NaN
        # touches no minimum, maximum or sum of squares.
        v = jnp.pad(flat, (0, count * BLOCK - n), constant_values=jnp.nan).reshape(count, 256, 256)

        def total(mask: Any) -> Any:
            return jnp.sum(mask.astype(jnp.float32), axis=(1, 2))

        finite = jnp.isfinite(v)
        nan = total(jnp.isnan(v))
        posinf = total(v == jnp.inf)
        neginf = total(v == -jnp.inf)
        lo = jnp.min(jnp.where(finite, v, jnp.inf), axis=(1, 2))
        hi = jnp.max(jnp.where(finite, v, -jnp.inf), axis=(1, 2))
        top = jnp.max(jnp.where(finite, jnp.abs(v), 0.0), axis=(1, 2))
        _, exponent = jnp.frexp(top)  # top = m * 2**exponent, 0.5 <= m < 1 (0 for top = 0)
        scaled = jnp.where(finite, jnp.ldexp(v, -exponent[:, None, None]), 0.0)
        sumsq = jnp.sum(jnp.sum(scaled * scaled, axis=2), axis=1)  # 256 at a time, then 256 more
        return jnp.stack([nan, posinf, neginf, lo, hi, sumsq, exponent.astype(jnp.float32)], axis=1)

    return jax.jit(blocks)


_compiled: dict[tuple[Any, ...], cf.Future[Any]] = {}  # (shape, dtype, sharding) -> executable
_compiling = threading.Lock()


def _key(x: Any) -> tuple[Any, ...]:
    return (x.shape, x.dtype, x.sharding)


def _executable(x: Any) -> Any:
    """The kernel compiled for arrays like ``x`` (compiled by the first thread to ask). A compile
    that failed is not kept: the next save tries again."""
    key = _key(x)
    try:
        return _threads.once(_compiled, key, _compiling, lambda: _kernel().lower(x).compile())
    except BaseException:
        with _compiling:
            done = _compiled.get(key)
            if done is not None and done.done() and done.exception() is not None:
                del _compiled[key]
        raise


def dispatch(arrays: Sequence[Any]) -> list[Any]:
    """Start measuring each jax array of ``arrays`` on its device; returns the block results
    (still on the devices) for :func:`records`. Nothing waits for the device here, once the
    kernel is compiled for every shape of ``arrays``."""
    new = {_key(x): x for x in arrays if _key(x) not in _compiled}
    if len(new) > 1:
        threads = min(os.cpu_count() or 1, COMPILE_THREADS)
        jobs = [functools.partial(_executable, x) for x in new.values()]
        _threads.run_all(jobs, threads, "compile")
        _libc.give_back_free_heap()  # the compilers' working memory: kept otherwise, by their threads
    return [_executable(x)(x) for x in arrays]


def fetch(results: Sequence[Any]) -> list[np.ndarray[Any, Any]]:
    """The block results of :func:`dispatch` on the host, in one transfer per device."""
    if not results:
        return []
    by_device: dict[Any, list[int]] = {}
    for i, r in enumerate(results):
        by_device.setdefault(next(iter(r.devices())), []).append(i)
    out: list[np.ndarray[Any, Any]] = [np.empty((0, _FIELDS), np.float32)] * len(results)
    for rows in by_device.values():
        parts = [results[i] for i in rows]
        joined = np.asarray(jax.numpy.concatenate(parts) if len(parts) > 1 else parts[0])
        at = 0
        for i in rows:
            size = results[i].shape[0]
            out[i] = joined[at : at + size]
            at += size
    return out


def record(blocks: np.ndarray[Any, Any], size: int) -> _stats.Record:
    """The record of a leaf of ``size`` elements from its block results."""
    if size == 0:
        return _stats.empty(_stats.FLOAT)
    counts = blocks[:, :3].astype(np.int64).sum(axis=0).tolist()
    counts[0] -= len(blocks) * BLOCK - size  # the padding
    finite = blocks[:, 3] <= blocks[:, 4]  # blocks with a finite element
    if not finite.any():
        return (_stats.FLOAT, counts[0], counts[1], counts[2], math.inf, -math.inf, 0.0)
    kept = blocks[finite]
    exponents = kept[:, 6].astype(np.int64)
    sumsq = float(np.ldexp(kept[:, 5].astype(np.float64), 2 * exponents).sum())
    lo, hi = float(kept[:, 3].min()), float(kept[:, 4].max())
    return (_stats.FLOAT, counts[0], counts[1], counts[2], lo, hi, sumsq)


def measure(arrays: Sequence[Any]) -> list[_stats.Record]:
    """The records of ``arrays`` (jax arrays of :func:`measurable` dtypes), measured on their
    devices and fetched together."""
    return [record(b, int(x.size)) for b, x in zip(fetch(dispatch(arrays)), arrays, strict=True)]


__all__ = ["BLOCK", "dispatch", "fetch", "measurable", "measure", "record"]
