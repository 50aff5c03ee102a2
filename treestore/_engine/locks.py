"""Lock objects: how a save and a gc announce themselves to each other (SPEC.md, "Garbage
collection and locks")."""

from __future__ import annotations

import functools
import logging
import math
import os
import socket
import time
import uuid
from typing import Any

import msgpack

from treestore._format import paths as _paths
from treestore._format.limits import MAX_LOCK_BYTES
from treestore._storage.base import Storage
from treestore.errors import StorageError, StoreBusyError

STALE_AFTER = 3600.0

# A lock record without a process identity (written by an earlier version) names a live
# process that started more than this long after the record was written: a reused pid. (The
# start time is known to about a second; the margin also absorbs small clock steps.)
_START_SLACK = 5.0

_log = logging.getLogger("treestore")

# Locks this process is done with but could not remove: nothing runs under them any more, so
# this process does not wait for them (other processes do, until they are stale).
_abandoned: set[str] = set()


@functools.cache
def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def _boot_time() -> float | None:
    """When this host booted, seconds since the epoch (Linux ``/proc/stat`` ``btime``), read
    anew each time: the kernel moves it when the wall clock is set, and a value kept from
    earlier in a long-running process would put every process start off by each step since."""
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"btime "):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _process(pid: int) -> tuple[str, float | None] | None:
    """The identity of the running process ``pid`` and when it started (seconds since the
    epoch, if known), or None where the system does not tell (no Linux ``/proc``).

    The identity is this boot's id and the process's start time in clock ticks since boot
    (field 22 of ``/proc/<pid>/stat``): a pid reused by a later process, or after a reboot, has
    another one.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
        ticks = int(text[text.rindex(b")") + 2 :].split()[19])  # fields after "(comm) " start at 3
    except (OSError, ValueError, IndexError):
        return None
    boot = _boot_time()
    started = None if boot is None else boot + ticks / os.sysconf("SC_CLK_TCK")
    return f"{_boot_id()}:{ticks}", started


def _lock_record(kind: str) -> bytes:
    record: dict[str, Any] = {
        "kind": kind,
        "created": time.time(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }
    me = _process(os.getpid())
    if me is not None:
        record["start"] = me[0]
    return msgpack.packb(record)


def lock_time(storage: Storage, path: str, mtime: float | None) -> float:
    """When the lock was last written (its ``created``), by which it ages.

    A lock that cannot be read (over :data:`MAX_LOCK_BYTES`, a failed read) or decoded ages by
    its mtime (at once without one). A lock removed since it was listed, or one of a process of
    this host that is no longer running (see :func:`_writer_running`), is stale at once (0).
    """
    unreadable = mtime if mtime is not None else 0.0
    try:
        data = storage.read(path, limit=MAX_LOCK_BYTES)
    except StorageError:
        return unreadable
    if data is None:
        return 0.0
    try:
        rec = msgpack.unpackb(data, raw=False)
        created = float(rec["created"])
        host, pid = rec["host"], rec["pid"]
    except Exception:
        return unreadable
    if not math.isfinite(created):
        return unreadable
    ours = host == socket.gethostname() and type(pid) is int and pid > 0
    if ours and not _writer_running(pid, rec.get("start"), created):
        return 0.0
    return created


def _writer_running(pid: int, start: object, created: float) -> bool:
    """Whether the process of this host that wrote a lock (``pid``, its identity ``start``,
    ``created``) may still be running: False when no process has that pid, or the one that has
    it is another (another identity; without one, a process started after the lock was
    written). When the system does not tell, it may."""
    if not _alive(pid):
        return False
    now = _process(pid)
    if now is None:
        return True
    identity, started = now
    if isinstance(start, str):
        return start == identity
    return started is None or started <= created + _START_SLACK


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
    for obj in storage.list(_paths.LOCKS):
        named = _paths.parse_lock(obj.path)
        if named is None or named[0] != kind or f"{storage.url}/{obj.path}" in _abandoned:
            continue
        if now - lock_time(storage, obj.path, obj.mtime) < stale_after:
            found.append(obj.path)
    return found


class Lock:
    """A lock object of one kind ("save" or "gc"); a context manager that removes it on exit."""

    def __init__(self, storage: Storage, kind: str) -> None:
        self.storage = storage
        self.path = _paths.lock_path(kind, uuid.uuid4().hex)
        self.kind = kind
        self.written = time.monotonic()
        storage.write(self.path, [_lock_record(kind)])

    def refresh(self, stale_after: float) -> None:
        """Rewrite the lock when a quarter of ``stale_after`` has passed, so it never goes stale."""
        if time.monotonic() - self.written > stale_after / 4:
            self.storage.write(self.path, [_lock_record(self.kind)])
            self.written = time.monotonic()

    def release(self) -> None:
        """Delete the lock; StorageError if that fails."""
        self.storage.delete(self.path)

    def release_quietly(self) -> None:
        """Delete the lock, logging a failure instead of raising it: for when the work is done
        (a save has committed: it has succeeded) or has failed with an error of its own, which
        matters more. A lock left behind only holds the other side back until it is stale, or
        until its process has ended."""
        try:
            self.release()
        except Exception as exc:
            _abandoned.add(f"{self.storage.url}/{self.path}")
            other = "gc" if self.kind == "save" else "saves"
            _log.warning(
                "%s/%s: could not remove this %s lock (%s: %s); it holds %s of other processes "
                "back until it is stale (%.0f s) or this process has ended",
                self.storage.url,
                self.path,
                self.kind,
                type(exc).__name__,
                exc,
                other,
                STALE_AFTER,
            )

    def __enter__(self) -> Lock:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.release_quietly()


def save_lock(storage: Storage, *, stale_after: float = STALE_AFTER, timeout: float = 600.0) -> Lock:
    """Announce a save, then wait (up to ``timeout``) for any running gc to finish."""
    lock = Lock(storage, "save")
    deadline = time.monotonic() + timeout
    delay = 0.02
    while live_locks(storage, "gc", stale_after):
        if time.monotonic() > deadline:
            lock.release_quietly()  # the error to report is that the store is busy
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
