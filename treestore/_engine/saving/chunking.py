"""The leaves of a prepared tree cut into chunks, hashed, measured, compressed and written:
big leaves in chunks of their own, small ones in packs, device arrays fetched as they are written
(:mod:`treestore._engine.saving.device_fetch`). Every chunk is measured on the host as it is
hashed, wherever its leaf lived: one implementation of the statistics, so one tree gets one record.
Every writer calls it through :mod:`treestore._engine.saving.writing`, which holds the save's
lock it keeps fresh."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable
from typing import Any

import numpy as np

from treestore._engine import locks as _locks
from treestore._engine.saving.chunk_writer import ChunkWriter, Measured
from treestore._engine.saving.device_fetch import Fetcher, Window, chunk_step
from treestore._engine.saving.packs import Packed, Packer
from treestore._engine.saving.save_options import SaveOptions
from treestore._engine.saving.staging import HostChunks
from treestore._engine.threads import Batch, compute_threads, shared_pool
from treestore._format import stats as _stats
from treestore._format.codecs import plane_width
from treestore._format.dtypes import PRNG_KEY
from treestore._format.manifest.leaf_table import LeafTable, PieceRow, Ref, ref_of
from treestore._format.manifest.records import ChunkRef
from treestore._tree.leaves import ArrayLeaf, ValueLeaf
from treestore._tree.prepare import Prepared


def _plan_chunks(
    data: Any,
    options: SaveOptions,
    submit: Callable[..., cf.Future[Measured]],
    private: bool,
    measure: bool,
    fetcher: Fetcher,
    address: str,
) -> list[cf.Future[Measured]]:
    """The futures of the chunks of ``data``: host data's submitted now, a device array's (a leaf
    or piece kept on its device) appended as :meth:`Fetcher.run` fetches them."""
    step = chunk_step(data.dtype.itemsize, options.chunk_size)
    width = plane_width(np.dtype(data.dtype))
    dtype = np.dtype(data.dtype) if measure else None
    if isinstance(data, HostChunks):  # an async save's snapshot: fetched already, in chunks
        if data.step == step:
            return [submit(chunk, width, True, dtype) for chunk in data.chunks]
        data, private = data.host(), True  # cut for another chunk size: cut again
    if not isinstance(data, np.ndarray):
        return fetcher.add(data, step, lambda raw: submit(raw, width, True, dtype), address)
    raw = data.reshape(-1).view(np.uint8)
    return [submit(raw[i : i + step], width, private, dtype) for i in range(0, raw.nbytes, step)]


def write_leaves(
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
    """:func:`write_leaves`, its jobs submitted to ``pool``."""
    plans: list[Any] = []
    packer = Packer(options.pack_size, pool.submit, writer.put)
    small = options.small_leaf
    pack = packer.add
    chunked: list[tuple[int, bool]] = []  # the leaves with chunks of their own, or pieces; private
    in_pieces: list[int] = []  # the sharded leaves, whose small pieces may span several packs
    kinds: list[int] = []  # each leaf's statistics kind; UNKNOWN where none is recorded
    # Statistics of real numbers, not of PRNG key data (looked up inline: at 100k leaves a
    # function call per leaf shows).
    kind_of = _stats.KIND_OF.get
    unknown = _stats.UNKNOWN
    stats_on = options.stats
    for i, (_, leaf) in enumerate(prepared.leaves):
        kind = (
            kind_of(leaf.dtype, unknown)
            if stats_on and isinstance(leaf, ArrayLeaf) and leaf.kind != PRNG_KEY
            else unknown
        )
        kinds.append(kind)
        measure = kind != unknown
        if isinstance(leaf, ValueLeaf) or not (primary or leaf.sharded):
            plans.append(None)
            continue
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
            in_pieces.append(i)
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

    fetcher = Fetcher(Window(options.window), options.chunk_size)
    for i, private in chunked:
        plan = plans[i]
        measure = kinds[i] != unknown
        address = prepared.leaves[i][0]
        if type(plan) is not list:  # host data, or a device array
            if plan.nbytes:
                plans[i] = _plan_chunks(plan, options, submit, private, measure, fetcher, address)
        else:
            plans[i] = [
                (
                    start,
                    piece.shape,
                    [ref]
                    if type(ref) is tuple
                    else _plan_chunks(piece, options, submit, private, measure, fetcher, address),
                )
                for start, piece, ref in plan
            ]
    fetcher.run()  # every device leaf's chunks submitted: its futures are in plans

    packs, small_records, packed = _pack_results(pack_jobs, in_pieces, kinds)
    packed_rows: list[int] = []  # the sink's rows of the measured leaves packed whole, in order
    packed_leaf = sink.packed_leaf
    any_packed = False
    row = len(sink)  # the sink's row of the next leaf
    for i, ((address, leaf), plan) in enumerate(zip(prepared.leaves, plans, strict=True)):
        if isinstance(leaf, ValueLeaf):
            sink.value(leaf.kind, leaf.value, address, i)
            row += 1
            continue
        if type(plan) is tuple:  # packed whole: its statistics are its pack's row (set below)
            if kinds[i] != unknown:
                packed_rows.append(row)
            packed_leaf(leaf.kind, leaf.dtype, leaf.shape, leaf.prng_impl, leaf.weak_type, plan, i)
            any_packed = True
            row += 1
            continue
        if plan is None:  # another process writes it
            continue
        pieces: list[PieceRow] | None = None
        records = small_records.get(i, [])
        refs: list[Ref] = []  # none for an empty leaf
        if type(plan) is list:
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
                            records.append(record)
                    refs += got
                    pieces.append((start, shape, len(got)))
            else:
                for f in plan:
                    ref, record = f.result()
                    refs.append(ref_of(ref))
                    records.append(record)
            lock.refresh(_locks.STALE_AFTER)  # after waiting for chunks: keep the save's lock fresh
        stats = None
        if stats_on:
            stats = _stats.combine(records, kinds[i])
        sink.array(
            leaf.kind, leaf.dtype, leaf.shape, leaf.prng_impl, leaf.weak_type, refs, pieces, address, i, stats
        )
        row += 1
    if stats_on and any_packed:
        sink.measured = True  # as array() with a placeholder record would have
    if packed_rows:
        sink.set_stats(packed_rows, packed)
    return packs


def _pack_results(
    jobs: list[cf.Future[Packed]], in_pieces: list[int], kinds: list[int]
) -> tuple[list[ChunkRef], dict[int, list[_stats.Record | None]], np.ndarray]:
    """The packs' refs, once every pack is stored; the records of the sharded leaves' packed
    pieces, by leaf; and the statistics of the measured leaves packed whole, in leaf order (a
    leaf's row UNKNOWN where its pack measured it as another kind than the leaf's)."""
    done = [job.result() for job in jobs]
    if not done:
        return [], {}, np.zeros(0, _stats.STATS_DTYPE)
    leaves = np.concatenate([d[1] for d in done])
    table = np.concatenate([d[2] for d in done])
    pieces = np.isin(leaves, np.array(in_pieces, np.int64))
    small_records: dict[int, list[_stats.Record | None]] = {}
    if pieces.any():
        for i, record in zip(leaves[pieces].tolist(), _stats.records(table[pieces]), strict=True):
            small_records.setdefault(i, []).append(record)
    whole, which = table[~pieces], leaves[~pieces]
    whole[whole["kind"] != np.array(kinds, np.uint8)[which]] = np.zeros(1, _stats.STATS_DTYPE)
    return [d[0] for d in done], small_records, whole
