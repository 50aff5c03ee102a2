"""Copying checkpoints between stores, on the same or different filesystems.

Only chunks the destination lacks are transferred, as the stored objects they are (chunks are named
by the digest of their raw bytes, so an object means the same in every store). Each one is decoded
and checked against its digest before it is written, and every pack is read and each leaf's
reference into it checked, present at the destination or not: a copy commits only what a load of
the source accepts, so a damaged source is never propagated. An
object the destination already holds under a chunk's name is kept only if it passes the check a
save applies before reusing one (``reusable_size``); a bad one is replaced from the source. The
destination is written through the engine's one door, as a save is (:mod:`treestore._engine.saving.writing`:
lock, chunks, manifest, commit record).

As a save does, a copy takes the chunks of the destination's newest checkpoint as present without
a request for each (read once it holds the destination's lock: :mod:`treestore._engine.saving.trusted`),
and then those of each checkpoint it has committed there.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from treestore._api.spec import parse_spec
from treestore._deprecated import renamed_attribute
from treestore._engine.objects import ChunkObject, chunk_objects
from treestore._engine.progress import Progress, counter
from treestore._engine.reading import committed as _committed
from treestore._engine.reading import memory as _memory
from treestore._engine.reading.parts import assemble, part_bytes
from treestore._engine.reading.read import fetch_chunk, member_mismatch
from treestore._engine.reading.scan import bad_members, scan
from treestore._engine.saving import writing as _writing
from treestore._engine.threads import default_threads
from treestore._format import paths as _paths
from treestore._format.manifest.frame import Frame, ListedPart
from treestore._format.manifest.rules import check_name
from treestore._kernels.digest import digest
from treestore._storage.base import Storage
from treestore._storage.registry import open_storage
from treestore.errors import (
    ChunkDamagedError,
    DamagedError,
    InvalidInputError,
    ManifestDamagedError,
)


@dataclass(frozen=True)
class CopyReport:
    """What :func:`copy` did: the checkpoints it committed at the destination, those that were
    already there unchanged, and how many chunks it transferred or found present.

    Attributes:
        src: The source store's URL.
        dst: The destination store's URL.
        copied: The names of the checkpoints committed at the destination, in copy order.
        unchanged: The names of those the destination already held with the same contents
            (nothing was written for them).
        chunks_copied: Chunk objects transferred (each once, however many of the copied
            checkpoints share it).
        bytes_copied: Stored bytes transferred.
        chunks_present: Chunk objects the destination already held (not transferred), each
            counted once.
        chunks_trusted: Of those, the ones a checkpoint at the destination references, taken as
            present without a request.
    """

    src: str
    dst: str
    copied: tuple[str, ...]
    unchanged: tuple[str, ...]
    chunks_copied: int
    bytes_copied: int
    chunks_present: int
    chunks_trusted: int = 0

    chunks_known = renamed_attribute("CopyReport", "chunks_known", "chunks_trusted")


class _Copier:
    def __init__(self, src: Storage, dst: Storage, threads: int, progress: Progress | None) -> None:
        self.src, self.dst = src, dst
        self.threads = threads
        self.progress = progress
        self.copied = self.copied_bytes = self.present = self.trusted_hits = 0
        self.counted: set[bytes] = set()  # chunks counted in the report, once each
        self.total = 0
        self.advance: Callable[[int], None] | None = None  # the progress counter, once the total is known
        self._lock = threading.Lock()

    def _fetch(self, obj: ChunkObject) -> tuple[bytes, Any]:
        """Chunk object ``obj`` from the source, checked against its digest (errors name the
        leaves it holds)."""
        try:
            return fetch_chunk(self.src, obj.ref)
        except DamagedError as exc:
            raise _refused(exc, obj.owner(), obj.columns.name, self.src.url) from None

    def _chunk(self, obj: ChunkObject, w: _writing.Writing) -> None:
        c = obj.ref
        data = None
        if obj.packed:  # a pack: each leaf's reference into it is checked, as a load checks it
            data, raw = self._fetch(obj)
            for (_, offset, size), rows in bad_members(raw, obj).items():
                problem = ChunkDamagedError(member_mismatch(c.digest, offset, size))
                address = obj.addresses(np.array(rows[:1]))[0]
                raise _refused(problem, address, obj.columns.name, self.src.url)

        def fetched() -> bytes:  # a pack's bytes are read above already
            return self._fetch(obj)[0] if data is None else data

        written = w.put_object(c.digest, c.raw_size, fetched)  # bytes transferred; 0, -1 (trusted): present
        with self._lock:
            if c.digest not in self.counted:  # each chunk object once, however many checkpoints share it
                self.counted.add(c.digest)
                if written > 0:
                    self.copied += 1
                    self.copied_bytes += written
                else:
                    self.present += 1
                    self.trusted_hits += written < 0
        w.keep_fresh()

    def chunks(self, objects: list[ChunkObject], w: _writing.Writing) -> None:
        scan(objects, functools.partial(self._chunk, w=w), self.threads, "copy", self.advance)


def _names(src: Storage, name: str | None, all_checkpoints: bool) -> list[str]:
    if all_checkpoints:
        if name is not None:
            raise InvalidInputError("copy every checkpoint (all_checkpoints=True) or one named one, not both")
        refs = [_committed.read_commit_record(src, n) for n in _committed.checkpoint_names(src)]
        if not refs:
            raise _committed.not_found(src, None)
        return [r.name for r in sorted(refs, key=_paths.commit_order)]
    return [check_name(name) if name is not None else _committed.newest_record(src).name]


def copy(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    name: str | None = None,
    all_checkpoints: bool = False,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
    dst_storage_options: dict[str, Any] | None = None,
    threads: int | None = None,
    progress: Progress | None = None,
    trust_previous: bool = True,
) -> CopyReport:
    """Copy checkpoints into another store, transferring only the chunks the destination lacks.

    The copy keeps its creation time and metadata. A checkpoint already at the destination with
    the same contents is left as it is. The chunks of the destination's newest checkpoint are
    taken as present there without a request for each.

    Args:
        src: The checkpoint: ``URL`` (its newest) or ``URL#NAME``.
        dst: The destination store, or ``URL#NEWNAME`` to rename the copy.
        name: The copy's name (default: the source's).
        all_checkpoints: Copy every checkpoint of the source store, oldest first.
        overwrite: Replace a checkpoint of that name with other contents at the destination.
        storage_options: Options for the source's filesystem and, unless
            ``dst_storage_options`` are given, the destination's.
        dst_storage_options: Options for the destination's filesystem.
        threads: Transfer threads.
        progress: Called as ``progress(done, total)`` with raw bytes as chunks are done.
        trust_previous: False checks every chunk at the destination.

    Returns:
        CopyReport: A :class:`treestore.types.CopyReport`.

    Raises:
        CheckpointNotFoundError: No such source checkpoint.
        CheckpointExistsError: A checkpoint of that name with other contents is at the
            destination and ``overwrite`` is False.
        InvalidInputError: A destination name given twice, or with ``all_checkpoints``.

    Examples:
        >>> import numpy as np, treestore
        >>> _ = treestore.save("memory://doc/cp-a", {"w": np.arange(4.0)}, "step-1")
        >>> r = treestore.copy("memory://doc/cp-a#step-1", "memory://doc/cp-b")
        >>> r.copied, r.chunks_copied
        (('step-1',), 1)
        >>> treestore.copy("memory://doc/cp-a", "memory://doc/cp-b#again").chunks_present
        1
    """
    src_url, src_name = parse_spec(src)
    dst_url, dst_name = parse_spec(dst)
    if name is not None and dst_name is not None and name != dst_name:
        raise InvalidInputError(f"destination name given twice: {dst_name!r} in dst and {name!r} in name=")
    dst_name = dst_name or name
    if all_checkpoints and dst_name is not None:
        raise InvalidInputError("a destination name cannot apply to every checkpoint of a store")
    s = open_storage(src_url, storage_options)
    d = open_storage(dst_url, storage_options if dst_storage_options is None else dst_storage_options)
    names = _names(s, src_name, all_checkpoints)
    copier = _Copier(s, d, threads or default_threads(), progress)
    plans = []
    for n in names:
        record = _committed.read_commit_record(s, n)
        data = _committed.read_manifest_bytes(s, record)
        with _memory.memory_named(f"reading the manifest of checkpoint {n!r}", n):
            found = _committed.read_frame(s, record, data)
            columns = assemble(s, found) if isinstance(found, Frame) else found
            objects = _distinct(chunk_objects(columns))
        parts = found.parts if isinstance(found, Frame) else ()  # copied with it, unless renamed
        new = check_name(dst_name or n)
        if new != n:
            columns, data = _writing.renamed(columns, new)  # the source's version; parts merged into it
            parts = ()
        if _writing.unchanged(d, new, digest(data), overwrite):
            continue
        copier.total += sum(obj.ref.raw_size for obj in objects)
        plans.append((record, parts, columns, data, objects))
    copied: list[str] = []
    if plans:
        # the chunks of the destination's newest checkpoint trusted, then those of each one committed
        copier.advance = counter(progress, copier.total)
        with _writing.writing(d, None, overwrite=overwrite, previous=bool(trust_previous)) as w:
            for record, parts, columns, data, objects in plans:
                with _memory.memory_named(f"copying checkpoint {record.name!r}", record.name):
                    copier.chunks(objects, w)
                _copy_parts(s, w, record.name, parts)
                w.commit_manifest(columns, data, record.version, [obj.ref.digest for obj in objects])
                copied.append(columns.name)
    unchanged = tuple(dst_name or n for n in names if (dst_name or n) not in copied)
    return CopyReport(
        s.url,
        d.url,
        tuple(copied),
        unchanged,
        copier.copied,
        copier.copied_bytes,
        copier.present,
        copier.trusted_hits,
    )


def _distinct(objects: list[ChunkObject]) -> list[ChunkObject]:
    """One of each chunk object (a pack may hold exactly the bytes of a chunk, or of another
    pack): packs first, so that its members are checked whichever names it."""
    seen: dict[tuple[bytes, int], ChunkObject] = {}
    extra = []
    for obj in sorted(objects, key=lambda o: not o.packed):
        if obj.key not in seen:
            seen[obj.key] = obj
        elif obj.packed:
            extra.append(obj)  # a second pack of the same bytes: its members are its own
    return list(seen.values()) + extra


def _refused(exc: DamagedError, address: str, checkpoint: str, url: str) -> DamagedError:
    return type(exc)(
        f"{address}: {exc} in checkpoint {checkpoint!r} of {url}; nothing was committed at the destination",
        checkpoint=checkpoint,
        address=address,
    )


def _copy_parts(src: Storage, w: _writing.Writing, name: str, parts: tuple[ListedPart, ...]) -> None:
    """Copy the parts of checkpoint ``name``'s manifest (SPEC.md, section 8), each checked."""
    for found, size, *_ in parts:
        data = part_bytes(src, found, size)
        if isinstance(data, str):  # changed since the manifest was read and checked
            raise ManifestDamagedError(f"manifest of checkpoint {name!r}: {data}", checkpoint=name)
        w.put_part(found, data)
