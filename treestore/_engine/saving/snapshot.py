"""Async saves: a host snapshot of a tree that the caller may change at once, and one background
worker that writes it while the caller goes on.

:class:`HostSnapshot` does the part of a save that must block the caller: it validates the tree
(as :func:`treestore._tree.prepare.prepare` does) and copies every array leaf to host memory the caller
cannot reach, so the caller may mutate its numpy arrays or donate its jax arrays to the next step.
It keeps the copies of the last snapshot and reuses them: a jax array that is the *same object* as
at the last snapshot holds the same bytes (jax arrays are immutable), so it is not copied again,
and an array that changed is copied into the last snapshot's buffer of its address when the shape
and dtype match, which avoids the page faults of fresh allocations. The price is one host copy of
the tree, held until :meth:`HostSnapshot.clear`; the host copies of accelerator arrays that jax
made (which cannot be written into) are dropped before the next snapshot is taken, so two trees
are never held at once. Where the devices have the memory beside the training step's peak, the
big arrays are copied on their devices instead (:func:`device_room`), which stalls the caller for
the time it takes to start the copies, and the save fetches them in a bounded window of host
memory as it writes (:mod:`treestore._engine.saving.device_fetch`). A copy program the devices
cannot compile, load or run (no memory) is given up, and the tree copied to host memory. There,
arrays bigger than a slice go through the save's own fetcher, in slices, and are kept as the
save's chunks (:mod:`treestore._engine.saving.staging`): several times faster than jax's
whole-array transfer on a TPU.

:class:`Background` runs one job at a time on one thread and keeps its error until it is collected.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from treestore._engine import libc
from treestore._engine.saving import device_memory
from treestore._engine.saving.staging import Stager
from treestore._tree.jax_import import jax
from treestore._tree.leaves import ArrayLeaf, Keep, Leaf, off_cpu, prepare_leaf
from treestore._tree.prepare import Prepared, prepare


@dataclasses.dataclass(frozen=True)
class _Kept:
    """The host copy of one address at the last snapshot, and the jax array it came from."""

    source: weakref.ref[Any] | None  # the jax array, while it lives; None for other leaves
    leaf: ArrayLeaf
    owned: bool  # the buffer is ours to overwrite (False: jax's own host copy, read-only)


class HostSnapshot:
    """Host copies of trees' array leaves, reused from one snapshot to the next.

    Call :meth:`take` only when no tree it returned before is still being written: changed
    arrays are copied into the buffers of the last snapshot.

    >>> import numpy as np, jax.numpy as jnp
    >>> snap = HostSnapshot()
    >>> tree = {"w": np.zeros(3, np.float32), "b": jnp.ones(2)}
    >>> prepared = snap.take(tree)
    >>> tree["w"][0] = 5.0  # the snapshot does not see later changes
    >>> dict((a, leaf.data.tolist()) for a, leaf in prepared.leaves)
    {'b': [1.0, 1.0], 'w': [0.0, 0.0, 0.0]}
    """

    def __init__(self) -> None:
        self._kept: dict[str, _Kept] = {}
        self._copies: list[Any] = []  # device copies of the last take

    def clear(self) -> None:
        """Drop the kept host copies, and give their memory back to the system where the C
        library can (glibc keeps freed buffers of up to 32 MiB, as a snapshot's chunks are, for
        reuse); free the device copies."""
        self._kept = {}
        self.release()
        if libc.malloc_trim is not None:
            libc.malloc_trim(0)

    def take(
        self,
        tree: Any,
        on_device: Keep | None = None,
        device_limit: int | None = None,
        window: int = 0,
        stager: Stager | None = None,
    ) -> Prepared:
        """Validate ``tree`` and copy its array leaves to host; raises before keeping anything.

        The jax arrays that ``on_device`` keeps are copied on their devices instead when the
        copies fit there (:func:`device_room`, with at most ``device_limit`` bytes in all, and
        ``window`` bytes more for the slices the save will cut from them): the copy is started,
        not waited for (the device orders it before any later use of the array, a donation
        included), and the save fetches the copies while it writes. Otherwise the big arrays
        that ``stager`` wants are fetched in slices, into the save's chunks.
        """
        self.release()
        kept = self._kept
        copies: list[Any] = []
        same = {id(v) for k in kept.values() if k.source is not None and (v := k.source()) is not None}
        new: dict[str, _Kept] = {}
        device: Keep | None = None  # on_device, once the validated leaves are known to fit
        on_device_copies: dict[int, Any] = {}  # id of a kept array: its copy on its devices
        staged: set[int] = set()  # ids of the arrays the stager fetches
        to_stage: dict[str, ArrayLeaf] = {}  # their leaves, with the arrays still on their devices

        def host_leaf(address: str, value: Any) -> Leaf:
            if device is not None and id(value) in on_device_copies:
                return prepare_leaf(on_device_copies[id(value)], address, keep=device)
            if stager is not None and id(value) in staged:
                staging = prepare_leaf(value, address, keep=stager.keep)
                assert isinstance(staging, ArrayLeaf)  # a jax array's leaf
                to_stage[address] = staging
                new[address] = _Kept(weakref.ref(value), staging, owned=False)
                return staging
            old = kept.get(address)
            if (
                old is not None
                and old.source is not None
                and old.source() is value
                and isinstance(value, jax.Array)
                and not value.is_deleted()
            ):
                new[address] = old
                return old.leaf
            leaf = prepare_leaf(value, address)
            if isinstance(leaf, ArrayLeaf):
                # numpy first: the stand-in's jax.Array costs a call per leaf of a big tree
                on_jax = type(value) is not np.ndarray and isinstance(value, jax.Array)
                if on_jax and off_cpu(value):
                    new[address] = _Kept(weakref.ref(value), leaf, owned=False)
                else:
                    leaf = _private(leaf, old)
                    source = weakref.ref(value) if on_jax else None
                    new[address] = _Kept(source, leaf, owned=True)
            return leaf

        def start_copies(values: list[Any]) -> None:  # every device-to-host copy at once
            nonlocal device
            array = jax.Array  # looked up once: each lookup through the stand-in costs a call
            live = {id(x) for x in values}
            for address in [a for a, k in kept.items() if not k.owned and _source_id(k) not in live]:
                del kept[address]  # jax's host copy of an array gone: no use to this snapshot
            if on_device is not None and device_room(values, on_device, device_limit, window):
                originals = {id(x): x for x in values if isinstance(x, array) and on_device.kept(x)}
                try:
                    made = _copier()(list(originals.values()))
                except jax.errors.JaxRuntimeError:  # no device memory for the program or copies
                    made = None
                if made is not None:
                    device = on_device
                    on_device_copies.update(zip(originals, made, strict=True))
                    copies.extend(made)
            for x in values:
                if not isinstance(x, array) or id(x) in same or (device is not None and device.kept(x)):
                    continue
                if stager is not None and stager.wants(x):
                    staged.add(id(x))  # fetched in slices once every leaf is converted
                elif off_cpu(x):
                    with contextlib.suppress(Exception):  # np.asarray below copies anyway
                        x.copy_to_host_async()

        try:
            prepared = prepare(tree, leaf=host_leaf, before=start_copies)
            if stager is not None and to_stage:
                prepared = self._staged(prepared, stager.fetch(to_stage), new)
        except BaseException:
            self._kept = {}  # some kept buffers may hold this tree's data now: trust none
            for copy in copies:
                copy.delete()
            raise
        self._kept = new
        self._copies = copies
        return prepared

    @staticmethod
    def _staged(prepared: Prepared, fetched: dict[str, ArrayLeaf], new: dict[str, _Kept]) -> Prepared:
        """``prepared`` with the leaves the stager fetched in place of theirs (in ``new`` too)."""
        for address, leaf in fetched.items():
            new[address] = dataclasses.replace(new[address], leaf=leaf)
        leaves = tuple((a, fetched.get(a, leaf)) for a, leaf in prepared.leaves)
        return Prepared(prepared.nodes, leaves)

    def release(self) -> None:
        """Free the device copies of the last :meth:`take` (call once its tree is written)."""
        copies, self._copies = self._copies, []
        for copy in copies:
            with contextlib.suppress(Exception):  # already deleted
                copy.delete()


@functools.cache
def _copier() -> Any:
    """One compiled program that copies a list of arrays on their devices, each with its own
    sharding, dtype and weak type (jax compiles it once per list of shapes, dtypes and shardings).
    Its dispatch returns before the copies run, and the devices order them before any later
    use of the originals, a donation included. (``jax.device_put(..., may_alias=False)`` copies
    too, but on a TPU its copies finished far later than this program's: docs/benchmarks.md,
    "On an accelerator".)"""
    return jax.jit(lambda xs: [jax.numpy.copy(x) for x in xs])


def device_room(tree_leaves: list[Any], keep: Keep, limit: int | None, window: int = 0) -> bool:
    """Whether copies of the jax arrays of ``tree_leaves`` that ``keep`` keeps fit on their
    devices: in at most ``limit`` bytes in all (None: no bound of the caller's), and, with
    ``window`` bytes more, in what each device has never used (:func:`device_memory.room`: the
    training step's peak is left to it; no bound where the device does not tell, as a CPU)."""
    array = jax.Array
    need = device_memory.per_device(x for x in tree_leaves if isinstance(x, array) and keep.kept(x))
    if limit is not None and sum(need.values()) > limit:
        return False
    return device_memory.fits(need, window)


def _source_id(kept: _Kept) -> int | None:
    """The id of the jax array ``kept`` was copied from, while it lives."""
    value = kept.source() if kept.source is not None else None
    return None if value is None else id(value)


def _private(leaf: ArrayLeaf, old: _Kept | None) -> ArrayLeaf:
    """``leaf`` with its host data copied: into the old buffer of its address when it fits,
    else (and for the shards of a sharded array) into new ones."""
    if leaf.data is None:
        pieces = tuple((start, np.array(d, copy=True, order="C")) for start, d in leaf.pieces)
        return dataclasses.replace(leaf, pieces=pieces, private=True)
    data, buf = leaf.data, old.leaf.data if old is not None and old.owned else None
    if buf is not None and buf.shape == data.shape and buf.dtype == data.dtype and buf.flags.c_contiguous:
        np.copyto(buf, data)
        return dataclasses.replace(leaf, data=buf, private=True)
    return dataclasses.replace(leaf, data=np.array(data, copy=True, order="C"), private=True)


class Background:
    """One worker thread running at most one job at a time; a job's error is kept until
    :meth:`collect` raises it, as it was raised.

    >>> bg = Background()
    >>> bg.submit(lambda: 1 / 0)
    >>> bg.collect()
    Traceback (most recent call last):
    ...
    ZeroDivisionError: division by zero
    >>> bg.collect() is None  # an error is raised once
    True
    >>> bg.shutdown()
    """

    def __init__(self, name: str = "treestore-save") -> None:
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._job: cf.Future[Any] | None = None

    def done(self) -> bool:
        """No job, or the job has finished (its outcome may still be uncollected)."""
        return self._job is None or self._job.done()

    def submit(self, job: Callable[[], Any]) -> None:
        """Start ``job``; the previous job's outcome must have been collected."""
        if self._job is not None:
            raise AssertionError("a background job is still uncollected")
        self._job = self._pool.submit(job)

    def collect(self, *, block: bool = True) -> Any:
        """The finished job's result (None without one), raising its error; with ``block=False``
        a job still running is left alone and None is returned."""
        job = self._job
        if job is None or (not block and not job.done()):
            return None
        self._job = None
        return job.result()

    def shutdown(self) -> None:
        """Wait for the running job (its outcome is dropped) and stop the thread."""
        self._pool.shutdown(wait=True)
