"""Memory for what a read makes: result arrays allocated aligned and refused beyond the machine's
memory, big ones faulted in with ordinary pages; and running out of memory reported as an
:class:`~treestore.errors.OutOfMemoryError` saying what was being made."""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import mmap
import os
import sys
from typing import Any

import numpy as np

from treestore._engine import libc as _libc
from treestore.errors import OutOfMemoryError


@functools.cache
def physical_memory() -> int:
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # not a POSIX system: no cap
        return 2**62


ALIGN = 64  # bytes; what jax's CPU client needs to use a host buffer in place
SMALL_PAGES_FROM = 4 * 2**20  # bytes from which a result is faulted in with ordinary pages
_MADV_NOHUGEPAGE = 15


def _small_pages(buf: np.ndarray[Any, Any]) -> None:
    """Undo the huge-page hint numpy gives a big new array before it is touched: where memory
    is fragmented, faulting in huge pages stalls on compaction (it made loads of GPT-2 shapes
    markedly slower). Best effort: nothing changes where madvise is missing or refuses."""
    madvise = _libc.madvise
    page = mmap.PAGESIZE
    start = buf.ctypes.data + (-buf.ctypes.data % page)
    length = (buf.ctypes.data + buf.nbytes - start) // page * page
    if madvise is not None and length > 0:
        madvise(start, length, _MADV_NOHUGEPAGE)


def allocate(
    shape: int | tuple[int, ...], address: str, checkpoint: str, dtype: Any = np.uint8
) -> np.ndarray[Any, Any]:
    """``np.empty``, aligned to :data:`ALIGN` bytes, with running out of memory reported as a
    TreestoreError naming the leaf.

    More than the machine's physical memory is refused before allocating: the operating system
    would grant it lazily and kill the process later.
    """
    dims = (shape,) if isinstance(shape, int) else shape
    nbytes = math.prod(dims) * np.dtype(dtype).itemsize
    if nbytes > physical_memory():
        raise OutOfMemoryError(
            f"{address or '(root)'}: {nbytes:,} bytes declared by checkpoint {checkpoint!r} exceed "
            f"this machine's {physical_memory():,} bytes of memory",
            address=address,
            checkpoint=checkpoint,
        )
    try:
        # 64-byte aligned: jax puts an aligned host array on a CPU device without copying it.
        buf = np.empty(nbytes + ALIGN - 1, np.uint8)
        if nbytes >= SMALL_PAGES_FROM:
            _small_pages(buf)
        at = -buf.ctypes.data % ALIGN
        return buf[at : at + nbytes].view(dtype).reshape(dims)
    except (MemoryError, ValueError) as exc:
        raise OutOfMemoryError(
            f"{address or '(root)'}: cannot allocate {shape} of {np.dtype(dtype).name} "
            f"for checkpoint {checkpoint!r}: {type(exc).__name__}",
            address=address,
            checkpoint=checkpoint,
        ) from None


def allocate_many(
    shapes: list[tuple[int, ...]], address: str, checkpoint: str, dtype: Any
) -> list[np.ndarray[Any, Any]]:
    """:func:`allocate` of several arrays (a leaf's device shards) as views of one allocation,
    each aligned to :data:`ALIGN` bytes: one memory check and one buffer, not one per shard."""
    itemsize = np.dtype(dtype).itemsize
    sizes = [math.prod(shape) * itemsize for shape in shapes]
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size + (-size % ALIGN))
    buf = allocate(starts[-1], address, checkpoint)
    return [
        buf[at : at + size].view(dtype).reshape(shape)
        for at, size, shape in zip(starts, sizes, shapes, strict=False)
    ]


class memory_named:
    """``with memory_named(doing, checkpoint):`` turns a MemoryError from any allocation while
    ``doing`` something (a manifest's objects, a tree being rebuilt) into OutOfMemoryError saying
    what, and naming ``checkpoint``: a reader raises only TreestoreErrors. (Allocations of leaf
    data name the leaf: :func:`allocate`.)

    The frames that failed still hold what they allocated until their traceback goes, so they
    are cleared first: otherwise making the new error can itself run out of memory."""

    def __init__(self, doing: str, checkpoint: str | None = None) -> None:
        self.doing, self.checkpoint = doing, checkpoint

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if kind is None or not issubclass(kind, MemoryError) or issubclass(kind, OutOfMemoryError):
            return
        _release(tb)
        raise OutOfMemoryError(
            f"out of memory {self.doing}: this process cannot hold what that needs",
            checkpoint=self.checkpoint,
        ) from None


def _release(tb: Any) -> None:
    """Clear the locals of the frames a traceback went through that are no longer running (the
    frame of the ``with`` statement and its callers still are: clearing one would raise, and
    under memory pressure even making that error fails)."""
    running = set()
    frame: Any = sys._getframe()
    while frame is not None:
        running.add(id(frame))
        frame = frame.f_back
    while tb is not None:
        # A generator's frame is left alone: clearing it closes the generator, running code.
        if id(tb.tb_frame) not in running and not tb.tb_frame.f_code.co_flags & _GENERATORS:
            with contextlib.suppress(RuntimeError):
                tb.tb_frame.clear()
        tb = tb.tb_next


_GENERATORS = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
