"""Reading: commit records, manifests, and chunks, each verified before use."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import difflib
import functools
import inspect
import logging
import math
import mmap
import os
import sys
import threading
from typing import Any

import numpy as np

from treestore._engine.parts import assemble
from treestore._format import paths as _paths
from treestore._format.codecs import decode_in_place, decode_into, in_place_room, scratch
from treestore._format.columns import Columns
from treestore._format.columns_codec import decode_any
from treestore._format.commit_record import CommitRecord, decode_commit_record
from treestore._format.encoding import digest
from treestore._format.limits import CHUNK_SLACK, MAX_MANIFEST_BYTES, MAX_RECORD_BYTES
from treestore._format.manifest import check_name
from treestore._format.parted import Parted
from treestore._format.records import ChunkRef
from treestore._storage.base import Storage
from treestore.errors import (
    CheckpointNotFoundError,
    ChunkCorruptError,
    ChunkMissingError,
    CorruptionError,
    ManifestCorruptError,
    OutOfMemoryError,
    TreestoreError,
    UnsupportedFormatError,
)

_log = logging.getLogger("treestore")


def read_commit_record(storage: Storage, name: str) -> CommitRecord:
    check_name(name)
    data = storage.read_range(_paths.record_path(name), 0, MAX_RECORD_BYTES + 1)
    if data is None:
        raise not_found(storage, name)
    return decode_commit_record(data, name)


def not_found(storage: Storage, name: str | None) -> CheckpointNotFoundError:
    """The error for a checkpoint ``name`` (None: any checkpoint) that is not in ``storage``, in
    the one wording every reader uses: "no treestore store at URL" when nothing of a store is
    there, else "no checkpoint 'NAME' in store URL (did you mean 'N1'?)" or "no checkpoints in
    store URL". Only this error path lists the store (a listing that fails adds nothing)."""
    if not _is_store(storage):
        wanted = f" (looking for checkpoint {name!r})" if name is not None else " (no checkpoints in it)"
        return CheckpointNotFoundError(f"no treestore store at {storage.url}{wanted}", checkpoint=name)
    if name is None:
        return CheckpointNotFoundError(f"no checkpoints in store {storage.url}")
    try:
        names = checkpoint_names(storage)
    except TreestoreError:  # a read-only store that cannot be listed: no suggestions
        names = None
    close = difflib.get_close_matches(name, names or [], n=3, cutoff=0.6)
    hint = f" (did you mean {' or '.join(repr(n) for n in close)}?)" if close else ""
    if names == []:
        hint = " (it has no checkpoints)"
    return CheckpointNotFoundError(f"no checkpoint {name!r} in store {storage.url}{hint}", checkpoint=name)


def _is_store(storage: Storage) -> bool:
    """Whether anything of a store is at ``storage``'s URL; a store that cannot tell (a server
    that answers no folder URL) counts as one."""
    if storage.read_only:
        return True
    try:
        return any(storage.exists(folder) for folder in _paths.FOLDERS)
    except TreestoreError:
        return True


def checkpoint_names(storage: Storage) -> list[str]:
    """Names of the committed checkpoints: objects directly in ``checkpoints/`` whose names are
    valid checkpoint names (anything else there is ignored)."""
    names = []
    prefix = _paths.CHECKPOINTS + "/"
    for obj in storage.list(_paths.CHECKPOINTS):
        name = obj.path[len(prefix) :] if obj.path.startswith(prefix) else ""
        try:
            names.append(check_name(name))
        except TreestoreError:
            continue
    return sorted(set(names))


@functools.cache
def physical_memory() -> int:
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # not a POSIX system: no cap
        return 2**62


ALIGN = 64  # bytes; what jax's CPU client needs to use a host buffer in place
SMALL_PAGES_FROM = 4 * 2**20  # bytes from which a result is faulted in with ordinary pages
_MADV_NOHUGEPAGE = 15


def _load_madvise() -> Any:
    """libc's madvise, or None off Linux (loaded once, at import: never while reading a store)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_MADVISE = _load_madvise()


def _small_pages(buf: np.ndarray[Any, Any]) -> None:
    """Undo the huge-page hint numpy gives a big new array before it is touched: where memory
    is fragmented, faulting in huge pages stalls on compaction (GPT-2 shapes loaded in 0.4-0.9 s
    instead of 0.3-0.4 s). Best effort: nothing changes where madvise is missing or refuses."""
    madvise = _MADVISE
    page = mmap.PAGESIZE
    start = buf.ctypes.data + (-buf.ctypes.data % page)
    length = (buf.ctypes.data + buf.nbytes - start) // page * page
    if madvise is not None and length > 0:
        madvise(start, length, _MADV_NOHUGEPAGE)


def allocate(
    shape: int | tuple[int, ...], address: str, checkpoint: str, dtype: Any = np.uint8
) -> np.ndarray[Any, Any]:
    """``np.empty``, aligned to :data:`ALIGN` bytes, with running out of memory reported as a
    TreestoreError naming the leaf.

    More than the machine's physical memory is refused before allocating: the operating system
    would grant it lazily and kill the process later.
    """
    dims = (shape,) if isinstance(shape, int) else shape
    nbytes = math.prod(dims) * np.dtype(dtype).itemsize
    if nbytes > physical_memory():
        raise OutOfMemoryError(
            f"{address or '(root)'}: {nbytes:,} bytes declared by checkpoint {checkpoint!r} exceed "
            f"this machine's {physical_memory():,} bytes of memory",
            address=address,
            checkpoint=checkpoint,
        )
    try:
        # 64-byte aligned: jax puts an aligned host array on a CPU device without copying it.
        buf = np.empty(nbytes + ALIGN - 1, np.uint8)
        if nbytes >= SMALL_PAGES_FROM:
            _small_pages(buf)
        at = -buf.ctypes.data % ALIGN
        return buf[at : at + nbytes].view(dtype).reshape(dims)
    except (MemoryError, ValueError) as exc:
        raise OutOfMemoryError(
            f"{address or '(root)'}: cannot allocate {shape} of {np.dtype(dtype).name} "
            f"for checkpoint {checkpoint!r}: {type(exc).__name__}",
            address=address,
            checkpoint=checkpoint,
        ) from None


def allocate_many(
    shapes: list[tuple[int, ...]], address: str, checkpoint: str, dtype: Any
) -> list[np.ndarray[Any, Any]]:
    """:func:`allocate` of several arrays (a leaf's device shards) as views of one allocation,
    each aligned to :data:`ALIGN` bytes: one memory check and one buffer, not one per shard."""
    itemsize = np.dtype(dtype).itemsize
    sizes = [math.prod(shape) * itemsize for shape in shapes]
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size + (-size % ALIGN))
    buf = allocate(starts[-1], address, checkpoint)
    return [
        buf[at : at + size].view(dtype).reshape(shape)
        for at, size, shape in zip(starts, sizes, shapes, strict=False)
    ]


class memory_named:
    """``with memory_named(doing, checkpoint):`` turns a MemoryError from any allocation while
    ``doing`` something (a manifest's objects, a tree being rebuilt) into OutOfMemoryError saying
    what, and naming ``checkpoint``: a reader raises only TreestoreErrors. (Allocations of leaf
    data name the leaf: :func:`allocate`.)

    The frames that failed still hold what they allocated until their traceback goes, so they
    are cleared first: otherwise making the new error can itself run out of memory."""

    def __init__(self, doing: str, checkpoint: str | None = None) -> None:
        self.doing, self.checkpoint = doing, checkpoint

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if kind is None or not issubclass(kind, MemoryError) or issubclass(kind, OutOfMemoryError):
            return
        _release(tb)
        raise OutOfMemoryError(
            f"out of memory {self.doing}: this process cannot hold what that needs",
            checkpoint=self.checkpoint,
        ) from None


def _release(tb: Any) -> None:
    """Clear the locals of the frames a traceback went through that are no longer running (the
    frame of the ``with`` statement and its callers still are: clearing one would raise, and
    under memory pressure even making that error fails)."""
    running = set()
    frame: Any = sys._getframe()
    while frame is not None:
        running.add(id(frame))
        frame = frame.f_back
    while tb is not None:
        # A generator's frame is left alone: clearing it closes the generator, running code.
        if id(tb.tb_frame) not in running and not tb.tb_frame.f_code.co_flags & _GENERATORS:
            with contextlib.suppress(RuntimeError):
                tb.tb_frame.clear()
        tb = tb.tb_next


_GENERATORS = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def committed_records(
    storage: Storage,
) -> tuple[list[CommitRecord], dict[str, CorruptionError | UnsupportedFormatError]]:
    """The commit records of every checkpoint, and the checkpoints whose record cannot be used:
    name -> the error reading it raised (damaged, or of a format this version cannot read).

    One deleted while listing is in neither. A listing or read that fails raises StorageError.
    """
    refs = []
    damaged: dict[str, CorruptionError | UnsupportedFormatError] = {}
    for name in checkpoint_names(storage):
        try:
            refs.append(read_commit_record(storage, name))
        except CheckpointNotFoundError:
            continue  # deleted since the listing: it needs no protection and no entry
        except (CorruptionError, UnsupportedFormatError) as exc:
            damaged[name] = exc
    return refs, damaged


def readable_records(storage: Storage) -> list[CommitRecord]:
    """The commit records a listing shows: a damaged one is left out, with a warning (logger
    ``treestore``) naming it, so one bad checkpoint does not hide the others; one of a format
    this version cannot read raises UnsupportedFormatError (upgrade treestore)."""
    refs, damaged = committed_records(storage)
    for exc in damaged.values():
        if isinstance(exc, UnsupportedFormatError):
            raise exc
    if damaged:
        _log.warning(
            "%s: %d damaged checkpoint(s) left out (verify names what is wrong; delete them to "
            "let gc free space): %s",
            storage.url,
            len(damaged),
            "; ".join(str(exc) for exc in damaged.values()),
        )
    return refs


def newest_record(storage: Storage) -> CommitRecord:
    """The newest readable commit record (see :func:`readable_records`)."""
    refs = readable_records(storage)
    if not refs:
        raise not_found(storage, None)
    return max(refs, key=lambda r: (r.created, r.name))


def read_manifest_bytes(storage: Storage, record: CommitRecord) -> bytes:
    """The manifest a commit record names, after checking its size and digest."""
    path = _paths.manifest_path(record.manifest)
    data = storage.read_range(path, 0, min(record.manifest_size, MAX_MANIFEST_BYTES) + 1)
    if data is None:
        raise ManifestCorruptError(
            f"manifest of checkpoint {record.name!r} is missing from {storage.url}",
            checkpoint=record.name,
        )
    if len(data) != record.manifest_size or digest(data) != record.manifest:
        raise ManifestCorruptError(
            f"manifest of checkpoint {record.name!r} does not match its digest "
            f"({len(data)} bytes read, {record.manifest_size} expected)",
            checkpoint=record.name,
        )
    return data


def read_columns(storage: Storage, record: CommitRecord, data: bytes | None = None) -> Columns:
    """The verified manifest of a commit record, of either format version, as :class:`Columns`:
    what readers that need a few leaves, or whole columns, use (no per-leaf object is made).
    One stored in parts is completed with its parts."""
    found = read_frame(storage, record, data)
    return assemble(storage, found) if isinstance(found, Parted) else found


def read_frame(storage: Storage, record: CommitRecord, data: bytes | None = None) -> Columns | Parted:
    """The verified manifest of a commit record as :func:`read_columns` gives it, except that
    one stored in parts stays its frame (checked against the record; its parts not read): for
    readers of some leaves, which complete it with the parts they need
    (:func:`treestore._engine.parts.assemble`)."""
    data = data if data is not None else read_manifest_bytes(storage, record)
    found = decode_any(data, record.name)
    if isinstance(found, Parted):
        _described(record, found.frame)
        return found
    return _described(record, found)


def _described(record: CommitRecord, manifest: Columns) -> Columns:
    """``manifest``, once the commit record naming it is checked to describe it."""
    differences = manifest.mismatches(record)
    if differences:
        raise ManifestCorruptError(
            f"commit record of checkpoint {record.name!r} does not match its manifest: "
            + "; ".join(differences),
            checkpoint=record.name,
        )
    return manifest


def fetch_object(storage: Storage, c: ChunkRef) -> bytes:
    """The stored object of chunk ``c``, read no further than its size bound allows.

    Raises ChunkMissingError or ChunkCorruptError naming the chunk (callers add the checkpoint and
    the address).
    """
    data = storage.read_range(_paths.chunk_path(c.digest), 0, c.raw_size + CHUNK_SLACK + 1)
    _check_fetched(c, None if data is None else len(data))
    assert data is not None
    return data


def fetch_object_into(storage: Storage, c: ChunkRef, buf: np.ndarray[Any, Any]) -> memoryview:
    """:func:`fetch_object`, read into the start of ``buf`` (uint8, at least the size bound):
    a view of the bytes read."""
    n = storage.read_into(_paths.chunk_path(c.digest), buf[: c.raw_size + CHUNK_SLACK + 1].data)
    _check_fetched(c, n)
    assert n is not None
    return buf[:n].data


def _check_fetched(c: ChunkRef, n: int | None) -> None:
    """The checks on the ``n`` bytes (None: no object) read of chunk ``c``'s object."""
    if n is None:
        raise ChunkMissingError(f"chunk {c.digest.hex()[:16]} is missing")
    if n > c.raw_size + CHUNK_SLACK:
        raise ChunkCorruptError(f"chunk {c.digest.hex()[:16]} is larger than its raw size allows")


def decode_chunk(
    obj: bytes | memoryview,
    c: ChunkRef,
    out: np.ndarray[Any, Any],
    *,
    room: np.ndarray[Any, Any] | None = None,
) -> None:
    """Decode the object of chunk ``c`` into ``out`` (uint8, its raw size) and check its digest;
    ``room``: a scratch buffer that ``obj`` starts, which decoding may use (it then decodes
    byte planes in place, see :func:`treestore._format.codecs.decode_in_place`)."""
    try:
        if room is None:
            decode_into(obj, out)
        else:
            decode_in_place(room, len(obj), out)
    except ChunkCorruptError as exc:
        raise ChunkCorruptError(f"chunk {c.digest.hex()[:16]} {exc}") from None
    if digest(out) != c.digest:
        raise ChunkCorruptError(f"chunk {c.digest.hex()[:16]} does not match its digest")


def fetch_chunk(storage: Storage, c: ChunkRef) -> tuple[bytes, np.ndarray[Any, Any]]:
    """The stored object of chunk ``c`` and its decoded raw bytes, verified against its digest."""
    obj = fetch_object(storage, c)
    raw = np.empty(c.raw_size, np.uint8)
    decode_chunk(obj, c, raw)
    return obj, raw


def pack_member(
    pack: np.ndarray[Any, Any], offset: int, size: int, chunk_digest: bytes
) -> np.ndarray[Any, Any] | None:
    """The bytes ``[offset, offset + size)`` of decoded pack ``pack`` (a view) if they lie in it
    and match ``chunk_digest``, the digest of the leaf chunk they hold; else None. Every reader
    of a pack member (load, open, verify, copy) checks it here."""
    part = pack[offset : offset + size]
    return part if part.nbytes == size and digest(part) == chunk_digest else None


def member_mismatch(pack_digest: bytes, offset: int, size: int) -> str:
    """What is wrong when :func:`pack_member` finds no member at ``[offset, offset + size)``."""
    return (
        f"bytes {offset}..{offset + size} of pack chunk {pack_digest.hex()[:16]} "
        "do not match the leaf's digest"
    )


# Chunks of these raw sizes are read into a thread's scratch and decoded there (local stores).
IN_PLACE_FROM, IN_PLACE_UP_TO = 256 * 1024, 16 * 2**20


class ChunkReader:
    """Reads, decodes and verifies the chunks of one checkpoint; packs are read once."""

    def __init__(self, storage: Storage, manifest: Columns) -> None:
        self.storage = storage
        self.name = manifest.name
        self.codec = manifest.codec
        self.packs = manifest.pack_refs()
        self._packs: dict[int, cf.Future[np.ndarray[Any, Any]]] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0

    def _located(self, exc: TreestoreError, address: str) -> TreestoreError:
        """``exc`` (raised for a chunk) with the address and checkpoint it concerns."""
        return type(exc)(
            f"{address or '(root)'}: {exc} in checkpoint {self.name!r} of {self.storage.url}",
            checkpoint=self.name,
            address=address,
        )

    def _object(self, c: ChunkRef, address: str, room: np.ndarray[Any, Any] | None = None) -> memoryview:
        """Chunk ``c``'s object (read into ``room`` when given); errors name ``address``."""
        try:
            data = (
                memoryview(fetch_object(self.storage, c))
                if room is None
                else fetch_object_into(self.storage, c, room)
            )
        except (ChunkMissingError, ChunkCorruptError) as exc:
            raise self._located(exc, address) from None
        with self._lock:
            self.bytes_read += len(data)
        return data

    def read_into(self, c: ChunkRef, out: np.ndarray[Any, Any], address: str) -> None:
        """Decode the (non-packed) chunk ``c`` into ``out`` (uint8, c.raw_size) and verify it.

        From a store that reads into buffers (local files), a big chunk's object is read into
        this thread's scratch and its byte planes decoded there: no copy of the object is made."""
        room = None
        if self.storage.reads_into and IN_PLACE_FROM <= c.raw_size <= IN_PLACE_UP_TO:
            # Scratch only for an object that is there and within its size bound: what a
            # hostile manifest declares allocates nothing until the store holds it.
            stored = self.storage.object_size(_paths.chunk_path(c.digest))
            if stored is not None and stored <= c.raw_size + CHUNK_SLACK:
                room = scratch(in_place_room(c.raw_size), "read")
        self._decode(self._object(c, address, room), c, out, address, room)

    def _decode(
        self,
        obj: bytes | memoryview,
        c: ChunkRef,
        out: np.ndarray[Any, Any],
        address: str,
        room: np.ndarray[Any, Any] | None = None,
    ) -> None:
        try:
            decode_chunk(obj, c, out, room=room)
        except ChunkCorruptError as exc:
            raise self._located(exc, address) from None

    def pack(self, index: int, address: str) -> np.ndarray[Any, Any]:
        """Pack ``index``, decoded and verified (read once per reader; errors name ``address``)."""
        with self._lock:
            fut = self._packs.get(index)
            owner = fut is None
            if fut is None:
                fut = self._packs[index] = cf.Future()
        if owner:
            try:
                c = self.packs[index]
                obj = self._object(c, address)  # the object first: its size bounds what we allocate
                buf = allocate(c.raw_size, address, self.name)
                self._decode(obj, c, buf, address)
                fut.set_result(buf)
            except BaseException as exc:
                fut.set_exception(exc)  # other leaves of this pack fail alike, without rereading
                raise
        return fut.result()

    def member(
        self, pack: np.ndarray[Any, Any], offset: int, size: int, chunk_digest: bytes
    ) -> np.ndarray[Any, Any] | None:
        """The bytes ``[offset, offset + size)`` of a decoded pack (a view) if they match the
        digest of the chunk they hold, else None (raise :meth:`mismatch`)."""
        return pack_member(pack, offset, size, chunk_digest)

    def mismatch(self, chunk_digest: bytes, address: str) -> TreestoreError:
        return self._located(
            ChunkCorruptError(f"chunk {chunk_digest.hex()[:16]} does not match its digest"), address
        )

    def read_leaf_chunk(self, c: ChunkRef, out: np.ndarray[Any, Any], address: str) -> None:
        if c.pack is None:
            self.read_into(c, out, address)
            return
        part = self.member(self.pack(c.pack, address), c.offset, c.raw_size, c.digest)
        if part is None:
            raise self.mismatch(c.digest, address)
        out[:] = part
