"""Saving: tree -> leaves -> chunks (hashed, deduplicated, compressed, written) -> manifest -> commit.

:func:`prepare` does everything that must happen before the caller may touch its tree again (it
validates every leaf and key and copies device arrays to host); :func:`write` does the rest and can
run in the background. Commit order: chunks, then the manifest, then the commit record."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from treestore._engine import distributed as _distributed
from treestore._engine import locks as _locks
from treestore._engine.commit import commit
from treestore._engine.threads import default_threads
from treestore._format import layout as _layout
from treestore._format.codecs import PROBE_BYTES, Codec, encode, plane_width, sound
from treestore._format.columns import encode_any
from treestore._format.commit_record import CommitRecord
from treestore._format.encoding import digest
from treestore._format.limits import MAX_MANIFEST_BYTES
from treestore._format.manifest import (
    ChunkRef,
    LeafEntry,
    Manifest,
    Piece,
    check_metadata,
    check_name,
)
from treestore._storage.base import Storage
from treestore._tree.leaves import ArrayLeaf, Leaf, ValueLeaf, prepare_leaf
from treestore._tree.structure import flatten
from treestore.errors import CheckpointExistsError, InvalidInputError, UnsupportedLeafError

MiB = 2**20


@dataclass(frozen=True)
class SaveOptions:
    """Tuning for saves; the defaults suit model weights on local disks and object stores."""

    codec: Codec = field(default_factory=Codec)
    chunk_size: int = 4 * MiB  # big leaves are cut into chunks of about this many raw bytes
    small_leaf: int = 64 * 1024  # leaves under this many bytes are packed together
    pack_size: int = 1 * MiB  # raw bytes per pack of small leaves
    threads: int = field(default_factory=default_threads)

    def __post_init__(self) -> None:
        if not 4096 <= self.chunk_size <= 256 * MiB:
            raise InvalidInputError(f"chunk_size must be between 4 KiB and 256 MiB, got {self.chunk_size}")
        if not 0 <= self.small_leaf <= self.chunk_size:
            raise InvalidInputError("small_leaf must be between 0 and chunk_size")
        if not self.small_leaf <= self.pack_size <= 256 * MiB:
            raise InvalidInputError("pack_size must be between small_leaf and 256 MiB")
        if not 1 <= self.threads <= 256:
            raise InvalidInputError(f"threads must be between 1 and 256, got {self.threads}")


@dataclass(frozen=True)
class Prepared:
    """A tree ready to write: its node record and its (address, leaf) pairs, on host."""

    tree: dict[str, Any]
    leaves: tuple[tuple[str, Leaf], ...]


@dataclass(frozen=True)
class SaveResult:
    """What a save did: how much it stored and how much it found already in the store."""

    name: str
    leaves: int
    nbytes: int  # raw bytes of all array leaves
    chunks_written: int
    bytes_written: int  # stored bytes of the chunks this save wrote
    chunks_reused: int  # chunks that were already in the store (deduplicated)


def prepare(
    tree: Any,
    *,
    copy: bool = False,
    leaf: Callable[[str, Any], Leaf] | None = None,
    before: Callable[[list[Any]], None] | None = None,
) -> Prepared:
    """Validate every key and leaf and copy device arrays to host; raises before any write.

    With ``copy=True`` numpy leaves are copied too, so the caller may change them at once.
    ``leaf(address, value)`` replaces the default conversion of each leaf; ``before(values)``
    sees every leaf value once the structure is validated, before any is converted.
    """
    make = leaf or (lambda address, value: prepare_leaf(value, address, copy=copy))
    found: list[tuple[str, Any]] = []

    def visit(address: str, value: Any) -> int:
        found.append((address, value))
        return len(found) - 1

    node = flatten(tree, visit)  # distinct keys in each node: distinct addresses
    if before is not None:
        before([value for _, value in found])
    leaves = _converted(tree, found, make)
    # Python scalars live in the manifest: refuse here, before any chunk is written, a tree whose
    # addresses and values alone exceed what readers accept (encode_manifest checks the rest).
    floor = sum(len(a) + (x.size_floor if type(x) is ValueLeaf else 0) for a, x in leaves)
    if floor > MAX_MANIFEST_BYTES:
        values = [(a, x) for a, x in leaves if isinstance(x, ValueLeaf)]
        address, biggest = max(values, key=lambda p: p[1].size_floor, default=("", None))
        largest = f"; the largest, {address or '(root)'}, holds {biggest.size_floor}" if biggest else ""
        raise InvalidInputError(
            f"the tree's addresses and Python scalar leaves take at least {floor} bytes in the "
            f"manifest, over the {MAX_MANIFEST_BYTES // 2**20} MiB readers accept{largest}: store "
            "large bytes and str values as numpy arrays (np.frombuffer(b, np.uint8))",
            address=address if biggest else None,
        )
    return Prepared(node, tuple(leaves))


def _converted(
    tree: Any, found: list[tuple[str, Any]], make: Callable[[str, Any], Leaf]
) -> list[tuple[str, Leaf]]:
    """Every leaf converted by ``make``; one UnsupportedLeafError names every leaf that cannot be
    stored (for an equinox module, with the filter that keeps its arrays)."""
    leaves: list[tuple[str, Leaf]] = []
    refused: list[UnsupportedLeafError] = []
    for address, value in found:
        try:
            leaves.append((address, make(address, value)))
        except UnsupportedLeafError as exc:
            refused.append(exc)
    if not refused:
        return leaves
    lines = [exc.message for exc in refused]
    text = (
        lines[0]
        if len(lines) == 1
        else f"{len(lines)} leaves cannot be stored:\n  "
        + "\n  ".join(lines[:20] + ([f"(and {len(lines) - 20} more)"] if len(lines) > 20 else []))
    )
    if any(_is_equinox(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=_is_equinox)):
        text += (
            "\nthe tree holds equinox modules: save eqx.filter(model, eqx.is_array) (its arrays), "
            "and load with like=model (its functions are kept from like)"
        )
    raise UnsupportedLeafError(text, address=refused[0].address)


def _is_equinox(x: Any) -> bool:
    """Whether ``x`` is an equinox module (by its classes' modules: equinox is never imported)."""
    return any(c.__module__.partition(".")[0] == "equinox" for c in type(x).__mro__)


def reusable_size(storage: Storage, chunk_digest: bytes, raw_size: int) -> int | None:
    """The stored size of the object under the name of chunk ``chunk_digest`` (``raw_size`` raw
    bytes) if a save or copy may reference it without writing it again; None when there is no
    object or it fails the codec's reuse check (:func:`treestore._format.codecs.sound`, reading
    the object's size and at most its first 80 bytes), and the caller must (re)write it.
    """
    path = _layout.chunk_path(chunk_digest)
    stored = storage.object_size(path)
    if stored is None:
        return None
    head = storage.read_range(path, 0, PROBE_BYTES)
    return stored if head is not None and sound(head, stored, raw_size) else None


_tls = threading.local()


def _snapshot(raw: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A copy of ``raw`` in this thread's reusable buffer (valid until this thread's next call).

    A save hashes and encodes the one copy: an array the caller changes during the save can then
    make it store any state the array went through, but never an object whose bytes differ from
    its name.
    """
    buf = getattr(_tls, "snapshot", None)
    if buf is None or buf.nbytes < raw.nbytes:
        buf = _tls.snapshot = np.empty(raw.nbytes, np.uint8)
    out = buf[: raw.nbytes]
    np.copyto(out, raw)
    return out


class _ChunkWriter:
    """Hashes, deduplicates, encodes and writes chunks; safe to call from many threads.

    A chunk is hashed and encoded from one copy of its bytes, and an object already under its
    name is referenced only if it passes :func:`reusable_size`; otherwise it is written (over
    a bad object, replacing it).
    """

    def __init__(self, storage: Storage, codec: Codec, on_chunk: Callable[[int], None] | None) -> None:
        self.storage = storage
        self.codec = codec
        self.on_chunk = on_chunk
        self._lock = threading.Lock()
        self._claimed: dict[bytes, cf.Future[int]] = {}
        self.written = self.written_bytes = self.reused = 0

    def put(self, raw: np.ndarray[Any, Any], width: int, *, private: bool = False) -> ChunkRef:
        """Store the chunk ``raw`` (1-D uint8); ``private`` says nothing else can change it
        meanwhile (a pack this save assembled), so it needs no copy."""
        if not private:
            raw = _snapshot(raw)
        d = digest(raw)
        with self._lock:
            fut = self._claimed.get(d)
            owner = fut is None
            if fut is None:
                fut = self._claimed[d] = cf.Future()
        if not owner:
            return ChunkRef(d, raw.nbytes, fut.result())
        try:
            stored = reusable_size(self.storage, d, raw.nbytes)
            if stored is None:
                buffers = encode(raw, width, self.codec, reuse=True)  # written before the next
                self.storage.write(_layout.chunk_path(d), buffers)
                stored = sum(len(b) for b in buffers)
                with self._lock:
                    self.written += 1
                    self.written_bytes += stored
            else:
                with self._lock:
                    self.reused += 1
            fut.set_result(stored)
        except BaseException as exc:
            fut.set_exception(exc)
            raise
        if self.on_chunk is not None:
            self.on_chunk(raw.nbytes)
        return ChunkRef(d, raw.nbytes, stored)


def _resolved(chunk: ChunkRef | cf.Future[ChunkRef]) -> ChunkRef:
    return chunk if isinstance(chunk, ChunkRef) else chunk.result()


def _plan_chunks(
    data: np.ndarray[Any, Any], options: SaveOptions, submit: Callable[..., cf.Future[ChunkRef]]
) -> list[cf.Future[ChunkRef]]:
    raw = data.reshape(-1).view(np.uint8)
    itemsize = data.dtype.itemsize
    step = max(itemsize, options.chunk_size // itemsize * itemsize)
    return [submit(raw[i : i + step], plane_width(data.dtype)) for i in range(0, raw.nbytes, step)]


def write(
    storage: Storage,
    prepared: Prepared,
    name: str,
    *,
    metadata: Any = None,
    options: SaveOptions = SaveOptions(),
    overwrite: bool = False,
    on_chunk: Callable[[int], None] | None = None,
) -> SaveResult:
    """Write ``prepared`` as checkpoint ``name`` and commit it; on any failure nothing is visible."""
    check_name(name)
    check_metadata(metadata)
    record_path = _layout.record_path(name)
    if not overwrite and storage.exists(record_path):
        raise CheckpointExistsError(
            f"checkpoint {name!r} already exists in {storage.url}; pass overwrite=True to replace it",
            checkpoint=name,
        )
    writer = _ChunkWriter(storage, options.codec, on_chunk)
    group = _distributed.group()
    if group is None:
        with _locks.save_lock(storage) as lock, cf.ThreadPoolExecutor(options.threads) as pool:
            try:
                entries, packs = _write_leaves(prepared, options, pool, writer, lock)
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
            nbytes = _commit(storage, prepared, name, entries, packs, metadata, options, overwrite)
        return SaveResult(name, len(entries), nbytes, writer.written, writer.written_bytes, writer.reused)
    return _write_in_group(group, storage, prepared, name, writer, metadata, options, overwrite)


def _write_in_group(
    group: _distributed.Group,
    storage: Storage,
    prepared: Prepared,
    name: str,
    writer: _ChunkWriter,
    metadata: Any,
    options: SaveOptions,
    overwrite: bool,
) -> SaveResult:
    """A save by every process of a jax.distributed job; see :mod:`treestore._engine.distributed`.

    Every process reaches all three barriers whatever fails, so none waits forever for another,
    and the staging records are removed only after every process has read the outcome.
    """
    failure: BaseException | None = None
    entries: list[LeafEntry] = []
    packs: list[ChunkRef] = []
    lock: _locks.Lock | None = None
    try:
        lock = _locks.save_lock(storage)
        with cf.ThreadPoolExecutor(options.threads) as pool:
            entries, packs = _write_leaves(prepared, options, pool, writer, lock, primary=group.primary)
        storage.sync()
    except BaseException as exc:
        failure = exc
    try:
        try:
            group.share_pieces(storage, entries, packs, failure)
        except BaseException as exc:
            failure = failure or exc
        group.barrier("written")
        if not group.primary:
            group.barrier("committed")
            if failure is None:
                try:
                    group.outcome(storage)
                except BaseException as exc:
                    failure = exc
            group.barrier("acknowledged")  # the primary removes the outcome only after this
            if failure is not None:
                raise failure
            return SaveResult(name, 0, 0, writer.written, writer.written_bytes, writer.reused)
        try:
            if failure is not None:
                raise failure
            entries, packs = group.merge(storage, entries)
            nbytes = _commit(storage, prepared, name, entries, packs, metadata, options, overwrite)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                group.announce(storage, exc)
            group.barrier("committed")
            group.barrier("acknowledged")
            raise
        group.announce(storage, None)
        group.barrier("committed")
        group.barrier("acknowledged")
        group.clean(storage)
        return SaveResult(name, len(entries), nbytes, writer.written, writer.written_bytes, writer.reused)
    finally:
        if lock is not None:
            lock.release_quietly()  # after a commit the save has succeeded: a failure is logged


def _write_leaves(
    prepared: Prepared,
    options: SaveOptions,
    pool: cf.ThreadPoolExecutor,
    writer: _ChunkWriter,
    lock: _locks.Lock,
    *,
    primary: bool = True,
) -> tuple[list[LeafEntry], list[ChunkRef]]:
    """Write the chunks of every leaf; returns the leaf entries and pack chunks.

    Only the primary process of a multi-process save writes leaves that are not sharded;
    every process writes the pieces it owns.
    """
    # Small leaves are hashed here, before any worker runs: thousands of tiny hashes interleaved
    # with workers would spend their time handing the GIL back and forth.
    plans: list[Any] = []
    packs: list[list[np.ndarray[Any, Any]]] = [[]]
    pack_fill = 0

    def pack(raw: np.ndarray[Any, Any]) -> ChunkRef:
        nonlocal pack_fill
        if pack_fill + raw.nbytes > options.pack_size:
            packs.append([])
            pack_fill = 0
        raw = raw.copy()  # hashed and packed from one copy, as chunks are (see _snapshot)
        ref = ChunkRef(digest(raw), raw.nbytes, 0, len(packs) - 1, pack_fill)
        packs[-1].append(raw)
        pack_fill += raw.nbytes
        return ref

    def small(raw: np.ndarray[Any, Any]) -> bool:
        return 0 < raw.nbytes < options.small_leaf

    for _, leaf in prepared.leaves:
        if isinstance(leaf, ValueLeaf) or not (primary or leaf.sharded):
            plans.append(None)
        elif leaf.data is None:  # sharded: small pieces packed now, big ones chunked below
            owned = [(start, piece, piece.reshape(-1).view(np.uint8)) for start, piece in leaf.pieces]
            plans.append([(start, piece, pack(raw) if small(raw) else raw) for start, piece, raw in owned])
        else:
            raw = leaf.data.reshape(-1).view(np.uint8)
            plans.append(pack(raw) if small(raw) else raw)
    pack_jobs = [pool.submit(writer.put, np.concatenate(m), 0, private=True) for m in packs if m]

    def submit(raw: np.ndarray[Any, Any], width: int) -> cf.Future[ChunkRef]:
        return pool.submit(writer.put, raw, width)

    for i, (_, leaf) in enumerate(prepared.leaves):
        plan = plans[i]
        if isinstance(plan, np.ndarray) and plan.nbytes:
            assert isinstance(leaf, ArrayLeaf) and leaf.data is not None
            plans[i] = _plan_chunks(leaf.data, options, submit)
        elif isinstance(plan, list):
            plans[i] = [
                (
                    start,
                    part.shape,
                    [ref] if isinstance(ref, ChunkRef) else _plan_chunks(part, options, submit),
                )
                for start, part, ref in plan
            ]

    entries = []
    for (address, leaf), plan in zip(prepared.leaves, plans, strict=True):
        if isinstance(leaf, ValueLeaf):
            entries.append(LeafEntry(address, leaf.kind, value=leaf.value))
            continue
        if plan is None:  # another process writes it
            continue
        pieces: tuple[Piece, ...] = ()
        if isinstance(plan, ChunkRef):
            chunks: tuple[ChunkRef, ...] = (plan,)
        elif isinstance(plan, np.ndarray):  # empty
            chunks = ()
        elif leaf.sharded:
            pieces = tuple(Piece(start, shape, tuple(_resolved(f) for f in fs)) for start, shape, fs in plan)
            chunks = tuple(c for p in pieces for c in p.chunks)
        else:
            chunks = tuple(f.result() for f in plan)
        lock.refresh(_locks.STALE_AFTER)
        entries.append(
            LeafEntry(
                address,
                leaf.kind,
                leaf.dtype,
                leaf.shape,
                chunks,
                leaf.prng_impl,
                pieces=pieces,
                weak_type=leaf.weak_type,
            )
        )
    return entries, [job.result() for job in pack_jobs]


def _commit(
    storage: Storage,
    prepared: Prepared,
    name: str,
    entries: list[LeafEntry],
    packs: list[ChunkRef],
    metadata: Any,
    options: SaveOptions,
    overwrite: bool,
) -> int:
    """Build the manifest and commit it; returns the checkpoint's raw array bytes."""
    now = time.time()
    manifest = Manifest(
        name=name,
        created=now,
        tree=prepared.tree,
        leaves=tuple(_distributed.canonical(e) for e in entries),
        packs=tuple(packs),
        metadata=metadata,
        codec=options.codec.to_record(),
        chunk_size=options.chunk_size,
    )
    data = encode_any(manifest)  # checked as readers check it: pieces from several shards too
    record = CommitRecord(name, b"", 0, now, metadata, len(entries), manifest.nbytes)
    commit(storage, data, record, overwrite=overwrite)
    return manifest.nbytes
