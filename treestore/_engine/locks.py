"""Lock objects: how a save and a gc announce themselves to each other (SPEC.md, "Garbage
collection and locks")."""

from __future__ import annotations

import contextlib
import os
import socket
import time
import uuid

import msgpack

from treestore._format import layout as _layout
from treestore._storage.base import Storage
from treestore.errors import StoreBusyError

STALE_AFTER = 3600.0


def _lock_record(kind: str) -> bytes:
    return msgpack.packb(
        {"kind": kind, "created": time.time(), "host": socket.gethostname(), "pid": os.getpid()}
    )


def lock_time(storage: Storage, path: str, mtime: float | None) -> float:
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
        if name.startswith(kind + "-") and now - lock_time(storage, obj.path, obj.mtime) < stale_after:
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
