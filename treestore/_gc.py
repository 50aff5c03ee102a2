"""Garbage collection by reachability, and the locks that keep it from racing saves.

A save announces itself with a lock object before it looks for existing chunks, and removes it
after its commit; gc announces itself the same way, then looks for save locks. Each side writes
before it reads, so at least one sees the other: a save waits for a running gc, and gc defers while
a save is in flight (SPEC.md, "Garbage collection"). Locks older than ``stale_after`` seconds are
from dead processes and are ignored (and removed by gc).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time
import uuid
from dataclasses import dataclass

import msgpack

from . import _layout
from ._errors import StoreBusyError
from ._storage import Storage

STALE_AFTER = 3600.0
GRACE = 600.0


def _lock_record(kind: str) -> bytes:
    return msgpack.packb(
        {"kind": kind, "created": time.time(), "host": socket.gethostname(), "pid": os.getpid()}
    )


def _lock_time(storage: Storage, path: str, mtime: float | None) -> float:
    """When the lock was last written; 0 for a lock of a process on this host that has died."""
    data = storage.read(path, limit=4096)
    try:
        rec = msgpack.unpackb(data or b"", raw=False)
        created = float(rec["created"])
        host, pid = rec["host"], rec["pid"]
    except Exception:
        return mtime if mtime is not None else 0.0  # an unreadable lock ages by its mtime
    if host == socket.gethostname() and type(pid) is int and pid > 0 and not _alive(pid):
        return 0.0
    return created


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # exists but not ours, or cannot tell: assume alive
    return True


def live_locks(storage: Storage, kind: str, stale_after: float) -> list[str]:
    """Locks of one kind held by processes that may still be running."""
    now = time.time()
    found = []
    for obj in storage.list(_layout.LOCKS):
        name = obj.path.rsplit("/", 1)[-1]
        if name.startswith(kind + "-") and now - _lock_time(storage, obj.path, obj.mtime) < stale_after:
            found.append(obj.path)
    return found


class Lock:
    """A lock object of one kind ("save" or "gc"); a context manager that removes it on exit."""

    def __init__(self, storage: Storage, kind: str) -> None:
        self.storage = storage
        self.path = f"{_layout.LOCKS}/{kind}-{uuid.uuid4().hex}"
        self.kind = kind
        self.written = time.monotonic()
        storage.write(self.path, [_lock_record(kind)])

    def refresh(self, stale_after: float) -> None:
        """Rewrite the lock when a quarter of ``stale_after`` has passed, so it never goes stale."""
        if time.monotonic() - self.written > stale_after / 4:
            self.storage.write(self.path, [_lock_record(self.kind)])
            self.written = time.monotonic()

    def release(self) -> None:
        self.storage.delete(self.path)

    def __enter__(self) -> Lock:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc is None:
            self.release()
            return
        with contextlib.suppress(Exception):  # keep the error that ended the work, not this one
            self.release()


def save_lock(storage: Storage, *, stale_after: float = STALE_AFTER, timeout: float = 600.0) -> Lock:
    """Announce a save, then wait (up to ``timeout``) for any running gc to finish."""
    lock = Lock(storage, "save")
    deadline = time.monotonic() + timeout
    delay = 0.02
    while live_locks(storage, "gc", stale_after):
        if time.monotonic() > deadline:
            lock.release()
            raise StoreBusyError(f"{storage.url}: gc has held the store for over {timeout:.0f} s")
        time.sleep(delay)
        delay = min(delay * 2, 1.0)
    return lock


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
        if not ours and now - _lock_time(storage, obj.path, obj.mtime) >= stale_after:
            doomed.append(obj.path)
            locks += 1
    if not dry_run:
        storage.delete_many(doomed)
    return GcReport(chunks, freed, manifests, locks, young, dry_run)


def gc_lock(storage: Storage, *, stale_after: float, wait: float) -> Lock:
    """Take the gc lock once no save is in flight; StoreBusyError after ``wait`` seconds."""
    deadline = time.monotonic() + wait
    delay = 0.05
    while True:
        lock = Lock(storage, "gc")
        saves = live_locks(storage, "save", stale_after)
        if not saves:
            return lock
        lock.release()
        if time.monotonic() + delay > deadline:
            raise StoreBusyError(
                f"{storage.url}: {len(saves)} save(s) in flight; gc deferred "
                f"(locks: {', '.join(saves)}; locks older than {stale_after:.0f} s are ignored)"
            )
        time.sleep(delay)
        delay = min(delay * 2, 1.0)
