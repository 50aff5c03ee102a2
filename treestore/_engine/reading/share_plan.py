"""Which process reads which bytes of a restore whose leaves are replicated across processes.

A leaf restored onto a ``NamedSharding`` whose mesh spans every process of the job, and which
that sharding replicates along mesh axes crossing processes, is *shared*: each distinct region
of it (the box one replica group of devices holds) is read from storage by one device's process
of that group, and reaches the group's other devices over the interconnect
(:mod:`treestore._engine.reading.share`). The readers are chosen so that every process reads
about as many bytes, largest regions first, each to the least loaded process holding it; regions
that need one stored object (a chunk of a leaf saved whole, a pack of small leaves) go to one
reader together while a process holds them all, so that the object is read once.

This module only plans, from the template's shardings and the manifest alone: every process
makes the same plan. A leaf whose dtype cannot travel bit for bit as an unsigned integer of its
width (sub-byte types, complex numbers; 64-bit types without ``jax_enable_x64``), or whose
sharding is not a ``NamedSharding`` over a concrete mesh, or splits an axis unevenly, is read as
before, by every process that holds it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from treestore._engine.reading import region as _region
from treestore._format.manifest.columns import Columns
from treestore._tree import template as _template
from treestore._tree.jax_import import jax

Region = tuple[slice, ...]
Key = tuple[tuple[int, int], ...]  # a region's bounds: hashable


def wire_dtype(dtype: Any) -> np.dtype[Any] | None:
    """The unsigned integer type a leaf of ``dtype`` travels as (its own width, so the bytes are
    the same), or None when it cannot: sub-byte and complex types, PRNG keys, 64-bit types
    without x64."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return None
    dt = np.dtype(dtype)
    if not any(jax.dtypes.issubdtype(dt, kind) for kind in (np.bool_, np.integer, np.floating)):
        return None
    if dt.itemsize not in (1, 2, 4, 8) or jax.dtypes.itemsize_bits(dt) != 8 * dt.itemsize:
        return None  # int4, float4_e2m1fn ...: sub-byte types
    if jax.dtypes.canonicalize_dtype(dt) != dt:  # 64-bit types without jax_enable_x64
        return None
    return np.dtype(f"uint{8 * dt.itemsize}")


@dataclass(frozen=True)
class Layout:
    """How a sharding lays out a leaf of one shape: the mesh axes it replicates the leaf along
    (``axes``), its distinct regions (``keys``: a region's index by its bounds), and the devices
    holding each, in the sharding's device order."""

    axes: tuple[str, ...]
    regions: tuple[Region, ...]
    holders: tuple[tuple[Any, ...], ...]
    keys: dict[Key, int]


def _axes_of(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def region_of(index: tuple[slice, ...] | None, shape: tuple[int, ...]) -> Region:
    """The region a shard index (as jax gives it: slices, maybe fewer than the dimensions)
    stands for, with concrete bounds."""
    out = [slice(*s.indices(n)[:2]) for s, n in zip(index or (), shape, strict=False)]
    return tuple(out + [slice(0, n) for n in shape[len(out) :]])


def key_of(region: Region) -> Key:
    return tuple((r.start, r.stop) for r in region)


@functools.lru_cache(maxsize=4096)
def layout(sharding: Any, shape: tuple[int, ...]) -> Layout | None:
    """The layout of a leaf of ``shape`` on ``sharding``, or None when it is not shared: not a
    ``NamedSharding`` over a mesh of every process of the job, an axis split unevenly, or no
    region held by two processes."""
    named = jax.sharding.NamedSharding
    if not isinstance(sharding, named) or not isinstance(sharding.mesh, jax.sharding.Mesh):
        return None
    if sharding.is_fully_addressable:
        return None
    mesh, spec = sharding.mesh, tuple(sharding.spec)
    if len(spec) > len(shape) or {d.process_index for d in mesh.devices.flat} != set(
        range(jax.process_count())
    ):
        return None
    used: list[str] = []
    for entry, dim in zip(spec, shape, strict=False):
        axes = _axes_of(entry)
        if dim % math.prod(mesh.shape[a] for a in axes):
            return None
        used += axes
    replicated = tuple(a for a in mesh.axis_names if a not in used and mesh.shape[a] > 1)
    if not replicated:
        return None
    keys: dict[Key, int] = {}
    regions: list[Region] = []
    holders: list[list[Any]] = []
    for device, index in sharding.devices_indices_map(shape).items():
        region = region_of(index, shape)
        k = keys.setdefault(key_of(region), len(regions))
        if k == len(regions):
            regions.append(region)
            holders.append([])
        holders[k].append(device)
    if all(len({d.process_index for d in held}) == 1 for held in holders):
        return None  # each replica group within one process: it reads each region once already
    return Layout(replicated, tuple(regions), tuple(map(tuple, holders)), keys)


def _shared_leaf(leaf: Any) -> bool:
    sharding = getattr(leaf, "sharding", None)
    dtype = getattr(leaf, "dtype", None)
    if sharding is None or dtype is None or wire_dtype(dtype) is None or 0 in tuple(leaf.shape):
        return False
    return layout(sharding, tuple(leaf.shape)) is not None


def crosses(like: Any) -> bool:
    """Whether a restore onto template ``like`` shares bytes between processes: some leaf of it
    is restored onto a sharding that replicates it across processes (and can travel bit for
    bit). Every process of the job decides alike, from its template alone."""
    if like is None or not jax.process_count() > 1:
        return False
    return any(_shared_leaf(leaf) for leaf in jax.tree_util.tree_leaves(like))


@dataclass(frozen=True)
class Shared:
    """A leaf read once and shared: its position among the load's sharded leaves, its slot,
    sharding, shape, the template's dtype and the type it travels as, its layout, and the
    device each region's bytes are put on (``readers``, one per region of the layout)."""

    position: int
    slot: _template.Slot
    sharding: Any
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    wire: np.dtype[Any]
    layout: Layout
    readers: tuple[Any, ...]

    @property
    def index(self) -> int:
        """The leaf's index in the manifest."""
        assert self.slot.entry is not None  # a shared leaf is a stored array
        return self.slot.entry.index

    def read_by(self, process: int) -> list[int]:
        """The regions of this leaf that ``process`` reads from storage."""
        return [k for k, d in enumerate(self.readers) if d.process_index == process]

    def region_bytes(self, k: int) -> int:
        return math.prod(r.stop - r.start for r in self.layout.regions[k]) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def plan(sharded: Sequence[tuple[_template.Slot, Any]], columns: Columns) -> tuple[list[Shared], list[int]]:
    """The shared leaves among ``sharded`` (a load's (slot, sharding) pairs), with their
    readers, and the positions of the others (read as before)."""
    found: list[tuple[int, _template.Slot, Any, tuple[int, ...], np.dtype[Any], np.dtype[Any], Layout]] = []
    rest: list[int] = []
    for position, (slot, sharding) in enumerate(sharded):
        entry = slot.entry
        assert entry is not None  # target_sharding gives no sharding to a kept leaf
        shape = tuple(entry.shape or ())
        dtype = np.dtype(slot.like.dtype)
        wire = wire_dtype(dtype)
        found_layout = None if wire is None or 0 in shape else layout(sharding, shape)
        if wire is None or found_layout is None:
            rest.append(position)
            continue
        found.append((position, slot, sharding, shape, dtype, wire, found_layout))
    units = _units(found, columns)
    readers = _assign(units, [f[6] for f in found], [f[4].itemsize for f in found])
    shared = [
        Shared(position, slot, sharding, shape, dtype, wire, lay, tuple(readers[j]))
        for j, (position, slot, sharding, shape, dtype, wire, lay) in enumerate(found)
    ]
    return shared, rest


Unit = list[tuple[int, int]]  # (shared leaf, region) pairs one process reads together


def _units(found: Sequence[tuple[Any, ...]], columns: Columns) -> list[Unit]:
    """The regions of the shared leaves, as units of reading: regions that need a stored object
    in common (a chunk two regions meet, a pack holding several small leaves) make one unit
    while some process holds all of them, so that the object is read once."""
    units: list[tuple[set[int], Unit]] = []
    owner: dict[tuple[str, Any], int] = {}  # stored object -> the unit that reads it
    for j, (_, slot, *_rest, lay) in enumerate(found):
        pieces = _region.leaf_pieces(columns, slot.entry.index)
        for k, (region, held) in enumerate(zip(lay.regions, lay.holders, strict=True)):
            processes = {d.process_index for d in held}
            objects = sorted(_region.objects_met(pieces, region))  # sorted: the same plan everywhere
            joined = (u for o in objects if (u := owner.get(o)) is not None and units[u][0] & processes)
            at = next(joined, None)
            if at is None:
                at = len(units)
                units.append((processes, []))
            units[at][0].intersection_update(processes)
            units[at][1].append((j, k))
            for o in objects:
                owner.setdefault(o, at)
    return [unit for _, unit in units]


def _assign(units: Iterable[Unit], layouts: Sequence[Layout], itemsizes: Sequence[int]) -> list[list[Any]]:
    """The reading device of each region of each shared leaf: units are given out largest
    first (ties in plan order), each to the least loaded process that holds all of it (ties to
    the lowest index), and a region's bytes go to that process's first device holding it."""

    def size(unit: Unit) -> int:
        return sum(math.prod(r.stop - r.start for r in layouts[j].regions[k]) * itemsizes[j] for j, k in unit)

    ordered = sorted(enumerate(units), key=lambda item: (-size(item[1]), item[0]))
    load: dict[int, int] = {}
    readers: list[list[Any]] = [[None] * len(lay.regions) for lay in layouts]
    for _, unit in ordered:
        candidates = functools.reduce(
            set.intersection, ({d.process_index for d in layouts[j].holders[k]} for j, k in unit)
        )
        process = min(candidates, key=lambda p: (load.get(p, 0), p))
        load[process] = load.get(process, 0) + size(unit)
        for j, k in unit:
            readers[j][k] = next(d for d in layouts[j].holders[k] if d.process_index == process)
    return readers


__all__ = ["Layout", "Shared", "crosses", "key_of", "layout", "plan", "region_of", "wire_dtype"]
