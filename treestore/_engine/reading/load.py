"""Loading a checkpoint: which leaves a load reads, reading them, and the tree they make.

The step beside :mod:`treestore._engine.write`: :func:`load` takes a commit record and the
caller's choices (a template, patterns, a prefix) and returns the restored tree. A checkpoint
stored in parts is completed with only the parts holding the leaves it reads; without a
template the stored tree is rebuilt, with one the template's structure is matched and filled
(sharded leaves shard by shard).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from treestore._engine.reading import committed as _committed
from treestore._engine.reading import load_leaves as _load_leaves
from treestore._engine.reading import parts as _parts
from treestore._engine.reading import read as _read
from treestore._engine.reading import region as _region
from treestore._engine.reading import share as _share
from treestore._engine.reading import share_plan as _share_plan
from treestore._engine.reading import staging as _staging
from treestore._engine.reading.memory import ALIGN
from treestore._engine.threads import default_threads
from treestore._format import select as _select
from treestore._format.commit_record import CommitRecord
from treestore._format.manifest.columns import Columns
from treestore._format.manifest.frame import Frame
from treestore._storage.base import Storage
from treestore._tree import template as _template
from treestore._tree.collector_pause import paused_collector
from treestore._tree.jax_import import imported as jax_imported
from treestore._tree.jax_import import jax
from treestore._tree.leaves import restore_array
from treestore._tree.structure import rebuild


def load(
    storage: Storage,
    record: CommitRecord,
    *,
    like: Any,
    select: _select.Patterns,
    prefix: str,
    cast: bool,
    partial: bool,
    threads: int | None,
    trusted: dict[str, type],
    agreement: _share.Agreement | None = None,
) -> Any:
    """The checkpoint ``record`` commits, restored as :meth:`treestore.Store.load` documents
    (the caller has checked that its arguments go together). With an ``agreement`` (a restore
    by every process of a job, :mod:`treestore._engine.group.restore_vote`), the template's
    leaves replicated across processes are read once and shared (:mod:`.share`)."""
    found = _committed.read_frame(storage, record)
    frame = found.columns if isinstance(found, Frame) else found
    wanted = None if select is None else chosen(frame, select)
    columns = _completed(storage, found, like, wanted, prefix, partial) if isinstance(found, Frame) else found
    threads = threads or default_threads()
    with paused_collector(len(columns)):  # the per-leaf objects of a big tree (see collector_pause)
        rows = None if wanted is None else [i for i, a in enumerate(columns.addresses) if a in wanted]
        if like is None:
            return _rebuilt(storage, columns, wanted, rows, threads, trusted)
        if rows is None and columns.unread.any():  # completed for the template's leaves
            rows = np.flatnonzero(~columns.unread).tolist()
        window = LOAD_WINDOW if _to_accelerator() else None
        sharing = None if agreement is None else (agreement, f"{record.name} {record.manifest.hex()}")
        return _like(storage, columns, rows, like, prefix, cast, partial, threads, window, sharing)


LOAD_WINDOW = 256 * 2**20
"""Bytes of whole leaves read before their copies to an accelerator start (see :func:`_like`)."""


def _to_accelerator() -> bool:
    """Whether jax's default device is an accelerator: a template's jax leaves go there."""
    return jax_imported() and jax.default_backend() != "cpu"


def _restore(slot: _template.Slot, found: _load_leaves.Arrays) -> Any:
    """Template slot ``slot`` restored from the host arrays read for it."""
    return _template.restore(slot, None if slot.entry is None else found.get(slot.entry.index))


def _made(slots: list[_template.Slot], found: _load_leaves.Arrays, arena: _staging.Arena) -> list[Any]:
    """The values of ``slots`` restored from host arrays read into ``arena``, none sharing it."""
    return [arena.detach(_restore(slot, found)) for slot in slots]


def _device_bound(slot: _template.Slot) -> _template.Stored | None:
    """The stored array leaf of ``slot`` when it becomes a jax array on a device (its template
    leaf is a jax array or an abstract one, not a numpy array or a Python scalar)."""
    entry, like = slot.entry, slot.like
    if entry is None or not entry.is_array or isinstance(like, (np.ndarray, np.generic)):
        return None
    return entry if hasattr(like, "dtype") else None


def _groups(slots: list[_template.Slot], positions: list[int], window: int | None) -> list[list[int]]:
    """``positions`` (of ``slots``, in order) cut into runs of at most ``window`` stored bytes
    each (a bigger leaf alone); one run without a window."""
    if window is None:
        return [positions] if positions else []
    groups: list[list[int]] = []
    run: list[int] = []
    size = 0
    for k, slot in zip(positions, slots, strict=True):
        nbytes = 0 if slot.entry is None else slot.entry.nbytes
        if run and size + nbytes > window:
            groups.append(run)
            run, size = [], 0
        run.append(k)
        size += nbytes
    return [*groups, run] if run else groups


def chosen(columns: Columns, select: _select.Patterns) -> set[str]:
    """The addresses of ``columns`` that ``select`` matches (every pattern must match one)."""
    where = f"checkpoint {columns.name!r}"
    return set(_select.select(columns.addresses, select, where=where, checkpoint=columns.name))


def _completed(
    storage: Storage, frame: Frame, like: Any, wanted: set[str] | None, prefix: str, partial: bool
) -> Columns:
    """The columns of a checkpoint stored in parts, completed with the parts that hold the
    pieces of the leaves a load reads: those ``wanted`` names (the leaves select matches);
    or with a template that roots at ``prefix`` or may leave leaves out (``partial``), its
    leaves and (unless ``partial``) every leaf under ``prefix``; else every leaf."""
    head = frame.columns
    if wanted is None and like is not None and (prefix or partial):
        wanted = _template.reads(like, prefix, partial, head.addresses)
    if wanted is None:
        return _parts.assemble(storage, frame)
    mask = np.array([a in wanted for a in head.addresses], bool)
    return _parts.assemble(storage, frame, mask)


def _rebuilt(
    storage: Storage,
    columns: Columns,
    wanted: set[str] | None,
    rows: list[int] | None,
    threads: int,
    trusted: dict[str, type],
) -> Any:
    """The stored tree (of the ``wanted`` leaves), its nodes as :func:`rebuild` makes them."""
    keep = None if wanted is None else wanted.__contains__
    which = np.arange(len(columns)) if rows is None else np.array(rows, np.int64)
    arrays = _load_leaves.read_leaves(_read.ChunkReader(storage, columns), columns, which, threads=threads)
    as_stored = columns.as_stored()

    def leaf(i: int) -> Any:
        array = arrays.get(i)
        if array is None:
            return columns.value(i)
        if as_stored[i]:
            return array
        kind, prng_impl, weak_type = columns.restore_kind(i)
        return restore_array(kind, array, prng_impl, weak_type=weak_type)

    return rebuild(columns.tree_record(), leaf, keep, types=trusted, checkpoint=columns.name)


def _like(
    storage: Storage,
    columns: Columns,
    rows: list[int] | None,
    like: Any,
    prefix: str,
    cast: bool,
    partial: bool,
    threads: int,
    window: int | None,
    sharing: tuple[_share.Agreement, str] | None = None,
) -> Any:
    """The checkpoint as template ``like``: matched (every difference in one error), its leaves
    read whole or, for a template sharded over several devices, shard by shard. With a
    ``window``, the whole leaves are read in groups of about that many bytes into reused host
    buffers (:mod:`treestore._engine.reading.staging`), and each group's copies to the devices run while
    the next group is read and decoded. With ``sharing`` (the processes' agreement and the
    checkpoint's token), the leaves replicated across processes are read once and shared."""
    slots, treedef = _template.match(columns, rows, like, cast=cast, prefix=prefix, partial=partial)
    shardings = [_template.target_sharding(s) for s in slots]
    reader = _read.ChunkReader(storage, columns)  # one reader: packs are read once
    whole = [k for k, sharding in enumerate(shardings) if sharding is None]
    restored: dict[int, Any] = {}
    groups = [
        (group, [e for k in group if (e := slots[k].entry) is not None and e.is_array])
        for group in _groups([slots[k] for k in whole], whole, window)
    ]
    staging = None
    if window is not None and groups:  # buffers that hold the biggest group bound for devices
        bound = {k: e for k in whole if (e := _device_bound(slots[k])) is not None}
        sizes = [sum(bound[k].nbytes + ALIGN for k in group if k in bound) for group, _ in groups]
        staging = _staging.Staging(columns.name, max(sizes))
    for group, arrays in groups:
        which = np.array([e.index for e in arrays], np.int64)
        if staging is None:
            found = _load_leaves.read_leaves(reader, columns, which, threads=threads)
            restored.update((k, _restore(slots[k], found)) for k in group)
            continue
        # Read into one of two reused buffers; the group's values are made (their copies to the
        # devices started) on another thread while the next group is read.
        arena = staging.next({columns.address(bound[k].index) for k in group if k in bound})
        found = _load_leaves.read_leaves(reader, columns, which, threads=threads, allocate=arena.allocate)
        staging.place(functools.partial(_made, [slots[k] for k in group], found, arena))
    if staging is not None:
        for (group, _), values in zip(groups, staging.values(), strict=True):
            restored.update(zip(group, values, strict=True))
    sharded = [(slot, s) for slot, s in zip(slots, shardings, strict=True) if s is not None]
    batches, rest = ([], list(range(len(sharded)))) if sharing is None else _share_plan.plan(sharded, columns)

    def read(wanted: list[tuple[_template.Stored, list[_region.Region]]]) -> list[list[np.ndarray]]:
        leaves = [(_region.leaf_pieces(columns, e.index), regions) for e, regions in wanted]
        return _region.read_many(reader, leaves, threads)

    placed = dict(zip(rest, _template.assemble_all([sharded[k] for k in rest], read), strict=True))
    if sharing is not None:
        placed.update(_share.restore_shared(reader, columns, batches, threads, *sharing))
    at = iter(range(len(sharded)))
    leaves = [restored[k] if sharding is None else placed[next(at)] for k, sharding in enumerate(shardings)]
    return jax.tree_util.tree_unflatten(treedef, leaves)


__all__ = ["chosen", "load"]
