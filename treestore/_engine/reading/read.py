"""Reading chunks: fetched, checked against their digests, decoded into the caller's memory;
packs read once per reader."""

from __future__ import annotations

import concurrent.futures as cf
import threading
from typing import Any

import numpy as np

from treestore._engine.reading.memory import allocate
from treestore._engine.threads import once
from treestore._format import paths as _paths
from treestore._format.codecs import decode_in_place, decode_into, in_place_room
from treestore._format.limits import CHUNK_HEADER_BYTES, CHUNK_SLACK
from treestore._format.manifest.columns import Columns
from treestore._format.manifest.records import ChunkRef
from treestore._kernels.digest import digest
from treestore._kernels.scratch import scratch, scratch_held
from treestore._storage.base import Storage
from treestore.errors import ChunkDamagedError, ChunkMissingError, TreestoreError


def fetch_object(storage: Storage, c: ChunkRef) -> bytes:
    """The stored object of chunk ``c``, read no further than its size bound allows.

    Raises ChunkMissingError or ChunkDamagedError naming the chunk (callers add the checkpoint and
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
        raise ChunkDamagedError(f"chunk {c.digest.hex()[:16]} is larger than its raw size allows")


def decode_chunk(
    obj: bytes | memoryview,
    c: ChunkRef,
    out: np.ndarray[Any, Any],
    *,
    room: np.ndarray[Any, Any] | None = None,
    check: bool = True,
) -> None:
    """Decode the object of chunk ``c`` into ``out`` (uint8, its raw size) and, with ``check``,
    check its digest; ``room``: a scratch buffer that ``obj`` starts, which decoding may use (it
    then decodes byte planes in place, see :func:`treestore._format.codecs.decode_in_place`)."""
    try:
        if room is None:
            decode_into(obj, out)
        else:
            decode_in_place(room, len(obj), out)
    except ChunkDamagedError as exc:
        raise ChunkDamagedError(f"chunk {c.digest.hex()[:16]} {exc}") from None
    if check and digest(out) != c.digest:
        raise ChunkDamagedError(f"chunk {c.digest.hex()[:16]} does not match its digest")


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
    """Reads, decodes and verifies the chunks of one checkpoint; packs are read once, and so are
    the chunks that several reads are known to need (:meth:`expect`)."""

    def __init__(self, storage: Storage, manifest: Columns) -> None:
        self.storage = storage
        self.name = manifest.name
        self.codec = manifest.codec
        self.packs = manifest.pack_refs()
        self._packs: dict[int, cf.Future[np.ndarray[Any, Any]]] = {}
        self._lock = threading.Lock()
        self._repeats: dict[bytes, int] = {}  # chunk digest -> reads still expected of it
        self._kept: dict[bytes, cf.Future[np.ndarray[Any, Any]]] = {}  # their decoded bytes
        self.bytes_read = 0

    def expect(self, repeats: dict[bytes, int]) -> None:
        """Say that :meth:`read_leaf_chunk` will be asked ``repeats[digest]`` times for each of
        these (non-packed) chunks: each is then fetched and decoded once, and its bytes kept
        until its last read (regions of a leaf that share a chunk: a leaf saved whole, restored
        onto several devices)."""
        with self._lock:
            for d, n in repeats.items():
                self._repeats[d] = self._repeats.get(d, 0) + n

    def _repeated(self, c: ChunkRef, address: str) -> np.ndarray[Any, Any] | None:
        """The decoded bytes of chunk ``c`` if it is one :meth:`expect` named (None if not),
        decoded by the first read; the last read expected lets them go."""
        with self._lock:
            if c.digest not in self._repeats:
                return None

        def decoded() -> np.ndarray[Any, Any]:
            buf = allocate(c.raw_size, address, self.name)
            self.read_into(c, buf, address)
            return buf

        try:
            return once(self._kept, c.digest, self._lock, decoded)
        finally:
            with self._lock:
                left = self._repeats.get(c.digest, 1) - 1
                if left > 0:
                    self._repeats[c.digest] = left
                else:
                    self._repeats.pop(c.digest, None)
                    self._kept.pop(c.digest, None)

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
        except (ChunkMissingError, ChunkDamagedError) as exc:
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
            # New scratch only for an object that is there and within its size bound: what a
            # hostile manifest declares allocates nothing until the store holds it. Scratch
            # this thread holds already costs nothing, and needs no request for the size.
            need = in_place_room(c.raw_size)
            if scratch_held(need, "read"):
                room = scratch(need, "read")
            else:
                stored = self.storage.object_size(_paths.chunk_path(c.digest))
                if stored is not None and stored <= c.raw_size + CHUNK_SLACK:
                    room = scratch(need, "read")
        self._decode(self._object(c, address, room), c, out, address, room)

    def _decode(
        self,
        obj: bytes | memoryview,
        c: ChunkRef,
        out: np.ndarray[Any, Any],
        address: str,
        room: np.ndarray[Any, Any] | None = None,
        check: bool = True,
    ) -> None:
        try:
            decode_chunk(obj, c, out, room=room, check=check)
        except ChunkDamagedError as exc:
            raise self._located(exc, address) from None

    def pack(self, index: int, address: str) -> np.ndarray[Any, Any]:
        """Pack ``index``, decoded (read once per reader; errors name ``address``). Its bytes are
        used only through :meth:`member`, which checks each member against its own digest: the
        pack's digest, over the same bytes again, is left to ``verify`` (SPEC.md section 6.5)."""

        def decoded() -> np.ndarray[Any, Any]:  # once: other leaves of the pack fail alike, unread
            c = self.packs[index]
            obj = self._object(c, address)  # the object first: its size bounds what we allocate
            buf = allocate(c.raw_size, address, self.name)
            self._decode(obj, c, buf, address, check=False)
            return buf

        return once(self._packs, index, self._lock, decoded)

    def member(
        self, pack: np.ndarray[Any, Any], offset: int, size: int, chunk_digest: bytes
    ) -> np.ndarray[Any, Any] | None:
        """The bytes ``[offset, offset + size)`` of a decoded pack (a view) if they match the
        digest of the chunk they hold, else None (raise :meth:`mismatch`)."""
        return pack_member(pack, offset, size, chunk_digest)

    def member_alone(
        self, index: int, offset: int, size: int, chunk_digest: bytes, address: str
    ) -> np.ndarray[Any, Any]:
        """The bytes of one member of pack ``index``, checked against ``chunk_digest``: from the
        pack if this reader has it; else, when the manifest says the pack is stored raw, from
        that range of its object alone (a small leaf's bytes, not its pack's, read and nothing
        decoded: SPEC.md section 6.5); else from the pack, decoded and kept. The stored size
        is only a hint: bytes that do not match the digest send the read the pack's way, which
        names what is wrong."""
        with self._lock:
            decoded = index in self._packs
        c = self.packs[index]
        if not decoded and c.stored_size == CHUNK_HEADER_BYTES + c.raw_size and offset + size <= c.raw_size:
            start = CHUNK_HEADER_BYTES + offset
            data = self.storage.read_range(_paths.chunk_path(c.digest), start, start + size)
            if data is not None:
                with self._lock:
                    self.bytes_read += len(data)
                alone = pack_member(np.frombuffer(data, np.uint8), 0, size, chunk_digest)
                if alone is not None:
                    return alone
        part = self.member(self.pack(index, address), offset, size, chunk_digest)
        if part is None:
            raise self.mismatch(chunk_digest, address)
        return part

    def mismatch(self, chunk_digest: bytes, address: str) -> TreestoreError:
        return self._located(
            ChunkDamagedError(f"chunk {chunk_digest.hex()[:16]} does not match its digest"), address
        )

    def read_leaf_chunk(self, c: ChunkRef, out: np.ndarray[Any, Any], address: str) -> None:
        if c.pack is None:
            kept = self._repeated(c, address) if self._repeats else None
            if kept is None:
                self.read_into(c, out, address)
            else:
                out[:] = kept
            return
        out[:] = self.member_alone(c.pack, c.offset, c.raw_size, c.digest, address)
