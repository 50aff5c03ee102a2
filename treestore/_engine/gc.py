"""Garbage collection by reachability, and the locks that keep it from racing saves.

A save announces itself with a lock object before it looks for existing chunks, and removes it
after its commit; gc announces itself the same way, then looks for save locks. Each side writes
before it reads, so at least one sees the other: a save waits for a running gc, and gc defers while
a save is in flight (SPEC.md, "Garbage collection"). Locks older than ``stale_after`` seconds are
from dead processes and are ignored (and removed by gc).

gc deletes only what it has proved unreferenced: a listing that fails raises before anything is
deleted, and while any commit record or manifest cannot be read (a damaged checkpoint) it
deletes no chunk and no manifest, and names the damaged checkpoints in its report."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from treestore._engine.locks import STALE_AFTER, gc_lock, lock_time
from treestore._engine.reading.committed import committed_records, read_columns
from treestore._format import paths as _paths
from treestore._storage.base import Storage
from treestore.errors import DamagedError, TreestoreError, UnsupportedFormatError

GRACE = 600.0

# A temporary file under locks/ may be a lock being written right now: a save or gc writes its
# lock before it looks for the other side's, so no lock protects that write. gc removes such
# files only once they are this old (other temporary files are written under a save lock,
# which gc sees, and go at the grace period).
LOCK_TEMPORARY_AGE = STALE_AFTER

_DELETE_BATCH = 1000  # objects deleted between two checks that gc's own lock is fresh

_log = logging.getLogger("treestore")


@dataclass(frozen=True)
class GcReport:
    """What a gc run removed (or, with ``dry_run``, would remove).

    ``damaged`` names the checkpoints whose commit record or manifest could not be read; while
    there is one, gc cannot tell what it references and removes no chunk and no manifest (only
    stale locks, outcome and staging records and temporary files). Delete or repair it to free
    space again.

    Attributes:
        chunks_removed: Chunk objects (packs included) that no committed checkpoint references
            and that are at least ``grace`` seconds old, removed; 0 while ``damaged`` is not
            empty.
        bytes_freed: Stored bytes of the chunk objects, manifests and half-written temporary
            files removed (staging records and locks are not counted).
        manifests_removed: Manifest objects (parts of manifests included) that no committed
            checkpoint references and that are at least ``grace`` seconds old, removed; 0 while
            ``damaged`` is not empty.
        locks_removed: Save and gc locks of other processes older than ``stale_after`` seconds
            (left by processes that died), removed.
        kept_young: Unreferenced chunk objects kept because they are younger than ``grace``
            seconds (they may belong to a save still running); 0 while ``damaged`` is not empty.
        dry_run: Whether the run only reported what it would remove (and keep), deleting
            nothing.
        damaged: The names, sorted, of the checkpoints whose commit record or manifest could not
            be read (damaged, or of a format this version cannot read); empty when every
            checkpoint was read.
    """

    chunks_removed: int
    bytes_freed: int
    manifests_removed: int
    locks_removed: int
    kept_young: int
    dry_run: bool
    damaged: tuple[str, ...] = ()


def collect(
    storage: Storage,
    live_manifests: set[bytes],
    live_chunks: set[bytes],
    *,
    grace: float,
    stale_after: float,
    dry_run: bool,
    own_lock: str = "",
    damaged: tuple[str, ...] = (),
    refresh: Callable[[], None] = lambda: None,
) -> GcReport:
    """Remove what no committed checkpoint references. Call it holding a gc lock, with the live
    sets computed after the lock was taken. Only objects whose names treestore writes are ever
    deleted; anything else in the store is left alone. With ``damaged`` (checkpoints whose
    references are unknown) no chunk or manifest is deleted. Every listing is made before
    anything is deleted, so a listing that fails deletes nothing; ``refresh`` keeps the gc lock
    fresh during a long run."""
    now = time.time()

    def old(mtime: float | None, limit: float) -> bool:
        return mtime is not None and now - mtime >= limit

    doomed: list[str] = []
    freed = young = chunks = manifests = 0
    if not damaged:
        for obj in storage.list(_paths.CHUNKS):
            digest = _paths.parse_chunk(obj.path)  # None: not a chunk's path, so kept
            if digest is None or digest in live_chunks:
                continue
            if not old(obj.mtime, grace):
                young += 1
                continue
            doomed.append(obj.path)
            freed += obj.size
        chunks = len(doomed)
        refresh()
        for obj in storage.list(_paths.MANIFESTS):
            found = _paths.parse_manifest(obj.path)
            live = found is None or found in live_manifests
            if not live and old(obj.mtime, grace):
                doomed.append(obj.path)
                freed += obj.size
                manifests += 1
    for obj in storage.list(_paths.STAGING):  # records of multi-process saves that died
        if _paths.parse_staging(obj.path) is not None and old(obj.mtime, grace):
            doomed.append(obj.path)
    for folder in (_paths.CHUNKS, _paths.MANIFESTS, _paths.CHECKPOINTS, _paths.LOCKS, _paths.STAGING):
        age = max(grace, LOCK_TEMPORARY_AGE) if folder == _paths.LOCKS else grace
        for obj in storage.temporaries(folder):  # half-written objects of killed writers
            if old(obj.mtime, age):
                doomed.append(obj.path)
                freed += obj.size
    locks = 0
    for obj in storage.list(_paths.LOCKS):
        ours = _paths.parse_lock(obj.path) is None or obj.path == own_lock
        if not ours and now - lock_time(storage, obj.path, obj.mtime) >= stale_after:
            doomed.append(obj.path)
            locks += 1
    if not dry_run:
        for i in range(0, len(doomed), _DELETE_BATCH):
            refresh()
            storage.delete_many(doomed[i : i + _DELETE_BATCH])
    return GcReport(chunks, freed, manifests, locks, young, dry_run, damaged)


def collect_garbage(
    storage: Storage, *, grace: float, dry_run: bool, wait: float, stale_after: float
) -> GcReport:
    """Take the gc lock, compute what the committed checkpoints reference, and remove the rest
    (see :func:`collect`)."""
    with gc_lock(storage, stale_after=stale_after, wait=wait) as lock:

        def refresh() -> None:  # saves judge gc locks by the default stale limit
            lock.refresh(STALE_AFTER)

        live_manifests: set[bytes] = set()
        live_chunks: set[bytes] = set()
        records, unreadable = committed_records(storage)
        damaged: dict[str, TreestoreError] = dict(unreadable)
        for record in records:
            live_manifests.add(record.manifest)
            try:
                columns = read_columns(storage, record)
                live_manifests.update(columns.parts)  # a manifest stored in parts needs them
                live_chunks |= columns.chunk_digests()
            except (DamagedError, UnsupportedFormatError) as exc:
                damaged[record.name] = exc
            refresh()
        if damaged:
            _log.warning(
                "gc of %s deletes no chunk and no manifest: %d checkpoint(s) cannot be read, so what "
                "they reference is unknown (delete or repair them to free space): %s",
                storage.url,
                len(damaged),
                "; ".join(str(exc) for exc in damaged.values()),
            )
        return collect(
            storage,
            live_manifests,
            live_chunks,
            grace=grace,
            stale_after=stale_after,
            dry_run=dry_run,
            own_lock=lock.path,
            damaged=tuple(sorted(damaged)),
            refresh=refresh,
        )
