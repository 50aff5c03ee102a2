"""Saving: tree -> leaves -> chunks (hashed, deduplicated, compressed, written) -> manifest -> commit.

:func:`prepare` does everything that must happen before the caller may touch its tree again (it
validates every leaf and key and copies device arrays to host); :func:`write` does the rest and can
run in the background, through the engine's one door for writes (:mod:`treestore._engine.saving.writing`).
Commit order: chunks, then the manifest, then the commit record."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from treestore._engine.group import distributed as _distributed
from treestore._engine.saving import trusted as _trusted
from treestore._engine.saving.chunk_writer import SaveResult as SaveResult  # the result of write()
from treestore._engine.saving.save_options import SaveOptions as SaveOptions  # write()'s tuning
from treestore._engine.saving.writing import Writing
from treestore._storage.base import Storage
from treestore._tree.collector_pause import paused_collector
from treestore._tree.prepare import Prepared

_DEFAULTS = SaveOptions()


def write(
    storage: Storage,
    prepared: Prepared,
    name: str,
    *,
    metadata: Any = None,
    options: SaveOptions = _DEFAULTS,
    overwrite: bool = False,
    on_chunk: Callable[[int], None] | None = None,
    previous: _trusted.Previous = True,
) -> SaveResult:
    """Write ``prepared`` as checkpoint ``name`` and commit it; on any failure nothing is visible.

    ``previous`` names the committed checkpoint whose chunks the save takes as present without
    asking the store (True: the store's newest; False: none, check every chunk): it is read once
    the save's lock is held, which is what makes trusting it safe (:mod:`treestore._engine.saving.trusted`);
    one that cannot be read is ignored.
    """
    w = Writing(storage, name, options=options, overwrite=overwrite, metadata=metadata, on_chunk=on_chunk)
    group = _distributed.group()
    if group is None:
        with paused_collector(len(prepared.leaves)), w.hold(previous):
            return _write_alone(w, prepared)
    return _write_in_group(group, w, prepared, previous)


def _write_alone(w: Writing, prepared: Prepared) -> SaveResult:
    """The leaves and the commit of a one-process save, holding its lock. Its per-leaf objects
    (the leaf table, the manifest's columns) are this call's own, freed when it returns: before
    the collector resumes, which would otherwise walk them all once more
    (:mod:`treestore._tree.collector_pause`)."""
    table, packs = w.write_leaves(prepared)
    return w.commit(w.columns(table.fields(packs), prepared.nodes))


def _write_in_group(
    group: _distributed.Group, w: Writing, prepared: Prepared, previous: _trusted.Previous
) -> SaveResult:
    """A save by every process of a jax.distributed job; see :mod:`treestore._engine.group.distributed`.
    Each process learns the chunks it may trust under its own lock (which it holds until the
    primary has committed), as a one-process save does.

    Every process shares what it wrote (or the error that stopped it) whatever fails, and every
    wait has a timeout, so none waits forever for another; only the primary commits.
    """
    assert w.name is not None
    group = group.begin(w.name)
    failure: BaseException | None = None
    written: _distributed.Written | None = None
    try:
        w.hold(previous)  # this process's lock and trusted chunks
        table, packs = w.write_leaves(prepared, primary=group.primary, pieces_kept=True)
        written = _distributed.Written(table, packs, w.options.stats)
        w.storage.sync()
    except BaseException as exc:
        failure = exc
    try:
        committed = group.finish(
            w.storage,
            w.lock,
            prepared.tree,
            prepared.leaves,
            written,
            failure,
            w.header(),
            w.commit_manifest,
        )
    finally:
        w.release()  # after a commit the save has succeeded: a failure is logged
    if committed is None:  # another process committed
        return w.writer.result(w.name, 0, 0)
    return w.writer.result(w.name, *committed)
