"""Room in the address space of a process under an address-space limit (``RLIMIT_AS``), looked
for by the Python loops that make an object or more per item of a manifest (a leaf, a node, a
segment), so that they stop while there is room to report running out.

Under such a limit the last bytes go to whichever allocation comes first. A loop of small
allocations can take the process to its last bytes, and then the MemoryError it meets may never
reach any handler: CPython 3.11 to 3.13, entering a handler that needs the offset of the raising
instruction (an ``except`` clause that does not match, a ``with`` block's exit), allocates an int
for an offset past 256 and, when that fails, unwinds to the same handler again, forever
(python/cpython#132508). So each such loop calls :func:`check_room` every :data:`ROOM_EVERY`
items, which raises MemoryError when :data:`ROOM` bytes could not be mapped: that error unwinds,
and readers report it as :class:`~treestore.errors.OutOfMemoryError`, as they report any other."""

from __future__ import annotations

import mmap

try:
    import resource
except ImportError:  # not a POSIX system: no address-space limit
    resource = None  # type: ignore[assignment]

ROOM = 16 * 2**20  # bytes of address space a loop stops with, left for the error and its report
ROOM_EVERY = 1024  # items a loop makes between looks (each a few hundred bytes: well under ROOM)


def limited() -> bool:
    """Whether the process runs under an address-space limit (one ``getrlimit`` call)."""
    return resource is not None and resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY


def check_room() -> None:
    """MemoryError when the process runs under an address-space limit that leaves less than
    :data:`ROOM` bytes to map. Without a limit: one ``getrlimit`` call. Under one: :data:`ROOM`
    bytes mapped, read-only and never touched, and unmapped (no file is opened, nothing is
    committed)."""
    if not limited():
        return
    try:
        probe = mmap.mmap(-1, ROOM, prot=mmap.PROT_READ)
    except OSError:
        raise MemoryError(f"less than {ROOM:,} bytes of address space left") from None
    probe.close()
