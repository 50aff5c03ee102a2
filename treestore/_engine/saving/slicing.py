"""The compiled programs that cut slices of rows from device arrays, for a save's fetch.

One program per (leaf shape, dtype, sharding, slice height, flat view): a sharded leaf's pieces
are fetched one by one, a program for each device. The programs used last are kept,
:data:`PROGRAMS` per local device (a program dropped is freed, jax's caches of it with it, and
compiled again if asked). A fetch asks for every program it will need before its first transfer
(:func:`compile_ahead`), and they are compiled :data:`COMPILERS` at once on threads of their
own: a cold save of leaves of several shapes waits for about one compile, not for each in turn.
"""

from __future__ import annotations

import collections
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from treestore._tree.jax_import import jax

PROGRAMS = 32  # compiled slicing programs kept per local device, the most recently used
COMPILERS = 4  # slicing programs compiled at once ahead of a fetch


def _slice_rows(rows: int, flat: bool) -> Any:
    """A jitted ``(x, start) -> rows`` rows of ``x`` (of its flat view when ``flat``): a new
    function for each program, so that jax's caches of what it compiled go with the program."""
    lax = jax.lax

    def take(x: Any, start: Any) -> Any:
        return lax.dynamic_slice_in_dim(x.reshape(-1) if flat else x, start, rows, 0)

    return jax.jit(take)


_programs: collections.OrderedDict[tuple[Any, ...], Future[Any]] = collections.OrderedDict()
_programs_lock = threading.Lock()


def slicer(x: Any, rows: int, flat: bool) -> Any:
    """The compiled program that takes ``rows`` rows of arrays like ``x`` from a start row (as
    :func:`start_of` types it), compiled here, or waited for where :func:`compile_ahead` started
    it; the programs used last are kept (:func:`_kept`; a program dropped is freed, and compiled
    again if asked). A compile that fails raises its error, and is tried again by the next call."""
    future, mine = _entry(x, rows, flat)
    if mine:
        _compile(future, x, rows, flat)
    return future.result()


def start_of(x: Any, flat: bool, start: int) -> np.integer[Any]:
    """The start row of a slice of ``x``, typed as its program was compiled for (int32, or
    int64 for a flat view of more than 2**31 elements): not left to the jax config of the
    calling thread, which may differ from the compiling one's (``jax.enable_x64``)."""
    return _start_type(x, flat).type(start)


def compile_ahead(wanted: list[tuple[Any, int, bool]]) -> None:
    """Start compiling, :data:`COMPILERS` at a time on threads of their own, the slicing programs
    of ``wanted`` ((array, rows, flat) each) not compiled yet, as many of them as are kept: a
    fetch that will cut slices of several shapes waits for one compile at a time at most, not
    for each in turn. Errors are raised by :func:`slicer`, when the program is asked for; where
    no thread can be started, the programs are compiled here."""
    if not wanted:  # nothing to slice (a tree of numpy leaves does not import jax)
        return
    keys = {_key(x, rows, flat): (x, rows, flat) for x, rows, flat in wanted}
    pool = None
    try:
        for x, rows, flat in list(keys.values())[: _kept()]:
            future, mine = _entry(x, rows, flat)
            if not mine:
                continue
            try:
                pool = pool or ThreadPoolExecutor(COMPILERS, thread_name_prefix="treestore-compile")
                pool.submit(_compile, future, x, rows, flat)
            except (RuntimeError, MemoryError):  # no thread to compile on: compile here
                _compile(future, x, rows, flat)  # (a job queued anyway finds it claimed)
            except BaseException as exc:  # interrupted: nobody is to wait on it
                _fail(future, _key(x, rows, flat), exc)
                raise
    finally:
        if pool is not None:
            pool.shutdown(wait=False)


def _kept() -> int:
    """How many programs are kept: :data:`PROGRAMS` for each device of this process."""
    return PROGRAMS * max(1, jax.local_device_count())


def _key(x: Any, rows: int, flat: bool) -> tuple[Any, ...]:
    return (x.shape, x.dtype, x.sharding, rows, flat)


def _start_type(x: Any, flat: bool) -> np.dtype[Any]:
    return np.dtype(np.int64 if flat and x.size >= 2**31 else np.int32)


def _entry(x: Any, rows: int, flat: bool) -> tuple[Future[Any], bool]:
    """The kept future of the program, and whether the caller is to compile it (it was not kept)."""
    key = _key(x, rows, flat)
    with _programs_lock:
        future = _programs.get(key)
        if future is not None:
            _programs.move_to_end(key)
            return future, False
        future = _programs[key] = Future()
        while len(_programs) > _kept():
            _programs.popitem(last=False)
        return future, True


def _compile(future: Future[Any], x: Any, rows: int, flat: bool) -> None:
    """Compile the program of ``future``, unless another thread has claimed it; one that fails
    is dropped from the kept set, and an interrupt raised again once the waiters are told."""
    with _programs_lock:
        if future.running() or future.done() or not future.set_running_or_notify_cancel():
            return
    key = _key(x, rows, flat)
    try:
        start = jax.ShapeDtypeStruct((), _start_type(x, flat))
        program = _slice_rows(rows, flat).lower(x, start).compile()
    except Exception as exc:
        _fail(future, key, exc)
    except BaseException as exc:
        _fail(future, key, exc)
        raise
    else:
        future.set_result(program)


def _fail(future: Future[Any], key: tuple[Any, ...], exc: BaseException) -> None:
    """Drop ``future`` from the kept set and tell its waiters (an interrupt, as an error of theirs)."""
    with _programs_lock:
        if _programs.get(key) is future:
            del _programs[key]
    if not future.done():
        if not isinstance(exc, Exception):
            exc = RuntimeError(f"compiling a slicing program was interrupted ({type(exc).__name__})")
        future.set_exception(exc)


__all__ = ["COMPILERS", "PROGRAMS", "compile_ahead", "slicer", "start_of"]
