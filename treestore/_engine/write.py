"""Saving: tree -> leaves -> chunks (hashed, deduplicated, compressed, written) -> manifest -> commit.

:func:`prepare` does everything that must happen before the caller may touch its tree again (it
validates every leaf and key and copies device arrays to host); :func:`write` does the rest and can
run in the background. Commit order: chunks, then the manifest, then the commit record."""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from treestore._engine import device_stats as _device_stats
from treestore._engine import distributed as _distributed
from treestore._engine import locks as _locks
from treestore._engine import trusted as _trusted
from treestore._engine.chunk_writer import ChunkWriter, Measured
from treestore._engine.chunk_writer import SaveResult as SaveResult  # the result of write()
from treestore._engine.commit import commit
from treestore._engine.device_fetch import Fetcher, Window
from treestore._engine.packs import Packer
from treestore._engine.threads import Batch, compute_threads, default_threads, shared_pool
from treestore._format import paths as _paths
from treestore._format import stats as _stats
from treestore._format.codecs import Codec, plane_width
from treestore._format.columns_codec import columns_from_fields, encode_columns
from treestore._format.dtypes import PRNG_KEY
from treestore._format.leaf_table import LeafTable, PieceRow, ref_of
from treestore._format.manifest import check_metadata, check_name
from treestore._format.records import ChunkRef
from treestore._storage.base import Storage
from treestore._tree.collector_pause import paused_collector
from treestore._tree.leaves import ArrayLeaf, Keep, ValueLeaf
from treestore._tree.prepare import Prepared
from treestore.errors import CheckpointExistsError, InvalidInputError

MiB = 2**20


@dataclass(frozen=True)
class SaveOptions:
    """Tuning for saves; the defaults suit model weights on local disks and object stores.

    Attributes:
        codec: How chunks are compressed (see :class:`Codec`).
        chunk_size: Big leaves are cut into chunks of about this many raw bytes (4 KiB to
            256 MiB; default 4 MiB).
        small_leaf: Leaves under this many bytes are packed together (0 to ``chunk_size``;
            default 64 KiB).
        pack_size: Raw bytes per pack of small leaves (``small_leaf`` to 256 MiB; default
            1 MiB).
        threads: Threads that write chunks (1 to 256; default: chosen from the cores).
        stats: Record each array leaf's statistics in the manifest — NaN, +inf and -inf counts,
            min and max of the finite elements, L2 norm (float64) — measured while its chunks are
            hashed, so that health checks, ``treestore show --stats`` and retention read
            manifests only (True or False; default True; see :meth:`Checkpoint.stats`). They
            cost about as much CPU as the hashing (the benchmarks page has the figures). Leaves
            that live on an accelerator are measured there (float dtypes of up to 32 bits).
        host_window: Bytes of host memory a save of arrays on an accelerator holds at most for
            their transfers and chunks in flight: big leaves are fetched in slices, each
            transfer started as soon as the window has room, and hashed, compressed and
            written as it arrives (at least ``4 * chunk_size``; default 256 MiB).
        device_path: Which jax arrays a save fetches while it writes, in ``host_window``, and
            measures on their device: ``"auto"`` those off the CPU (default), ``"always"``
            every jax array (CPU ones too), ``"never"`` none (every leaf is copied to the host
            first and measured there).
        device_snapshot: Bytes of device memory an async save of :class:`CheckpointManager` may
            take to copy the tree on its devices, so that the training step is blocked only while
            the copies are started (None, the default: up to half of what each device has free;
            0: never, the tree is copied to host memory before ``save`` returns). A tree that
            does not fit is copied to host memory.

    Raises:
        InvalidInputError: A value is out of its range (or ``stats`` is not a bool).

    Examples:
        >>> import numpy as np, treestore
        >>> options = treestore.SaveOptions(chunk_size=1 << 20, codec=treestore.Codec(level=3))
        >>> r = treestore.save("memory://doc/options", {"w": np.arange(2.0**19)}, "a", options=options)
        >>> r.chunks_written  # 4 MiB of float64 in chunks of 1 MiB
        4
    """

    codec: Codec = field(default_factory=Codec)
    chunk_size: int = 4 * MiB  # big leaves are cut into chunks of about this many raw bytes
    small_leaf: int = 64 * 1024  # leaves under this many bytes are packed together
    pack_size: int = 1 * MiB  # raw bytes per pack of small leaves
    # Threads that write (and on a local disk, publish) chunks; those that hash and compress
    # are at most one per core where the disk is waited for by the others (compute_threads).
    threads: int = field(default_factory=default_threads)
    stats: bool = True  # per-leaf statistics in the manifest (CPU near the hashing's own)
    host_window: int = 256 * MiB  # host bytes of device transfers and chunks in flight
    device_path: str = "auto"  # which jax arrays are fetched while writing: auto, always, never
    device_snapshot: int | None = None  # device bytes an async save's snapshot may take

    def __post_init__(self) -> None:
        if not 4096 <= self.chunk_size <= 256 * MiB:
            raise InvalidInputError(f"chunk_size must be between 4 KiB and 256 MiB, got {self.chunk_size}")
        if not 0 <= self.small_leaf <= self.chunk_size:
            raise InvalidInputError("small_leaf must be between 0 and chunk_size")
        if not self.small_leaf <= self.pack_size <= 256 * MiB:
            raise InvalidInputError("pack_size must be between small_leaf and 256 MiB")
        if not 1 <= self.threads <= 256:
            raise InvalidInputError(f"threads must be between 1 and 256, got {self.threads}")
        if type(self.stats) is not bool:
            raise InvalidInputError(f"stats must be True or False, got {self.stats!r}")
        if type(self.host_window) is not int or self.host_window < 4 * self.chunk_size:
            raise InvalidInputError(
                f"host_window must be an int of at least 4 * chunk_size ({4 * self.chunk_size}), "
                f"got {self.host_window!r}"
            )
        if self.device_path not in ("auto", "always", "never"):
            raise InvalidInputError(
                f"device_path must be 'auto', 'always' or 'never', got {self.device_path!r}"
            )

        if self.device_snapshot is not None and (
            type(self.device_snapshot) is not int or self.device_snapshot < 0
        ):
            raise InvalidInputError(
                f"device_snapshot must be None or an int >= 0, got {self.device_snapshot!r}"
            )

    @property
    def keep(self) -> Keep | None:
        """Which jax arrays :func:`prepare` leaves on their devices for these options."""
        if self.device_path == "never":
            return None
        return Keep(max(self.small_leaf, 1), cpu=self.device_path == "always")


def _plan_chunks(
    data: Any,
    options: SaveOptions,
    submit: Callable[..., cf.Future[Measured]],
    private: bool,
    measure: bool,
    fetcher: Fetcher,
) -> list[cf.Future[Measured]]:
    """The futures of the chunks of ``data``: host data's submitted now, a device array's (a leaf
    or piece kept on its device) appended as :meth:`Fetcher.run` fetches them."""
    itemsize = data.dtype.itemsize
    step = max(itemsize, options.chunk_size // itemsize * itemsize)
    width = plane_width(np.dtype(data.dtype))
    dtype = np.dtype(data.dtype) if measure else None
    if not isinstance(data, np.ndarray):
        return fetcher.add(data, step, lambda raw: submit(raw, width, True, dtype))
    raw = data.reshape(-1).view(np.uint8)
    return [submit(raw[i : i + step], width, private, dtype) for i in range(0, raw.nbytes, step)]


def write(
    storage: Storage,
    prepared: Prepared,
    name: str,
    *,
    metadata: Any = None,
    options: SaveOptions = SaveOptions(),
    overwrite: bool = False,
    on_chunk: Callable[[int], None] | None = None,
    previous: _trusted.Previous = True,
) -> SaveResult:
    """Write ``prepared`` as checkpoint ``name`` and commit it; on any failure nothing is visible.

    ``previous`` names the committed checkpoint whose chunks the save takes as present without
    asking the store (True: the store's newest; False: none, check every chunk): it is read once
    the save's lock is held, which is what makes trusting it safe (:mod:`treestore._engine.trusted`);
    one that cannot be read is ignored.
    """
    check_name(name)
    check_metadata(metadata)
    record_path = _paths.record_path(name)
    if not overwrite and storage.exists(record_path):
        raise CheckpointExistsError(
            f"checkpoint {name!r} already exists in {storage.url}; pass overwrite=True to replace it",
            checkpoint=name,
        )
    writer = ChunkWriter(storage, options.codec, on_chunk)
    group = _distributed.group()
    if group is None:
        with paused_collector(len(prepared.leaves)):
            return _write_alone(storage, prepared, name, writer, metadata, options, overwrite, previous)
    return _write_in_group(group, storage, prepared, name, writer, metadata, options, overwrite, previous)


def _write_alone(
    storage: Storage,
    prepared: Prepared,
    name: str,
    writer: ChunkWriter,
    metadata: Any,
    options: SaveOptions,
    overwrite: bool,
    previous: _trusted.Previous,
) -> SaveResult:
    """:func:`write` by this process alone."""
    with _locks.save_lock(storage) as lock:
        writer.trusted = _trusted.learn(storage, previous)  # under the lock, after any gc: safe
        table = LeafTable()
        packs = _write_leaves(prepared, options, writer, lock, table)
        nbytes = _commit(storage, prepared, name, table, packs, metadata, options, overwrite)
    return writer.result(name, len(table), nbytes)


def _write_in_group(
    group: _distributed.Group,
    storage: Storage,
    prepared: Prepared,
    name: str,
    writer: ChunkWriter,
    metadata: Any,
    options: SaveOptions,
    overwrite: bool,
    previous: _trusted.Previous,
) -> SaveResult:
    """A save by every process of a jax.distributed job; see :mod:`treestore._engine.distributed`.
    Each process learns the chunks it may trust under its own lock (which it holds until the
    primary has committed), as a one-process save does.

    Every process shares what it wrote (or the error that stopped it) whatever fails, and every
    wait has a timeout, so none waits forever for another; only the primary commits.
    """
    group = group.begin(name)
    failure: BaseException | None = None
    written: _distributed.Written | None = None
    lock: _locks.Lock | None = None
    try:
        lock = _locks.save_lock(storage)
        writer.trusted = _trusted.learn(storage, previous)  # under this process's lock: safe
        table = LeafTable(pieces_kept=True)
        packs = _write_leaves(prepared, options, writer, lock, table, primary=group.primary)
        written = _distributed.Written(table, packs, options.stats)
        storage.sync()
    except BaseException as exc:
        failure = exc
    header = {
        "name": name,
        "metadata": metadata,
        "codec": options.codec.to_record(),
        "chunk_size": options.chunk_size,
    }
    try:
        committed = group.finish(
            storage, lock, prepared.tree, prepared.leaves, written, failure, header, overwrite=overwrite
        )
    finally:
        if lock is not None:
            lock.release_quietly()  # after a commit the save has succeeded: a failure is logged
    if committed is None:  # another process committed
        return writer.result(name, 0, 0)
    return writer.result(name, *committed)


def _write_leaves(
    prepared: Prepared,
    options: SaveOptions,
    writer: ChunkWriter,
    lock: _locks.Lock,
    sink: LeafTable,
    *,
    primary: bool = True,
) -> list[ChunkRef]:
    """Write the chunks of every leaf, appending each leaf written to ``sink`` (the manifest's
    columns, or leaf entries); returns the pack chunks.

    Chunks are hashed and compressed on the process's saving threads and take their names on
    its publishing threads (:meth:`ChunkWriter.publishing`): when this returns every chunk has
    its name, and when it raises none of its jobs still runs. Only the primary process of a
    multi-process save writes leaves that are not sharded; every process writes the pieces it
    owns.
    """
    with writer.publishing(options.threads):
        jobs = Batch(shared_pool(compute_threads(options.threads, writer.storage.stages), "save"))
        try:
            return _submit_leaves(prepared, options, jobs, writer, lock, sink, primary)
        except BaseException:
            jobs.cancel()
            raise


def _submit_leaves(
    prepared: Prepared,
    options: SaveOptions,
    pool: Batch,
    writer: ChunkWriter,
    lock: _locks.Lock,
    sink: LeafTable,
    primary: bool,
) -> list[ChunkRef]:
    """:func:`_write_leaves`, its jobs submitted to ``pool``."""
    plans: list[Any] = []
    packer = Packer(options.pack_size, pool.submit, writer.put)
    small = options.small_leaf
    pack = packer.add
    chunked: list[tuple[int, bool]] = []  # the leaves with chunks of their own, or pieces; private
    kinds: list[int] = []  # each leaf's statistics kind; UNKNOWN where none is recorded
    on_device: dict[int, list[Any]] = {}  # the leaves measured on their devices: kernel results
    # Statistics of real numbers, not of PRNG key data (looked up inline: at 100k leaves a
    # function call per leaf shows).
    kind_of = _stats.KIND_OF.get
    unknown = _stats.UNKNOWN
    for i, (_, leaf) in enumerate(prepared.leaves):
        kind = (
            kind_of(leaf.dtype, unknown)
            if options.stats and isinstance(leaf, ArrayLeaf) and leaf.kind != PRNG_KEY
            else unknown
        )
        kinds.append(kind)
        measure = kind != unknown
        if isinstance(leaf, ValueLeaf) or not (primary or leaf.sharded):
            plans.append(None)
            continue
        if measure and (leaf.source is not None or leaf.data is None):
            kept = _on_device(leaf)
            if kept and _device_stats.measurable(np.dtype(kept[0].dtype)):
                on_device[i] = _device_stats.dispatch(kept)  # before the slices, on each device
        if leaf.source is not None:  # kept on its device: chunked as it is fetched
            plans.append(leaf.source)
            chunked.append((i, True))
        elif leaf.data is None:  # sharded: small pieces packed now, big ones chunked below
            plans.append(
                [
                    (
                        start,
                        piece,
                        pack(piece, i, measure)
                        if type(piece) is np.ndarray and 0 < piece.nbytes < small
                        else piece,
                    )
                    for start, piece in leaf.pieces
                ]
            )
            chunked.append((i, leaf.private))
        elif 0 < leaf.data.nbytes < small:
            plans.append(pack(leaf.data, i, measure))
        else:
            plans.append(leaf.data)
            chunked.append((i, leaf.private))
    pack_jobs = packer.finish()

    def submit(
        raw: np.ndarray[Any, Any], width: int, private: bool, dtype: np.dtype[Any] | None
    ) -> cf.Future[Measured]:
        return pool.submit(writer.put_measured, raw, width, dtype, private=private)

    fetcher = Fetcher(Window(options.host_window), options.chunk_size)
    for i, private in chunked:
        plan = plans[i]
        # chunks measured on the host unless the leaf is measured on its device (its host pieces
        # still are: they were never on a device of their own)
        measure = kinds[i] != unknown
        if type(plan) is not list:  # host data, or a device array
            measure_here = measure and i not in on_device
            plans[i] = (
                _plan_chunks(plan, options, submit, private, measure_here, fetcher) if plan.nbytes else plan
            )
        else:
            plans[i] = [
                (
                    start,
                    piece.shape,
                    [ref]
                    if type(ref) is tuple
                    else _plan_chunks(
                        piece,
                        options,
                        submit,
                        private,
                        measure and not (i in on_device and type(piece) is not np.ndarray),
                        fetcher,
                    ),
                )
                for start, piece, ref in plan
            ]
    fetcher.run()  # every device leaf's chunks submitted: its futures are in plans
    device_records = _device_records(prepared, on_device)

    packs: list[ChunkRef] = []
    small_records: dict[int, list[_stats.Record | None]] = {}
    for job in pack_jobs:
        ref, measured_members = job.result()
        packs.append(ref)
        for i, record in measured_members:
            small_records.setdefault(i, []).append(record)
    for i, ((address, leaf), plan) in enumerate(zip(prepared.leaves, plans, strict=True)):
        if isinstance(leaf, ValueLeaf):
            sink.value(leaf.kind, leaf.value, address, i)
            continue
        pieces: list[PieceRow] | None = None
        records = small_records.get(i, [])
        if type(plan) is tuple:  # packed: nothing to wait for
            refs = [plan]
        elif plan is None:  # another process writes it
            continue
        elif type(plan) is not list:  # empty
            refs = []
        else:
            if leaf.sharded:
                refs, pieces = [], []
                for start, shape, fs in plan:
                    got = []
                    for f in fs:
                        if type(f) is tuple:
                            got.append(f)
                        else:
                            ref, record = f.result()
                            got.append(ref_of(ref))
                            if record is not None:  # None: measured on its device
                                records.append(record)
                    refs += got
                    pieces.append((start, shape, len(got)))
            else:
                refs = []
                for f in plan:
                    ref, record = f.result()
                    refs.append(ref_of(ref))
                    if record is not None:  # None: measured on its device
                        records.append(record)
            lock.refresh(_locks.STALE_AFTER)  # after waiting for chunks: keep the save's lock fresh
        stats = None
        if options.stats:
            stats = _stats.combine(records + device_records.get(i, []), kinds[i])
        sink.array(
            leaf.kind, leaf.dtype, leaf.shape, leaf.prng_impl, leaf.weak_type, refs, pieces, address, i, stats
        )
    return packs


def _on_device(leaf: ArrayLeaf) -> list[Any]:
    """The jax arrays of a leaf that stay on their devices: the leaf itself, or the pieces of a
    sharded one that are kept there (measured on their devices, in this order)."""
    if leaf.source is not None:
        return [leaf.source]
    return [piece for _, piece in leaf.pieces if type(piece) is not np.ndarray]


def _device_records(prepared: Prepared, on_device: dict[int, list[Any]]) -> dict[int, list[_stats.Record]]:
    """The records of the leaves (and kept pieces) measured on their devices, fetched together."""
    order = sorted(on_device)
    results = [r for i in order for r in on_device[i]]
    blocks = iter(_device_stats.fetch(results))
    out: dict[int, list[_stats.Record]] = {}
    for i in order:
        leaf = prepared.leaves[i][1]
        assert isinstance(leaf, ArrayLeaf)
        kept = _on_device(leaf)
        out[i] = [_device_stats.record(next(blocks), int(x.size)) for x in kept]
    return out


def _commit(
    storage: Storage,
    prepared: Prepared,
    name: str,
    table: LeafTable,
    packs: list[ChunkRef],
    metadata: Any,
    options: SaveOptions,
    overwrite: bool,
) -> int:
    """Build the manifest from the columns of the leaves written and commit it; returns the
    checkpoint's raw array bytes."""
    now = time.time()
    fields = table.fields(packs)
    fields.update(
        name=name,
        created=now,
        metadata=metadata,
        codec=options.codec.to_record(),
        chunk_size=options.chunk_size,
    )
    columns = columns_from_fields(fields, prepared.nodes)  # checked as readers check it
    commit(storage, encode_columns(columns), columns, overwrite=overwrite)
    return columns.nbytes
