"""Garbage collection by reachability, and the locks that keep it from racing saves.

A save announces itself with a lock object before it looks for existing chunks, and removes it
after its commit; gc announces itself the same way, then looks for save locks. Each side writes
before it reads, so at least one sees the other: a save waits for a running gc, and gc defers while
a save is in flight (SPEC.md, "Garbage collection"). Locks older than ``stale_after`` seconds are
from dead processes and are ignored (and removed by gc)."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from treestore._engine.locks import gc_lock, lock_time
from treestore._engine.read import committed_records, read_manifest
from treestore._format import layout as _layout
from treestore._storage.base import Storage

GRACE = 600.0


@dataclass(frozen=True)
class GcReport:
    """What a gc run removed (or, with ``dry_run``, would remove)."""

    chunks_removed: int
    bytes_freed: int
    manifests_removed: int
    locks_removed: int
    kept_young: int  # unreferenced chunks kept because they are younger than the grace period
    dry_run: bool


_CHUNK = re.compile(r"chunks/([0-9a-f]{2})/(\1[0-9a-f]{62})")


_MANIFEST = re.compile(r"manifests/[0-9a-f]{64}")


_LOCK = re.compile(r"locks/(save|gc)-[0-9a-f]{32}")


_STAGING = re.compile(r"staging/[0-9a-f]{32}/(process-[0-9]+|outcome)")


def collect(
    storage: Storage,
    live_manifests: set[bytes],
    live_chunks: set[bytes],
    *,
    grace: float,
    stale_after: float,
    dry_run: bool,
    own_lock: str = "",
) -> GcReport:
    """Remove what no committed checkpoint references. Call it holding a gc lock, with the live
    sets computed after the lock was taken. Only objects whose names treestore writes are ever
    deleted; anything else in the store is left alone."""
    now = time.time()

    def old(mtime: float | None, limit: float) -> bool:
        return mtime is not None and now - mtime >= limit

    doomed: list[str] = []
    freed = young = 0
    for obj in storage.list(_layout.CHUNKS):
        if not _CHUNK.fullmatch(obj.path) or bytes.fromhex(obj.path[-64:]) in live_chunks:
            continue
        if not old(obj.mtime, grace):
            young += 1
            continue
        doomed.append(obj.path)
        freed += obj.size
    chunks = len(doomed)
    manifests = 0
    for obj in storage.list(_layout.MANIFESTS):
        live = not _MANIFEST.fullmatch(obj.path) or bytes.fromhex(obj.path[-64:]) in live_manifests
        if not live and old(obj.mtime, grace):
            doomed.append(obj.path)
            freed += obj.size
            manifests += 1
    for obj in storage.list(_layout.STAGING):  # records of multi-process saves that died
        if _STAGING.fullmatch(obj.path) and old(obj.mtime, grace):
            doomed.append(obj.path)
    for folder in (_layout.CHUNKS, _layout.MANIFESTS, _layout.CHECKPOINTS, _layout.LOCKS, _layout.STAGING):
        for obj in storage.temporaries(folder):  # half-written objects of killed writers
            if old(obj.mtime, grace):
                doomed.append(obj.path)
                freed += obj.size
    locks = 0
    for obj in storage.list(_layout.LOCKS):
        ours = not _LOCK.fullmatch(obj.path) or obj.path == own_lock
        if not ours and now - lock_time(storage, obj.path, obj.mtime) >= stale_after:
            doomed.append(obj.path)
            locks += 1
    if not dry_run:
        storage.delete_many(doomed)
    return GcReport(chunks, freed, manifests, locks, young, dry_run)


def collect_garbage(
    storage: Storage, *, grace: float, dry_run: bool, wait: float, stale_after: float
) -> GcReport:
    """Take the gc lock, compute what the committed checkpoints reference, and remove the rest
    (see :func:`collect`)."""
    with gc_lock(storage, stale_after=stale_after, wait=wait) as lock:
        live_manifests: set[bytes] = set()
        live_chunks: set[bytes] = set()
        for record in committed_records(storage):
            live_manifests.add(record.manifest)
            live_chunks |= read_manifest(storage, record).chunk_digests()
        return collect(
            storage,
            live_manifests,
            live_chunks,
            grace=grace,
            stale_after=stale_after,
            dry_run=dry_run,
            own_lock=lock.path,
        )
