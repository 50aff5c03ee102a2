"""Reading: commit records, manifests, and chunks, each verified before use."""

from __future__ import annotations

import concurrent.futures as cf
import functools
import math
import os
import threading
from typing import Any

import numpy as np

from . import _layout
from ._codecs import HEADER, decode_into
from ._errors import (
    CheckpointNotFoundError,
    ChunkCorruptError,
    ChunkMissingError,
    ManifestCorruptError,
    OutOfMemoryError,
    TreestoreError,
)
from ._manifest import ChunkRef, Manifest, check_name, decode_manifest
from ._ref import MAX_MANIFEST_BYTES, MAX_REF_BYTES, Ref, decode_ref
from ._schema import digest
from ._storage import Storage

_SLACK = HEADER.size + 8 * 8 + 64  # the most a chunk object may exceed its raw size


def read_ref(storage: Storage, name: str) -> Ref:
    check_name(name)
    data = storage.read_range(_layout.ref_path(name), 0, MAX_REF_BYTES + 1)
    if data is None:
        raise CheckpointNotFoundError(f"no checkpoint {name!r} in {storage.url}", checkpoint=name)
    return decode_ref(data, name)


def checkpoint_names(storage: Storage) -> list[str]:
    """Names of the committed checkpoints: objects directly in ``checkpoints/`` whose names are
    valid checkpoint names (anything else there is ignored)."""
    names = []
    prefix = _layout.CHECKPOINTS + "/"
    for obj in storage.list(_layout.CHECKPOINTS):
        name = obj.path[len(prefix) :] if obj.path.startswith(prefix) else ""
        try:
            names.append(check_name(name))
        except TreestoreError:
            continue
    return sorted(set(names))


@functools.cache
def _physical_memory() -> int:
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # not a POSIX system: no cap
        return 2**62


def allocate(
    shape: int | tuple[int, ...], address: str, checkpoint: str, dtype: Any = np.uint8
) -> np.ndarray[Any, Any]:
    """``np.empty``, with running out of memory reported as a TreestoreError naming the leaf.

    More than the machine's physical memory is refused before allocating: the operating system
    would grant it lazily and kill the process later.
    """
    dims = (shape,) if isinstance(shape, int) else shape
    nbytes = math.prod(dims) * np.dtype(dtype).itemsize
    if nbytes > _physical_memory():
        raise OutOfMemoryError(
            f"{address or '(root)'}: {nbytes:,} bytes declared by checkpoint {checkpoint!r} exceed "
            f"this machine's {_physical_memory():,} bytes of memory",
            address=address,
            checkpoint=checkpoint,
        )
    try:
        return np.empty(shape, dtype)
    except (MemoryError, ValueError) as exc:
        raise OutOfMemoryError(
            f"{address or '(root)'}: cannot allocate {shape} of {np.dtype(dtype).name} "
            f"for checkpoint {checkpoint!r}: {type(exc).__name__}",
            address=address,
            checkpoint=checkpoint,
        ) from None


def committed_refs(storage: Storage) -> list[Ref]:
    """The commit records of every checkpoint; one deleted while listing is left out."""
    refs = []
    for name in checkpoint_names(storage):
        try:
            refs.append(read_ref(storage, name))
        except CheckpointNotFoundError:
            continue  # deleted since the listing: it needs no protection and no entry
    return refs


def newest_ref(storage: Storage) -> Ref:
    refs = committed_refs(storage)
    if not refs:
        raise CheckpointNotFoundError(f"no checkpoints in {storage.url}")
    return max(refs, key=lambda r: (r.created, r.name))


def read_manifest(storage: Storage, ref: Ref) -> Manifest:
    path = _layout.manifest_path(ref.manifest)
    data = storage.read_range(path, 0, min(ref.manifest_size, MAX_MANIFEST_BYTES) + 1)
    if data is None:
        raise ManifestCorruptError(
            f"manifest of checkpoint {ref.name!r} is missing from {storage.url}",
            checkpoint=ref.name,
        )
    if len(data) != ref.manifest_size or digest(data) != ref.manifest:
        raise ManifestCorruptError(
            f"manifest of checkpoint {ref.name!r} does not match its digest "
            f"({len(data)} bytes read, {ref.manifest_size} expected)",
            checkpoint=ref.name,
        )
    manifest = decode_manifest(data, ref.name)
    differences = manifest.mismatches(ref)
    if differences:
        raise ManifestCorruptError(
            f"commit record of checkpoint {ref.name!r} does not match its manifest: "
            + "; ".join(differences),
            checkpoint=ref.name,
        )
    return manifest


class ChunkReader:
    """Reads, decodes and verifies the chunks of one checkpoint; packs are read once."""

    def __init__(self, storage: Storage, manifest: Manifest) -> None:
        self.storage = storage
        self.manifest = manifest
        self._packs: dict[int, cf.Future[np.ndarray[Any, Any]]] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0

    def _fail(self, cls: type[TreestoreError], address: str, c: ChunkRef, problem: str) -> TreestoreError:
        return cls(
            f"{address or '(root)'}: chunk {c.digest.hex()[:16]} {problem} "
            f"in checkpoint {self.manifest.name!r} of {self.storage.url}",
            checkpoint=self.manifest.name,
            address=address,
        )

    def _object(self, c: ChunkRef, address: str) -> bytes:
        data = self.storage.read_range(_layout.chunk_path(c.digest), 0, c.size + _SLACK + 1)
        if data is None:
            raise self._fail(ChunkMissingError, address, c, "is missing")
        with self._lock:
            self.bytes_read += len(data)
        if len(data) > c.size + _SLACK:
            raise self._fail(ChunkCorruptError, address, c, "is larger than its raw size allows")
        return data

    def read_into(self, c: ChunkRef, out: np.ndarray[Any, Any], address: str) -> None:
        """Decode the (non-packed) chunk ``c`` into ``out`` (uint8, c.size) and verify it."""
        self._decode(self._object(c, address), c, out, address)

    def _decode(self, obj: bytes, c: ChunkRef, out: np.ndarray[Any, Any], address: str) -> None:
        try:
            decode_into(obj, out)
        except ChunkCorruptError as exc:
            raise self._fail(ChunkCorruptError, address, c, str(exc)) from None
        if digest(out) != c.digest:
            raise self._fail(ChunkCorruptError, address, c, "does not match its digest")

    def _pack(self, index: int, address: str) -> np.ndarray[Any, Any]:
        with self._lock:
            fut = self._packs.get(index)
            owner = fut is None
            if fut is None:
                fut = self._packs[index] = cf.Future()
        if owner:
            try:
                c = self.manifest.packs[index]
                obj = self._object(c, address)  # the object first: its size bounds what we allocate
                buf = allocate(c.size, address, self.manifest.name)
                self._decode(obj, c, buf, address)
                fut.set_result(buf)
            except BaseException as exc:
                fut.set_exception(exc)  # other leaves of this pack fail alike, without rereading
                raise
        return fut.result()

    def read_leaf_chunk(self, c: ChunkRef, out: np.ndarray[Any, Any], address: str) -> None:
        if c.pack is None:
            self.read_into(c, out, address)
            return
        pack = self._pack(c.pack, address)
        part = pack[c.offset : c.offset + c.size]
        if digest(part) != c.digest:
            raise self._fail(ChunkCorruptError, address, c, "does not match its digest")
        out[:] = part
