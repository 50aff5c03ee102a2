"""Device arrays to host chunks, pipelined, in a bounded window of host memory.

A save of arrays that live on an accelerator does not copy the whole tree to the host first. A leaf
no bigger than a slice is moved to host memory whole, with no program; a bigger leaf is cut on its
device into slices of rows as even as whole chunks allow, by a slicing program compiled once per
leaf shape, dtype and sharding (:mod:`treestore._engine.saving.slicing`): the last slice starts
back from the leaf's end where that fetches again at most a chunk of its neighbour's bytes, and
has a height of its own (a second program) otherwise. So the programs a save compiles grow with
the distinct shapes of its leaves over a slice only, never with its many small ones, and a save
starts compiling them all before its first transfer. The transfer of each piece to the host
starts as soon as the window has room for it, so that the transfers run ahead of the hashing and
compression, and the host bytes of a piece are given back to the window when the last chunk cut
from it has been stored. Chunks are cut at the same boundaries
as a save from host memory (every ``chunk_size`` raw bytes of the leaf), so both store the same
chunk objects, and a chunk is a view of the slice it came in. Slices hand over whole chunks: where
the leaf's rows do not divide the chunk size, a slice's rows reach from the one that holds its
first chunk's first byte to the one that holds its last chunk's last byte (two rows at most are
fetched twice). Where rows are too big for that (two rows more than a chunk), a chunk that spans
two slices is put together in a buffer of its own instead, which the window counts.

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
import itertools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from treestore._engine.saving import device_memory, slicing
from treestore._tree.jax_import import jax
from treestore.errors import DeviceError

MiB = 2**20
SLICE = 16 * MiB  # bytes a slice aims at (several chunks: one transfer each)


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


@dataclass(frozen=True)
class _Plan:
    """One piece of a leaf to fetch: ``rows`` rows (of the flat view with ``flat``) from row
    ``start``, leaf bytes ``[origin, origin + nbytes)``, of which it hands over ``[first, end)``;
    no program (``rows`` None) for the whole leaf."""

    rows: int | None
    flat: bool
    start: int
    origin: int
    nbytes: int
    first: int
    end: int


@dataclass
class _Slice:
    leaf: _Leaf
    device: Any  # the slice on the device, its transfer started
    origin: int  # the leaf byte of its first byte
    first: int  # the leaf byte of the first byte it hands over
    end: int  # the leaf byte after the last
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

    def slices(self, target: int, exact: bool) -> list[_Plan]:
        """The pieces of the leaf: slices of rows of at most about ``target`` bytes, as even as
        whole chunks (or rows) allow, or one piece and no program for a leaf of at most
        ``target`` bytes.

        Where two rows fit in a chunk, slices hand over whole chunks: a slice's rows reach from
        the one that holds its first byte to the one that holds its last (a row more at each end
        at most). Otherwise they hand over whole rows. Every slice has the same height (one
        program), the last starting back from the leaf's end where it would fetch again at most
        a chunk of the bytes its neighbour hands over (none with ``exact``); a shorter last slice
        has a height (and a program) of its own.
        """
        x = self.array
        nbytes = self.nbytes
        if nbytes <= target:
            return [_Plan(None, False, 0, 0, nbytes, 0, nbytes)]
        row = nbytes // x.shape[0] if x.ndim and x.shape[0] else nbytes
        flat = x.ndim == 0 or row > target
        if flat:
            row, count = x.dtype.itemsize, x.size
        else:
            count = x.shape[0]
        step = self.step
        unit = step if target >= step and (step % row == 0 or 2 * row <= step) else row
        units = -(-nbytes // unit)  # whole chunks (or rows) in the leaf
        pieces = -(-units // max(1, target // unit))
        span = -(-units // pieces) * unit
        cuts = [*range(0, nbytes, span), nbytes]
        spans = list(itertools.pairwise(cuts))
        height = max(-(-end // row) - first // row for first, end in spans[:-1])
        twice = 0 if exact else step  # bytes the last slice may fetch again
        out = []
        for first, end in spans:
            start = first // row
            if start + height > count:  # near the end: from further back
                if (first, end) == spans[-1] and (start + height - count) * row > twice:
                    rows = count - start
                    out.append(_Plan(rows, flat, start, start * row, rows * row, first, end))
                    continue
                start = count - height
            out.append(_Plan(height, flat, start, start * row, height * row, first, end))
        return out

    def carry_begun(self, first: int, end: int) -> int:
        """The size of the chunk that begins in leaf bytes [first, end) and ends after them."""
        if end >= self.nbytes:
            return 0
        begin = (end - 1) // self.step * self.step
        return min(begin + self.step, self.nbytes) - begin if begin >= first and end % self.step else 0


class Fetcher:
    """Streams the chunks of device arrays to ``submit`` jobs in a window of host memory."""

    def __init__(self, window: Window, chunk_size: int, target: int = SLICE, exact: bool = False) -> None:
        """Slices of about ``target`` bytes (fewer where the window is small: a slice and the
        two chunks that may span its ends fit in the window); chunks of at most ``chunk_size``.
        ``exact``: fetch no byte twice where a program more avoids it (for chunks that are kept,
        as a snapshot's are: see :meth:`_Leaf.slices`)."""
        self.window = window
        self.exact = exact
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
            slicing.compile_ahead(self._wanted())
            for leaf in self._leaves:
                if not leaf.nbytes:
                    continue
                target = self.target if self.may_slice(leaf.array) else leaf.nbytes
                for plan in leaf.slices(target, self.exact):
                    size = plan.nbytes
                    carry = leaf.carry_begun(plan.first, plan.end)
                    while not self.window.try_take(size + carry):
                        if not pending:
                            self.window.take(size + carry, stuck=leaf.carry_reserved)
                            break
                        self._store(pending.popleft())
                    try:
                        device, origin = self._start(leaf, plan)
                    except BaseException:
                        self.window.give(size + carry)
                        raise
                    pending.append(_Slice(leaf, device, origin, plan.first, plan.end, size, carry))
            while pending:
                self._store(pending.popleft())
        finally:
            for piece in pending:  # after an error: nothing will fetch them
                self.window.give(piece.reserved + piece.carry)
            self._leaves = []

    def _wanted(self) -> list[tuple[Any, int, bool]]:
        """(array, rows, flat) of each slicing program the planned leaves will ask for."""
        out = []
        for leaf in self._leaves:
            try:
                if leaf.nbytes > self.target and self.may_slice(leaf.array):
                    out += [
                        (leaf.array, p.rows, p.flat) for p in leaf.slices(self.target, self.exact) if p.rows
                    ]
            except Exception:  # as a deleted array's: raised by the fetch, at its leaf
                continue
        return out

    def may_slice(self, x: Any) -> bool:
        """Whether every device of ``x`` has room for a window of slices beside the step's peak."""
        for device in x.devices():
            if device not in self._room:
                self._room[device] = device_memory.fits({device: self.window.limit})
            if not self._room[device]:
                return False
        return True

    def _start(self, leaf: _Leaf, plan: _Plan) -> tuple[Any, int]:
        """The piece ``plan`` of ``leaf`` on its way to the host, and the leaf byte of its first
        byte: a slice cut on its device, or the whole leaf (no program). A slicing program that
        the device cannot compile, load or run (no memory) is given up for the rest of the save:
        the leaf is fetched whole and the piece cut from host memory."""
        if leaf.host is None and plan.rows is not None:
            try:
                program = slicing.slicer(leaf.array, plan.rows, plan.flat)
                piece = program(leaf.array, slicing.start_of(leaf.array, plan.flat, plan.start))
                piece.copy_to_host_async()
                return piece, plan.origin
            except jax.errors.JaxRuntimeError:
                self._room = dict.fromkeys(leaf.array.devices(), False)
                leaf.host = self._whole_on_host(leaf)
        if leaf.host is not None:
            return leaf.host[plan.first : plan.end], plan.first
        with _named(leaf):
            return whole(leaf.array), 0

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
        raw = raw[piece.first - piece.origin : piece.end - piece.origin]  # the bytes it hands over
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


__all__ = ["SLICE", "Fetcher", "Window", "chunk_step", "to_host", "whole"]
