"""An async save's host snapshot of big device arrays: fetched in slices, kept as the save's chunks.

jax moves an array to host memory whole, and on a TPU v5e that ran at 1.0-1.4 GB/s for bfloat16
leaves of 256 MiB, where the save's fetcher, which cuts big leaves into slices on their devices,
moved the same leaves at 5.6-10 GB/s (docs/benchmarks.md, "On a full chip"). So when an async save
has no device room for a copy of the tree and copies it to host memory instead, its big arrays
go through the same fetcher (:class:`Stager`), with a job that keeps every chunk the fetcher hands
over instead of storing it. The chunks are the save's own (every ``chunk_step`` raw bytes of the
leaf), so the save stores them as they are (:class:`HostChunks`): the same objects and statistics
as a save from the devices or from host memory, and no second pass over the bytes. The fetcher is
exact: no slice fetches again bytes that another hands over, beyond the two rows at most that a
slice of whole chunks reaches past them where rows do not divide the chunk size. Where single rows
are bigger than half a chunk, a chunk that spans two slices is copied into a buffer of its own
while both slices are kept: such a leaf holds up to one chunk per slice twice.

Device memory: the slices in flight take at most ``window`` bytes of a device, and only arrays
whose devices all have that room beside the training step's peak are staged (the fetcher's own
rule, :meth:`~treestore._engine.saving.device_fetch.Fetcher.may_slice`); the others are copied
whole by jax, with no program.
"""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from treestore._engine.saving.device_fetch import Fetcher, Window, chunk_step
from treestore._tree.leaves import ArrayLeaf, Keep, off_cpu

_KEPT: cf.Future[None] = cf.Future()  # what keeping a chunk returns: done at once
_KEPT.set_result(None)


@dataclass(frozen=True)
class HostChunks:
    """A device array's bytes in host memory, cut as a save cuts them: ``chunks`` are its raw
    bytes in order, ``step`` bytes each but the last."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    step: int
    chunks: tuple[np.ndarray[Any, Any], ...]

    @property
    def nbytes(self) -> int:
        return sum(len(c) for c in self.chunks)

    def joined(self) -> np.ndarray[Any, Any]:
        """The raw bytes in one new buffer."""
        return np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.uint8)

    def host(self) -> np.ndarray[Any, Any]:
        """The array, in one new host buffer."""
        return self.joined().view(self.dtype).reshape(self.shape)


class Stager:
    """Fetches the big jax arrays of one snapshot in slices, into chunks of ``chunk_size`` raw
    bytes, with at most ``window`` bytes of slices in flight on a device; ``cpu``: CPU arrays
    too (as ``SaveOptions(device_path="always")``), else only arrays off the CPU."""

    def __init__(self, chunk_size: int, window: int, cpu: bool = False) -> None:
        self.chunk_size = chunk_size
        self._fetcher = Fetcher(Window(window), chunk_size, exact=True)  # its chunks are kept
        # a leaf no bigger than a slice moves whole anyway
        self.keep = Keep(min_bytes=self._fetcher.target + 1, cpu=cpu)

    def wants(self, x: Any) -> bool:
        """Whether the jax array ``x`` is staged: its pieces are bigger than a slice, and every
        device of it has room for a window of slices."""
        if not self.keep.kept(x):
            return False
        sharding = x.sharding
        if not sharding.is_fully_replicated and len(sharding.device_set) > 1:  # pieces: one a shard
            shard = int(np.prod(sharding.shard_shape(x.shape), dtype=np.int64)) * x.dtype.itemsize
            if shard < self.keep.min_bytes:
                return False
        return self._fetcher.may_slice(x)

    def fetch(self, leaves: dict[str, ArrayLeaf]) -> dict[str, ArrayLeaf]:
        """``leaves`` (prepared with :attr:`keep`: their arrays, or their big pieces, on their
        devices) with those arrays fetched to host memory as :class:`HostChunks`; a transfer
        that fails raises DeviceError naming its leaf."""
        fetcher = self._fetcher  # the one that found the room: it slices what it said it could
        made: dict[int, tuple[Any, list[np.ndarray[Any, Any]]]] = {}

        def plan(x: Any, address: str) -> None:
            if id(x) in made:  # one array at two addresses: fetched once
                return
            chunks: list[np.ndarray[Any, Any]] = []
            made[id(x)] = (x, chunks)

            def keep(raw: np.ndarray[Any, Any]) -> cf.Future[None]:
                chunks.append(raw)
                return _KEPT

            fetcher.add(x, chunk_step(x.dtype.itemsize, self.chunk_size), keep, address)

        for address, leaf in leaves.items():
            for x in _on_device(leaf):
                plan(x, address)
        fetcher.run()
        host = {key: self._host_chunks(x, chunks) for key, (x, chunks) in made.items()}

        def fetched(leaf: ArrayLeaf) -> ArrayLeaf:
            if leaf.source is not None:
                return replace(leaf, source=host[id(leaf.source)])
            pieces = tuple((s, d if isinstance(d, np.ndarray) else host[id(d)]) for s, d in leaf.pieces)
            return replace(leaf, pieces=pieces)

        return {address: fetched(leaf) for address, leaf in leaves.items()}

    def _host_chunks(self, x: Any, chunks: list[np.ndarray[Any, Any]]) -> HostChunks:
        """``x``'s chunks, copied where they may be views of ``x``'s own buffer (a CPU array the
        fetcher moved whole: the caller may donate that buffer to its next step)."""
        if not off_cpu(x):
            spans = [(s.data.unsafe_buffer_pointer(), s.data.nbytes) for s in x.addressable_shards]
            chunks = [c.copy() if any(0 <= c.ctypes.data - b < n for b, n in spans) else c for c in chunks]
        step = chunk_step(x.dtype.itemsize, self.chunk_size)
        return HostChunks(tuple(x.shape), np.dtype(x.dtype), step, tuple(chunks))


def _on_device(leaf: ArrayLeaf) -> list[Any]:
    """The device arrays of a leaf prepared with a :class:`Keep`: its source, or its kept pieces."""
    if leaf.source is not None:
        return [leaf.source]
    return [d for _, d in leaf.pieces if not isinstance(d, np.ndarray)]


__all__ = ["HostChunks", "Stager"]
