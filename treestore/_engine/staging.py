"""Host memory that a load onto an accelerator reads into, reused from one group of leaves to the
next instead of allocated afresh.

A load onto an accelerator reads its whole leaves in groups (:mod:`treestore._engine.load`) and
starts each group's copies to the devices before reading the next. The host arrays a group is
read into are only the source of those copies (for the leaves whose template leaf is a jax
array or an abstract one): :class:`Staging` hands out views of one of two buffers for them, and
before a buffer takes a new group it waits for the copies made from it.
New memory costs a page fault per page on first touch (on a TPU v5e host, filling 2 GiB of new
memory took 2.23 s, refilling it 0.99 s); two buffers, faulted in once, are what a load holds
on the host.

A value made from a buffer that is not a copy on an accelerator's own memory (a numpy template
leaf, or a jax array on a CPU device, which may use the host bytes in place) is copied out of it
(:meth:`Arena.detach`): nothing a load returns shares memory with the buffers.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from treestore._engine.memory import ALIGN, allocate
from treestore._tree.jax_import import jax


class Arena:
    """One buffer, handed out front to back as aligned arrays to the leaves at ``addresses``
    (:meth:`allocate`, the signature of :func:`treestore._engine.memory.allocate`); other
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
    """Whether jax array ``x`` lives in an accelerator's own memory (never in host bytes)."""
    try:
        kind = x.sharding.memory_kind
        return all(d.platform != "cpu" for d in x.devices()) and kind in (None, "device")
    except Exception:  # deleted, abstract: trusted with nothing
        return False


class Staging:
    """Two buffers of ``nbytes`` each that groups of leaves are read into in turn
    (:meth:`next`); the values made from a group are handed to :meth:`placed`, and waited for
    before its buffer is read into again."""

    def __init__(self, name: str, nbytes: int, buffers: int = 2) -> None:
        self.name = name  # the checkpoint, for an allocation's error
        self.nbytes = nbytes
        self._buffers: list[np.ndarray[Any, Any] | None] = [None] * buffers
        self._placed: list[list[Any]] = [[] for _ in range(buffers)]
        self._turn = -1

    def next(self, addresses: set[str]) -> Arena:
        """The next buffer, for the leaves at ``addresses``, once the copies made from it
        before have finished."""
        self._turn = turn = (self._turn + 1) % len(self._buffers)
        if self._placed[turn]:
            jax.block_until_ready(self._placed[turn])
            self._placed[turn] = []
        buf = self._buffers[turn]
        if buf is None:
            buf = self._buffers[turn] = _new_buffer(self.nbytes, self.name)
        return Arena(buf, addresses)

    def placed(self, values: list[Any]) -> None:
        """The values made from the current buffer: waited for before it is read into again."""
        self._placed[self._turn] = values


def _new_buffer(nbytes: int, checkpoint: str) -> np.ndarray[Any, Any]:
    """A buffer of ``nbytes``; its pages are faulted in by the threads that first decode into it.
    (Faulting them in by one call, MAP_POPULATE, before reading made a TPU v5e host's load of
    the 2.6 GB decoder slower, 1.08 s against 0.74-0.87 s: that call runs on one thread.)"""
    return allocate(nbytes, "(staging)", checkpoint)


__all__ = ["Arena", "Staging"]
