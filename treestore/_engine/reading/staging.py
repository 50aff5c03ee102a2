"""Host memory that a load onto an accelerator reads into, reused from one group of leaves to the
next instead of allocated afresh.

A load onto an accelerator reads its whole leaves in groups (:mod:`treestore._engine.reading.load`) and
starts each group's copies to the devices before reading the next. The host arrays a group is
read into are only the source of those copies (for the leaves whose template leaf is a jax
array or an abstract one): :class:`Staging` hands out views of one of two buffers for them, and
before a buffer takes a new group it waits for the copies made from it. The values of a group
are made on a thread of their own while the next group is read: on a TPU host, starting a
group's copies took the loading thread a tenth of a load's time, during which no leaf was read.
New memory costs a page fault per page on first touch, which on a TPU host cost more than the
decoding (docs/benchmarks.md, "On an accelerator"); two buffers, faulted in once, are what a load
holds on the host.

A value made from a buffer that is not a copy on an accelerator's own memory (a numpy template
leaf, or a jax array on a CPU device, which may use the host bytes in place) is copied out of it
(:meth:`Arena.detach`): nothing a load returns shares memory with the buffers.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from treestore._engine.reading.memory import ALIGN, allocate
from treestore._engine.threads import shared_pool
from treestore._tree.jax_import import jax
from treestore._tree.leaves import off_cpu


class Arena:
    """One buffer, handed out front to back as aligned arrays to the leaves at ``addresses``
    (:meth:`allocate`, the signature of :func:`treestore._engine.reading.memory.allocate`); other
    leaves, and any once the buffer is used up, get fresh allocations."""

    def __init__(self, buf: np.ndarray[Any, Any], addresses: set[str]) -> None:
        self.buf = buf
        self.addresses = addresses
        self._at = 0

    def allocate(
        self, shape: int | tuple[int, ...], address: str, checkpoint: str, dtype: Any = np.uint8
    ) -> np.ndarray[Any, Any]:
        dims = (shape,) if isinstance(shape, int) else shape
        nbytes = math.prod(dims) * np.dtype(dtype).itemsize
        at = self._at + (-(self.buf.ctypes.data + self._at) % ALIGN)
        if address not in self.addresses or at + nbytes > len(self.buf):
            return allocate(dims, address, checkpoint, dtype)
        self._at = at + nbytes
        return self.buf[at : at + nbytes].view(dtype).reshape(dims)

    def detach(self, value: Any) -> Any:
        """``value``, or a copy of it where it may share this buffer's memory."""
        if isinstance(value, np.ndarray):
            return value.copy() if np.may_share_memory(value, self.buf) else value
        if isinstance(value, jax.Array) and not _on_accelerator(value):
            return jax.device_put(value, may_alias=False)
        return value


def _on_accelerator(x: Any) -> bool:
    """Whether jax array ``x`` lives in an accelerator's own memory (not on a CPU device, nor in
    an accelerator's host memory kinds): it never uses host bytes in place."""
    return off_cpu(x) and getattr(x.sharding, "memory_kind", None) in (None, "device")


class Staging:
    """Two buffers of ``nbytes`` each that groups of leaves are read into in turn (:meth:`next`).
    What a group's values are made by (the copies to the devices started) runs on a thread of
    its own (:meth:`place`) while the next group is read; a buffer is read into again once the
    values made from it are made and their copies finished."""

    def __init__(self, name: str, nbytes: int, buffers: int = 2) -> None:
        self.name = name  # the checkpoint, for an allocation's error
        self.nbytes = nbytes
        self._buffers: list[np.ndarray[Any, Any] | None] = [None] * buffers
        self._jobs: list[cf.Future[list[Any]] | None] = [None] * buffers
        self._all: list[cf.Future[list[Any]]] = []
        self._turn = -1

    def next(self, addresses: set[str]) -> Arena:
        """The next buffer, for the leaves at ``addresses``, once the values made from it
        before are made (their error raised here) and their copies have finished."""
        self._turn = turn = (self._turn + 1) % len(self._buffers)
        job = self._jobs[turn]
        if job is not None:
            jax.block_until_ready(job.result())
            self._jobs[turn] = None
        buf = self._buffers[turn]
        if buf is None:
            buf = self._buffers[turn] = _new_buffer(self.nbytes, self.name)
        return Arena(buf, addresses)

    def place(self, make: Callable[[], list[Any]]) -> None:
        """Run ``make``, which makes the values of the group in the current buffer (starting
        their copies to the devices), on the device-copy thread; :meth:`values` returns them."""
        self._jobs[self._turn] = job = shared_pool(1, "device-copy").submit(make)
        self._all.append(job)

    def values(self) -> list[list[Any]]:
        """What each :meth:`place` made, in order (waiting for the last; raising its error)."""
        return [job.result() for job in self._all]


def _new_buffer(nbytes: int, checkpoint: str) -> np.ndarray[Any, Any]:
    """A buffer of ``nbytes``; its pages are faulted in by the threads that first decode into it.
    (Faulting them in by one call, MAP_POPULATE, before reading made loads on a TPU host slower:
    that call runs on one thread; docs/benchmarks.md, "On an accelerator".)"""
    return allocate(nbytes, "(staging)", checkpoint)


__all__ = ["Arena", "Staging"]
