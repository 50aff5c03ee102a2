"""What every record treestore reads has in common: msgpack decoding that trusts nothing, a
format version, typed fields with bounds, and BLAKE3 digests."""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Iterator
from time import monotonic
from typing import Any

import blake3
import msgpack

try:
    import resource
except ImportError:  # not a POSIX system: no address-space limit
    resource = None  # type: ignore[assignment]

from treestore.errors import ManifestDamagedError, OutOfMemoryError, UnsupportedFormatError

FORMAT_VERSION = 2  # the version this treestore writes
NEWEST_VERSION = 2  # the newest version this treestore reads (it reads every version from 1)
DIGEST_BYTES = 32


ALL_CORES_FROM = 16 * 2**20  # a chunk this big may be hashed and compressed on every core


def digest(data: Any, *, spread: bool = False) -> bytes:
    """BLAKE3 of any buffer (bytes, memoryview, contiguous numpy array); with ``spread``, on
    every core (for a big chunk that no other work overlaps). Those threads are the call's own,
    gone when it returns: a pool kept for the process (BLAKE3's ``AUTO``) would leave a process
    forked later hanging on threads it does not have.

    Under an address-space limit the call runs in room kept for it (:func:`_free_room`): BLAKE3's
    bindings abort the process when an allocation of their own fails, and Python cannot catch
    that. Raises MemoryError when there is no such room."""
    threads = (os.cpu_count() or 1) if spread else 1
    if monotonic() >= _next_look:
        _look()
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
    limit = resource.getrlimit(resource.RLIMIT_AS)[0] if resource is not None else None
    _is_limited = limit is not None and limit != resource.RLIM_INFINITY
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


def to_msgpack(obj: object) -> bytes:
    """msgpack encoding (bin type for bytes), as every record and digest uses."""
    return msgpack.packb(obj, use_bin_type=True)


class Bad(Exception):
    """Internal: a schema violation, turned into ManifestDamagedError with context."""


@contextlib.contextmanager
def manifest_errors(what: str, checkpoint: str) -> Iterator[None]:
    """How a manifest decoder reports what it finds wrong: ``Bad`` becomes a ManifestDamagedError
    saying ``what``, and an UnsupportedFormatError or ManifestDamagedError raised inside gets
    ``what`` in front of its message and the checkpoint's name."""
    try:
        yield
    except Bad as exc:
        raise ManifestDamagedError(f"{what}: {exc}", checkpoint=checkpoint) from None
    except (UnsupportedFormatError, ManifestDamagedError) as exc:
        exc.checkpoint = checkpoint
        exc.message = f"{what}: {exc.message}"
        exc.args = (exc.message,)
        raise


def field(rec: dict[str, Any], key: str, *types: type) -> Any:
    if key not in rec:
        raise Bad(f"missing field {key!r}")
    value = rec[key]
    if types and not (type(value) in types or (float in types and type(value) is int)):
        raise Bad(
            f"field {key!r} should be {'/'.join(t.__name__ for t in types)}, found {type(value).__name__}"
        )
    return value


def count(value: object, what: str, limit: int = 2**62) -> int:
    if type(value) is not int or not 0 <= value <= limit:
        raise Bad(f"{what} should be an integer in [0, {limit}], found {value!r}")
    return value


def from_msgpack(data: bytes, what: str, checkpoint: str | None) -> dict[str, Any]:
    """A msgpack map decoded without trusting it; ManifestDamagedError names ``what``."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except MemoryError:
        raise OutOfMemoryError(f"{what}: out of memory decoding it", checkpoint=checkpoint) from None
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ManifestDamagedError(
            f"{what} is not valid msgpack ({type(exc).__name__}: {exc})", checkpoint=checkpoint
        ) from None
    if not isinstance(obj, dict):
        raise ManifestDamagedError(f"{what} is not a map", checkpoint=checkpoint)
    return obj


def check_version(rec: dict[str, Any], magic: str, what: str, checkpoint: str | None) -> int:
    if rec.get("format") != magic:
        raise ManifestDamagedError(
            f"{what} has format {rec.get('format')!r}, expected {magic!r}", checkpoint=checkpoint
        )
    version = rec.get("version")
    if type(version) is not int:
        raise ManifestDamagedError(f"{what} has no integer version", checkpoint=checkpoint)
    if version > NEWEST_VERSION or version < 1:
        raise UnsupportedFormatError(
            f"{what} has format version {version}; this treestore reads versions 1 to "
            f"{NEWEST_VERSION} — upgrade treestore to read it",
            checkpoint=checkpoint,
        )
    return version
