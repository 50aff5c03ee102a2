"""Which device reads which bytes of a restore whose leaves are replicated across processes.

A leaf restored onto a ``NamedSharding`` whose mesh spans every process of the job, and which
that sharding replicates along mesh axes crossing processes, is *shared*. Its devices fall into
replica groups (those holding one region of it: devices that differ only along its replicated
axes), and a device's place in its group is its *replica index*, its coordinates along those
axes. Each shared leaf, or each part of one, gets one replica index: in every group the device
at that index reads the group's region (or the part's rows of it) from storage (checked against
its digests) and the group's other devices get the bytes from an all-gather along the
replicated axes (:mod:`treestore._engine.reading.share`).

The leaves that share a mesh and replicated axes are planned together, in batches of at most
:data:`BATCH_BYTES` (largest first): each replica index gets about as many bytes (largest
first, each to the least loaded index), so every device, and every process, reads about as
much. A leaf bigger than a replica index's share of its batch is read in parts, row ranges split
where its stored chunks end; the leaves whose regions need one stored object (small leaves in
one pack) get one index, so that object is read once per group. A device's bytes of a batch
are one *segment*: the regions and parts it reads, one after the other, at offsets every
process computes alike.

This module only plans, from the template's shardings and the manifest alone: every process
makes the same plan. A leaf whose dtype cannot travel bit for bit as bytes (sub-byte types,
complex numbers, PRNG keys; 64-bit types without ``jax_enable_x64``), whose sharding is not a
``NamedSharding`` over a concrete mesh of every process, splits an axis unevenly, or keeps each
replica group within one process, is read as before, by every process that holds it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from treestore._engine.reading import region as _region
from treestore._format.manifest.columns import Columns
from treestore._tree import template as _template
from treestore._tree.jax_import import jax

Region = tuple[slice, ...]
Key = tuple[tuple[int, int], ...]  # a region's bounds: hashable
BATCH_BYTES = 256 * 2**20  # bytes of shared leaves per collective, at most (a bigger leaf alone)
ALIGN = 64  # bytes: where a leaf's region starts in its reader's segment (see share._cut)


def wire_dtype(dtype: Any) -> np.dtype[Any] | None:
    """The unsigned integer type of ``dtype``'s width, when a leaf of it travels as its bytes and
    comes back bit for bit; None for sub-byte and complex types, PRNG keys, and 64-bit types
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


def region_of(index: tuple[slice, ...] | None, shape: tuple[int, ...]) -> Region:
    """The region a shard index (as jax gives it: slices, maybe fewer than the dimensions)
    stands for, with concrete bounds."""
    out = [slice(*s.indices(n)[:2]) for s, n in zip(index or (), shape, strict=False)]
    return tuple(out + [slice(0, n) for n in shape[len(out) :]])


def key_of(region: Region) -> Key:
    return tuple((r.start, r.stop) for r in region)


@dataclass(frozen=True)
class Layout:
    """How a sharding lays out a leaf of one shape: the mesh axes it replicates the leaf along
    (``axes``, whose sizes multiply to ``replicas``), its distinct regions (one per replica
    group; ``keys``: a region's index by its bounds), the devices of each group by replica index
    (``holders[k][r]``), and each device's group and replica index (``place``)."""

    axes: tuple[str, ...]
    replicas: int
    regions: tuple[Region, ...]
    holders: tuple[tuple[Any, ...], ...]
    keys: dict[Key, int]
    place: dict[Any, tuple[int, int]]


def _axes_of(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


@functools.lru_cache(maxsize=4096)
def layout(sharding: Any, shape: tuple[int, ...]) -> Layout | None:
    """The layout of a leaf of ``shape`` on ``sharding``, or None when it is not shared: not a
    ``NamedSharding`` over a mesh of every process of the job, an axis split unevenly, or each
    replica group within one process (which reads each region once already)."""
    named = jax.sharding.NamedSharding
    if not isinstance(sharding, named) or not isinstance(sharding.mesh, jax.sharding.Mesh):
        return None
    if sharding.is_fully_addressable:
        return None
    mesh, spec = sharding.mesh, tuple(sharding.spec)
    processes = {d.process_index for d in mesh.devices.flat}
    if len(spec) > len(shape) or processes != set(range(jax.process_count())):
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
    sizes = [mesh.shape[a] for a in replicated]
    where = [mesh.axis_names.index(a) for a in replicated]
    at = {d: coords for coords, d in np.ndenumerate(mesh.devices)}
    keys: dict[Key, int] = {}
    regions: list[Region] = []
    place: dict[Any, tuple[int, int]] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        region = region_of(index, shape)
        k = keys.setdefault(key_of(region), len(regions))
        if k == len(regions):
            regions.append(region)
        # as jax numbers a device along several axes: row-major over them, in the order given
        place[device] = (k, int(np.ravel_multi_index([at[device][i] for i in where], sizes)))
    holders: list[list[Any]] = [[None] * math.prod(sizes) for _ in regions]
    for device, (k, r) in place.items():
        holders[k][r] = device
    if all(len({d.process_index for d in held}) == 1 for held in holders):
        return None  # each replica group within one process: it reads each region once already
    return Layout(replicated, math.prod(sizes), tuple(regions), tuple(map(tuple, holders)), keys, place)


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
    """A leaf read once and shared, or a part of it: its position among the load's sharded
    leaves, its slot, sharding, shape and the template's dtype, its layout, the rows of each of
    its regions (along the region's first axis) this part is (``rows``; None: all of them), the
    replica index whose devices read them (``reader``), and where their bytes lie in their
    segments (``offset``). A leaf's parts, in the order of their rows, make its regions."""

    position: int
    slot: _template.Slot
    sharding: Any
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    layout: Layout
    reader: int = 0
    offset: int = 0
    rows: tuple[int, int] | None = None

    @property
    def index(self) -> int:
        """The leaf's index in the manifest."""
        assert self.slot.entry is not None  # a shared leaf is a stored array
        return self.slot.entry.index

    @property
    def whole_shape(self) -> tuple[int, ...]:
        """The shape of one of the leaf's regions (they are alike: its axes split evenly)."""
        return tuple(r.stop - r.start for r in self.layout.regions[0])

    @property
    def region_shape(self) -> tuple[int, ...]:
        """The shape of this part of one of the leaf's regions."""
        whole = self.whole_shape
        return whole if self.rows is None else (self.rows[1] - self.rows[0], *whole[1:])

    @property
    def region_bytes(self) -> int:
        """The bytes of this part of one of the leaf's regions."""
        return math.prod(self.region_shape) * self.dtype.itemsize

    @property
    def start(self) -> int:
        """Where this part's bytes begin in its region's."""
        row = math.prod(self.whole_shape[1:]) * self.dtype.itemsize
        return 0 if self.rows is None else self.rows[0] * row

    def region(self, k: int) -> Region:
        """This part of the region of replica group ``k``."""
        whole = self.layout.regions[k]
        if self.rows is None:
            return whole
        first = whole[0].start
        return (slice(first + self.rows[0], first + self.rows[1]), *whole[1:])

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Batch:
    """Shared leaves over one mesh and replicated axes, shared by one all-gather of segments of
    ``size`` bytes, one per device."""

    mesh: Any
    axes: tuple[str, ...]
    leaves: tuple[Shared, ...]
    size: int


def plan(sharded: Sequence[tuple[_template.Slot, Any]], columns: Columns) -> tuple[list[Batch], list[int]]:
    """The batches of the shared leaves among ``sharded`` (a load's (slot, sharding) pairs),
    and the positions of the others (read as before)."""
    found: dict[tuple[Any, tuple[str, ...]], list[Shared]] = {}
    rest: list[int] = []
    for position, (slot, sharding) in enumerate(sharded):
        entry = slot.entry
        assert entry is not None  # target_sharding gives no sharding to a kept leaf
        shape = tuple(entry.shape or ())
        dtype = np.dtype(slot.like.dtype)
        lay = None if wire_dtype(dtype) is None or 0 in shape else layout(sharding, shape)
        if lay is None:
            rest.append(position)
            continue
        shared = Shared(position, slot, sharding, shape, dtype, lay)
        found.setdefault((sharding.mesh, lay.axes), []).append(shared)
    batches = [
        _placed(mesh, axes, run, columns, objects)
        for (mesh, axes), leaves in found.items()
        for run, objects in _runs(leaves, columns)
    ]
    return batches, rest


def _runs(leaves: list[Shared], columns: Columns) -> list[tuple[list[Shared], list[Objects]]]:
    """``leaves`` in runs of at most :data:`BATCH_BYTES` (a bigger unit alone), one batch each,
    with the stored objects each of them needs: units (:func:`_units`) largest first, ties in
    plan order, each into the first run with room for it; each run's leaves in plan order.
    Taken in plan order instead, a tree's last big leaf could make a batch alone, its segment
    on one replica index and zeros on the others, which the all-gather would move all the same."""
    objects = [_objects(columns, s) for s in leaves]
    units = _units(leaves, objects, columns, BATCH_BYTES / leaves[0].layout.replicas)
    runs: list[list[int]] = []
    sizes: list[int] = []
    for unit in sorted(units, key=lambda u: (-sum(leaves[j].nbytes for j in u), u[0])):
        size = sum(leaves[j].nbytes for j in unit)
        at = next((i for i, used in enumerate(sizes) if used + size <= BATCH_BYTES), len(runs))
        if at == len(runs):
            runs.append([])
            sizes.append(0)
        runs[at] += unit
        sizes[at] += size
    return [([leaves[j] for j in sorted(run)], [objects[j] for j in sorted(run)]) for run in runs]


Objects = list[tuple[str, Any]]  # the stored objects a leaf's regions need, sorted


def _objects(columns: Columns, s: Shared) -> Objects:
    pieces = _region.leaf_pieces(columns, s.index)
    return sorted(set().union(*(_region.objects_met(pieces, r) for r in s.layout.regions)))


def _placed(
    mesh: Any,
    axes: tuple[str, ...],
    leaves: list[Shared],
    columns: Columns,
    objects: list[Objects],
) -> Batch:
    """``leaves`` given their readers and offsets: a leaf bigger than a reader's share of the
    batch split into parts (:func:`_parts`); units (:func:`_units` of the batch, from the
    ``objects`` each leaf needs; a part alone) go out largest first, ties in plan order, each to
    the least loaded replica index (ties to the lowest), each leaf or part placed after those
    before it in its reader's segment (at a multiple of :data:`ALIGN` bytes)."""
    replicas = leaves[0].layout.replicas
    share = sum(s.region_bytes for s in leaves) / replicas
    entries: list[Shared] = []
    placing: list[list[int]] = []
    for unit in _units(leaves, objects, columns, share):
        if len(unit) == 1 and leaves[unit[0]].region_bytes > share:
            for part in _parts(leaves[unit[0]], columns, share):
                placing.append([len(entries)])
                entries.append(part)
            continue
        placing.append(list(range(len(entries), len(entries) + len(unit))))
        entries += [leaves[j] for j in unit]
    load = [0] * replicas
    reader: dict[int, int] = {}
    for unit in sorted(placing, key=lambda u: (-sum(entries[j].region_bytes for j in u), u[0])):
        r = min(range(replicas), key=lambda i: (load[i], i))
        for j in unit:
            reader[j] = r
            load[r] += entries[j].region_bytes
    offset = [0] * replicas
    placed = []
    for j in sorted(reader, key=lambda j: (entries[j].position, entries[j].rows or (0, 0))):
        s, r = entries[j], reader[j]
        placed.append(dataclasses.replace(s, reader=r, offset=offset[r]))
        offset[r] += -(-s.region_bytes // ALIGN) * ALIGN
    return Batch(mesh, axes, tuple(placed), max(offset))


def _parts(s: Shared, columns: Columns, share: float) -> list[Shared]:
    """Leaf ``s``, bigger than ``share``, as parts of about that many bytes: row ranges of its
    regions, split only where every stored piece the regions meet has a chunk boundary and no
    pack (pieces of the leaf packed together) holds rows on both sides, in any region: no
    stored object is read for two parts but a chunk that two of them hold alike (deduplicated:
    zeros), read once by each. The leaf whole where no such row lies within it."""
    rows = s.whole_shape[0] if s.whole_shape else 0
    pieces = _region.leaf_pieces(columns, s.index)
    found = [_clean_rows(pieces, r) for r in s.layout.regions]
    clean = np.array(sorted(set.intersection(*(c for c, _ in found))), np.int64)
    spans = np.concatenate([packs for _, packs in found])  # [pack, first row, last row]
    if len(spans) and len(clean):
        first = np.full(int(spans[:, 0].max()) + 1, np.iinfo(np.int64).max)
        last = np.full(len(first), np.iinfo(np.int64).min)
        np.minimum.at(first, spans[:, 0], spans[:, 1])
        np.maximum.at(last, spans[:, 0], spans[:, 2])
        inside = np.any((first[:, None] < clean[None, :]) & (clean[None, :] < last[:, None]), axis=0)
        clean = clean[~inside]
    count = min(s.layout.replicas, math.ceil(s.region_bytes / share))
    cuts = [0]
    for i in range(1, count):
        target = rows * i / count
        best = min(clean.tolist(), key=lambda x: (abs(x - target), x), default=None)
        if best is not None and cuts[-1] < best < rows:
            cuts.append(best)
    if len(cuts) == 1:
        return [s]
    cuts.append(rows)
    return [dataclasses.replace(s, rows=(a, b)) for a, b in itertools.pairwise(cuts)]


def _clean_rows(pieces: _region.LeafPieces, region: Region) -> tuple[set[int], np.ndarray]:
    """The rows strictly within ``region``'s first axis (counted from its start) at which a read
    of the rows before and one of the rows after meet no stored chunk in common: in every piece
    of the leaf that the region meets and whose rows run across such a row, a chunk ends there;
    and the packs the region meets, with the first and last of their rows in it (a row
    within them, for one pack or another, is not clean either), one [pack, first, last] each."""
    spans = np.zeros((0, 3), np.int64)
    if not region:
        return set(), spans
    lo, hi = region[0].start, region[0].stop
    bounds = np.array([(r.start, r.stop) for r in region], np.int64)
    meets = np.all((np.maximum(pieces.starts, bounds[:, 0]) < np.minimum(pieces.ends, bounds[:, 1])), axis=1)
    met = np.flatnonzero(meets)
    first_row, last_row = pieces.starts[met, 0], pieces.ends[met, 0]
    row = np.prod(pieces.ends[met, 1:] - pieces.starts[met, 1:], axis=1) * pieces.dtype.itemsize
    # Every chunk of the pieces met, with the piece it belongs to and where it ends in it.
    count = pieces.count[met]
    owner = np.repeat(np.arange(len(met)), count)
    before = np.repeat(np.cumsum(count) - count, count)  # each chunk's piece's first, in the list
    chunk = pieces.first[met][owner] + np.arange(int(count.sum())) - before
    raw = pieces.columns.chunks["raw"][chunk].astype(np.int64)
    ends = np.cumsum(raw)
    ends -= np.concatenate([[0], ends])[before]
    # Each chunk's piece: its first and last row, and the bytes of one of its rows.
    top, bottom, per_row = first_row[owner], last_row[owner], np.maximum(row[owner], 1)
    # The rows of each packed chunk, first to last (the pack's rows: a cut between them, both
    # sides would read the pack).
    pack = pieces.columns.chunks["pack"][chunk].astype(np.int64)
    packed = np.flatnonzero(pack >= 0)
    first_of = top[packed] + (ends[packed] - raw[packed]) // per_row[packed]
    last_of = top[packed] - (-ends[packed] // per_row[packed])
    spans = np.stack([pack[packed], first_of - lo, last_of - lo], axis=1)
    at_row = ends % per_row == 0
    ended = top[at_row] + ends[at_row] // per_row[at_row]
    ended = ended[(top[at_row] < ended) & (ended < bottom[at_row])]
    candidates = np.unique(np.concatenate([first_row, last_row, ended]))
    candidates = candidates[(lo < candidates) & (candidates < hi)]
    # A row is clean where every piece running across it ends a chunk there.
    across = np.searchsorted(np.sort(first_row), candidates, "left") - np.searchsorted(
        np.sort(last_row), candidates, "right"
    )
    values, counts = np.unique(ended, return_counts=True)
    ending = np.zeros(len(candidates), np.int64)
    found = np.searchsorted(values, candidates)
    hit = found < len(values)
    hit[hit] = values[found[hit]] == candidates[hit]
    ending[hit] = counts[found[hit]]
    return {int(x) - lo for x in candidates[across == ending]}, spans


def _units(
    leaves: Sequence[Shared], objects: Sequence[Objects], columns: Columns, most: float
) -> list[list[int]]:
    """The leaves (their positions in ``leaves``) as units of reading, so that a stored object
    is read once per replica group where the units stay about even: a leaf joins the units
    that read objects it needs (``objects``) while, together, they hold at most ``most`` bytes
    of a region, or, for a pack (small leaves, or a leaf's small pieces), at most the pack's raw
    bytes where that is more (a pack of biases is one unit in their batch, however small its
    share). Past that the object is read once by each unit needing it: one unit for a chain of
    packs, or for every zero leaf (alike chunks), would give one reader the whole batch. Units
    in the order of their first leaves."""
    parent: list[int] = []  # units merged when a leaf needs objects two units read

    def root(u: int) -> int:
        while parent[u] != u:
            parent[u] = parent[parent[u]]  # halve the path: later lookups take fewer steps
            u = parent[u]
        return u

    def room(o: tuple[str, Any]) -> float:
        return max(most, int(columns.packs["raw"][o[1]])) if o[0] == "pack" else most

    sizes: list[int] = []
    unit_of: list[int] = []
    owner: dict[tuple[str, Any], int] = {}  # stored object -> the unit that reads it
    for s, needs in zip(leaves, objects, strict=True):
        joins: list[int] = []  # objects sorted: the same units on every process
        held = s.region_bytes
        for o in needs:
            u = root(owner[o]) if o in owner else None
            if u is not None and u not in joins and held + sizes[u] <= room(o):
                joins.append(u)
                held += sizes[u]
        if joins:
            at = joins[0]
        else:
            at = len(parent)
            parent.append(at)
            sizes.append(0)
        for other in joins[1:]:
            parent[other] = at
            sizes[at] += sizes[other]
        unit_of.append(at)
        sizes[at] += s.region_bytes
        for o in needs:
            if o not in owner or (root(owner[o]) != at and sizes[root(owner[o])] > room(o)):
                owner[o] = at  # a full unit's object goes to the next unit that needs it
    units: dict[int, list[int]] = {}
    for j, u in enumerate(unit_of):
        units.setdefault(root(u), []).append(j)
    return sorted(units.values())


__all__ = [
    "ALIGN",
    "BATCH_BYTES",
    "Batch",
    "Layout",
    "Shared",
    "crosses",
    "key_of",
    "layout",
    "plan",
    "region_of",
]
