"""BLAKE3 digests of any buffer, on one thread or on every core, under an address-space limit too
(the digest of every record and chunk is the format's: ``DIGEST_BYTES`` in
treestore._format.encoding)."""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from time import monotonic
from typing import Any

import blake3

from treestore._kernels.room import limited

ALL_CORES_FROM = 16 * 2**20  # a chunk this big may be hashed and compressed on every core


def digest(data: Any, *, spread: bool = False) -> bytes:
    """BLAKE3 of any buffer (bytes, memoryview, contiguous numpy array); with ``spread``, on
    every core (for a big chunk that no other work overlaps). Those threads are the call's own,
    gone when it returns: a pool kept for the process (BLAKE3's ``AUTO``) would leave a process
    forked later hanging on threads it does not have.

    Under an address-space limit the call runs in room kept for it (:func:`_free_room`): BLAKE3's
    bindings abort the process when an allocation of their own fails, and Python cannot catch
    that. Raises MemoryError when there is no such room."""
    if monotonic() >= _next_look:
        _look()
    if not (_is_limited or spread):  # the common case, a call per small leaf: nothing else
        return blake3.blake3(data).digest()
    threads = (os.cpu_count() or 1) if spread else 1
    if not _is_limited:
        return blake3.blake3(data, max_threads=threads).digest()
    _free_room()
    try:
        return blake3.blake3(data, max_threads=threads).digest()
    finally:
        _keep_room()


NATIVE_ROOM = 16 * 2**20  # bytes of address space each thread keeps for BLAKE3's allocations
_room = threading.local()
_next_look = -1.0  # when to look at the address-space limit again
_is_limited = False  # whether the process runs under one (``RLIMIT_AS``)


def _look() -> None:
    """Look at the address-space limit, and again a second later at the earliest: a system call
    per digest would cost a save of many small leaves."""
    global _next_look, _is_limited
    _is_limited = limited()
    _next_look = monotonic() + 1.0


def _free_room() -> None:
    """Hand this thread's kept room (an untouched anonymous mapping) to the native call about to
    run. Under a limit the last bytes go to whichever allocation comes first; while a thread
    keeps :data:`NATIVE_ROOM` mapped, Python's allocations run out first, where a MemoryError is
    reported, and the native call's own allocations find room. Raises MemoryError when the
    thread has no room and none can be mapped."""
    kept = _room.__dict__.pop("kept", None)
    if kept is None:
        try:
            kept = mmap.mmap(-1, NATIVE_ROOM)
        except OSError:
            raise MemoryError(f"less than {NATIVE_ROOM:,} bytes of address space left for BLAKE3") from None
    kept.close()


def _keep_room() -> None:
    """Map this thread's room again after a native call; without it, the next call refuses."""
    with contextlib.suppress(OSError):
        _room.kept = mmap.mmap(-1, NATIVE_ROOM)
