"""Device arrays to host chunks, pipelined, in a bounded window of host memory.

A save of arrays that live on an accelerator does not copy the whole tree to the host first. A leaf
no bigger than a slice is moved to host memory whole, with no program; a bigger leaf is cut on its
device into slices of rows, by a slicing program compiled once per leaf shape, dtype, sharding and
slice height and kept in a bounded set (:data:`PROGRAMS`). So the programs a save compiles grow
with the distinct shapes of its leaves over a slice only, never with its many small ones. The
transfer of each piece to the host starts as soon as the window has room for it, so that the
transfers run ahead of the hashing and compression, and the host bytes of a piece are given back to
the window when the last chunk cut from it has been stored. Chunks are cut at the same boundaries
as a save from host memory (every ``chunk_size`` raw bytes of the leaf), so both store the same
chunk objects; a chunk that spans two slices is put together in a buffer of its own, which the
window counts.

The window holds a slice and the chunks that span its two ends: slices are made smaller where
the window is small, and a leaf whose single row is bigger than a slice is fetched through a flat
view of it.

Device memory: the slices in flight take at most the window's bytes on the devices. Where a
device has less room than that beside the training step's peak
(:func:`treestore._engine.saving.device_memory.room`), or a slicing program cannot be compiled,
loaded or run for want of memory, leaves are fetched whole instead: no device memory, at the
cost of host memory for the whole leaf. A transfer that fails raises
:class:`~treestore.errors.DeviceError` naming the leaf.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from treestore._engine.saving import device_memory
from treestore._tree.jax_import import jax
from treestore.errors import DeviceError

MiB = 2**20
SLICE = 16 * MiB  # bytes a slice aims at (several chunks: one transfer each)
PROGRAMS = 32  # compiled slicing programs kept, the most recently used


def chunk_step(itemsize: int, chunk_size: int) -> int:
    """Raw bytes per chunk of a leaf of ``itemsize``-byte elements: ``chunk_size`` rounded down
    to whole elements (one element at least)."""
    return max(itemsize, chunk_size // itemsize * itemsize)


class Window:
    """A budget of host bytes for slices fetched and chunks not yet stored; safe across threads.

    ``peak`` is the most bytes ever held at once (for tests and benchmarks).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.peak = 0
        self._cond = threading.Condition()

    def try_take(self, nbytes: int) -> bool:
        """Take ``nbytes`` if they fit (always, when nothing is held); whether they were taken."""
        with self._cond:
            if self.held and self.held + nbytes > self.limit:
                return False
            self.held += nbytes
            self.peak = max(self.peak, self.held)
            return True

    def take(self, nbytes: int, stuck: int = 0) -> None:
        """Take ``nbytes``, waiting until they fit, or until only ``stuck`` bytes are held (bytes
        that wait for these: the chunk a slice began, which the next slice finishes)."""
        with self._cond:
            self._cond.wait_for(lambda: self.held <= stuck or self.held + nbytes <= self.limit)
            self.held += nbytes
            self.peak = max(self.peak, self.held)

    def give(self, nbytes: int) -> None:
        with self._cond:
            self.held -= nbytes
            self._cond.notify_all()


@functools.cache
def _slice_rows(rows: int, flat: bool) -> Any:
    """A jitted ``(x, start) -> rows`` rows of ``x`` (of its flat view when ``flat``)."""
    lax = jax.lax

    def take(x: Any, start: Any) -> Any:
        return lax.dynamic_slice_in_dim(x.reshape(-1) if flat else x, start, rows, 0)

    return jax.jit(take)


_programs: collections.OrderedDict[tuple[Any, ...], Any] = collections.OrderedDict()
_programs_lock = threading.Lock()


def slicer(x: Any, rows: int, flat: bool) -> Any:
    """The compiled program that takes ``rows`` rows of arrays like ``x`` from a start row; the
    :data:`PROGRAMS` used last are kept (a program dropped is freed, and compiled again if asked)."""
    key = (x.shape, x.dtype, x.sharding, rows, flat)
    with _programs_lock:
        program = _programs.get(key)
        if program is not None:
            _programs.move_to_end(key)
            return program
    program = _slice_rows(rows, flat).lower(x, 0).compile()
    with _programs_lock:
        _programs[key] = program
        while len(_programs) > PROGRAMS:
            _programs.popitem(last=False)
    return program


def whole(x: Any) -> Any:
    """``x`` on its way to host memory, with no program: a new array over the same device
    buffers, its transfer started, so that the host copy jax keeps on the array it fetched goes
    when the save drops it instead of staying on ``x`` while the caller holds it.

    Not through pinned host memory: on a TPU v5e bfloat16 leaves of 256 MiB moved into pinned
    host memory and read from there reached the host at 0.49 GB/s, against 1.67 GB/s for jax's
    own transfer (docs/benchmarks.md, "On a full chip"); on the CPU its dispatch cost three
    times this one's."""
    fresh = jax.make_array_from_single_device_arrays(
        x.shape, x.sharding, [shard.data for shard in x.addressable_shards]
    )
    fresh.copy_to_host_async()
    return fresh


def to_host(x: Any) -> np.ndarray[Any, Any]:
    """A device slice's host data (waits for its transfer)."""
    return np.asarray(x)


@dataclass
class _Slice:
    leaf: _Leaf
    device: Any  # the slice on the device, its transfer started
    first: int  # the leaf byte of its first byte
    end: int  # the leaf byte after its last
    reserved: int  # window bytes taken for the slice's host copy
    carry: int  # window bytes taken for the chunk that begins in it and ends in a later one


@dataclass
class _Leaf:
    array: Any
    step: int  # raw bytes per chunk
    submit: Callable[[np.ndarray[Any, Any]], cf.Future[Any]]
    address: str
    futures: list[cf.Future[Any]] = field(default_factory=list)
    host: np.ndarray[Any, Any] | None = None  # the leaf's bytes, once fetched whole after slicing failed
    carry: np.ndarray[Any, Any] | None = None  # a chunk that spans slices, as it fills
    carry_at: int = 0
    carry_reserved: int = 0

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    def slices(self, target: int) -> list[tuple[tuple[int, bool] | None, int, int, int]]:
        """((rows, flat) of the slicing program, start row, first byte, end byte) of each slice
        of the leaf; one piece and no program for a leaf of at most ``target`` bytes."""
        x = self.array
        nbytes = self.nbytes
        if nbytes <= target:
            return [(None, 0, 0, nbytes)]
        row = nbytes // x.shape[0] if x.ndim and x.shape[0] else nbytes
        flat = x.ndim == 0 or row > target
        if flat:
            row, count = x.dtype.itemsize, x.size
        else:
            count = x.shape[0]
        rows = max(1, min(count, target // row))
        if row * rows % self.step and self.step % row == 0 and rows * row >= self.step:
            rows -= rows % (self.step // row)  # slices of whole chunks: no chunk spans two
        out: list[tuple[tuple[int, bool] | None, int, int, int]] = []
        for first in range(0, count, rows):
            height = min(rows, count - first)  # the last slice is shorter (compiled once more)
            out.append(((height, flat), first, first * row, (first + height) * row))
        return out

    def carry_begun(self, first: int, end: int) -> int:
        """The size of the chunk that begins in leaf bytes [first, end) and ends after them."""
        if end >= self.nbytes:
            return 0
        begin = (end - 1) // self.step * self.step
        return min(begin + self.step, self.nbytes) - begin if begin >= first and end % self.step else 0


class Fetcher:
    """Streams the chunks of device arrays to ``submit`` jobs in a window of host memory."""

    def __init__(self, window: Window, chunk_size: int, target: int = SLICE) -> None:
        """Slices of about ``target`` bytes (fewer where the window is small: a slice and the
        two chunks that may span its ends fit in the window); chunks of at most ``chunk_size``."""
        self.window = window
        self.target = max(1, min(target, window.limit - 2 * chunk_size))
        self._leaves: list[_Leaf] = []
        self._room: dict[Any, bool] = {}  # device: whether slices in flight fit beside the step

    def add(
        self,
        array: Any,
        step: int,
        submit: Callable[[np.ndarray[Any, Any]], cf.Future[Any]],
        address: str = "",
    ) -> list[cf.Future[Any]]:
        """Plan ``array``'s chunks of ``step`` raw bytes, each stored by ``submit(raw bytes)``;
        returns the list its chunks' futures are appended to, in order, by :meth:`run`.
        ``address`` names the leaf in errors."""
        leaf = _Leaf(array, step, submit, address)
        self._leaves.append(leaf)
        return leaf.futures

    def run(self) -> None:
        """Fetch every planned leaf and submit its chunks; returns when every chunk is submitted
        (not stored). Transfers are started ahead while the window has room."""
        pending: collections.deque[_Slice] = collections.deque()
        try:
            for leaf in self._leaves:
                if not leaf.nbytes:
                    continue
                target = self.target if self.may_slice(leaf.array) else leaf.nbytes
                for program, start, first, end in leaf.slices(target):
                    size = end - first
                    carry = leaf.carry_begun(first, end)
                    while not self.window.try_take(size + carry):
                        if not pending:
                            self.window.take(size + carry, stuck=leaf.carry_reserved)
                            break
                        self._store(pending.popleft())
                    try:
                        device = self._start(leaf, program, start, first, end)
                    except BaseException:
                        self.window.give(size + carry)
                        raise
                    pending.append(_Slice(leaf, device, first, end, size, carry))
            while pending:
                self._store(pending.popleft())
        finally:
            for piece in pending:  # after an error: nothing will fetch them
                self.window.give(piece.reserved + piece.carry)
            self._leaves = []

    def may_slice(self, x: Any) -> bool:
        """Whether every device of ``x`` has room for a window of slices beside the step's peak."""
        for device in x.devices():
            if device not in self._room:
                self._room[device] = device_memory.fits({device: self.window.limit})
            if not self._room[device]:
                return False
        return True

    def _start(self, leaf: _Leaf, program: tuple[int, bool] | None, start: int, first: int, end: int) -> Any:
        """The piece [first, end) of ``leaf`` on its way to the host: a slice cut on its device, or
        the whole leaf (no program). A slicing program that the device cannot compile, load or
        run (no memory) is given up for the rest of the save: the leaf is fetched whole and the
        piece cut from host memory."""
        if leaf.host is None and program is not None:
            try:
                piece = slicer(leaf.array, *program)(leaf.array, start)
                piece.copy_to_host_async()
                return piece
            except jax.errors.JaxRuntimeError:
                self._room = dict.fromkeys(leaf.array.devices(), False)
                leaf.host = self._whole_on_host(leaf)
        if leaf.host is not None:
            return leaf.host[first:end]
        with _named(leaf):
            return whole(leaf.array)

    def _whole_on_host(self, leaf: _Leaf) -> np.ndarray[Any, Any]:
        with _named(leaf):
            return to_host(whole(leaf.array)).reshape(-1).view(np.uint8)

    def _store(self, piece: _Slice) -> None:
        """Wait for ``piece``'s bytes and submit every chunk that they complete."""
        leaf = piece.leaf
        try:
            with _named(leaf):
                raw = to_host(piece.device).reshape(-1).view(np.uint8)
        except BaseException:
            self.window.give(piece.reserved + piece.carry)
            raise
        piece.device = None
        step, nbytes = leaf.step, leaf.nbytes
        views: list[cf.Future[Any]] = []
        i = 0
        if leaf.carry is not None:  # finish the chunk that a slice before began
            take = min(len(leaf.carry) - leaf.carry_at, len(raw))
            leaf.carry[leaf.carry_at : leaf.carry_at + take] = raw[:take]
            leaf.carry_at += take
            i = take
            if leaf.carry_at == len(leaf.carry):
                reserved = leaf.carry_reserved
                job = self._submit(leaf, leaf.carry)
                job.add_done_callback(lambda _: self.window.give(reserved))
                leaf.carry, leaf.carry_reserved = None, 0
        while i < len(raw):
            at = piece.first + i
            chunk_end = min(at - at % step + step, nbytes)
            if chunk_end <= piece.end:
                views.append(self._submit(leaf, raw[i : i + chunk_end - at]))
                i += chunk_end - at
            else:  # the chunk runs on into the next slice: copied out, counted in piece.carry
                leaf.carry = np.empty(chunk_end - at, np.uint8)
                leaf.carry_at = len(raw) - i
                leaf.carry[: leaf.carry_at] = raw[i:]
                leaf.carry_reserved = piece.carry
                i = len(raw)
        self._give_after(views, piece.reserved)

    def _give_after(self, jobs: list[cf.Future[Any]], nbytes: int) -> None:
        """Give ``nbytes`` back to the window once every job of ``jobs`` has finished."""
        if not jobs:
            self.window.give(nbytes)
            return
        left = [len(jobs)]
        lock = threading.Lock()

        def done(_: cf.Future[Any]) -> None:
            with lock:
                left[0] -= 1
                last = not left[0]
            if last:
                self.window.give(nbytes)

        for job in jobs:
            job.add_done_callback(done)

    def _submit(self, leaf: _Leaf, raw: np.ndarray[Any, Any]) -> cf.Future[Any]:
        future = leaf.submit(raw)
        leaf.futures.append(future)
        return future


@contextlib.contextmanager
def _named(leaf: _Leaf) -> Iterator[None]:
    """A transfer of ``leaf`` that the device fails raises DeviceError naming the leaf."""
    try:
        yield
    except jax.errors.JaxRuntimeError as error:
        raise DeviceError(
            f"{leaf.address}: the device did not hand over the leaf's bytes "
            f"({leaf.array.dtype}{list(leaf.array.shape)}): {error}",
            address=leaf.address,
        ) from error


__all__ = ["PROGRAMS", "SLICE", "Fetcher", "Window", "chunk_step", "slicer", "to_host", "whole"]
