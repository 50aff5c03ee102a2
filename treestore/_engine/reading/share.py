"""Leaves replicated across processes, read once and shared over the devices' interconnect.

For each batch of a load's shared leaves (:mod:`treestore._engine.reading.share_plan`), the same
on every process:

1. Each process reads, for each of its devices, the regions (or parts of regions) the plan
   gives that device's replica index (in the device's replica group), every chunk checked
   against its digest as any load does, and lays their bytes one after the other in the
   device's *segment* (zeros between and past them).
2. It compiles the batch's programs: over the mesh, an ``all_gather`` of the segments along
   the replicated axes; and, on accelerators, one per kind of leaf (partition, region shape,
   dtype, parts), the cut of a leaf's region from its readers' gathered segments, its parts'
   bytes one after the other taken back as the leaf's dtype (a bitcast: the bits as stored;
   -0.0 and NaN payloads included). On CPU devices the gathered segments are in host memory
   already: a leaf's region is copied out of them on the host, with no program (a compile per
   kind of leaf cost a job's first restore more than reading its bytes did).
3. Every process votes (:class:`Agreement`): each says it read and prepared everything and what
   it is about to share, as a digest every process must match; a process that failed, or a plan
   that differs, makes every process raise before any collective starts, and one that never
   votes makes them raise ``BarrierTimeoutError`` after the barrier timeout.
4. The gather runs; a collective that fails (a process died in it) raises ``DeviceError``, one
   that does not finish within the barrier timeout ``BarrierTimeoutError``. Then each leaf is cut
   on this process's devices, which no other process waits on.

One all-gather per batch moves each byte to each device once; a ``psum`` of each leaf (the bytes
on its reader, zeros elsewhere) moves each twice, adds them up, and runs one collective per leaf:
0.85 s against 0.22 s for 32 MiB in 16 leaves on eight CPU processes (gloo). The caller votes
once more after the last batch
(:mod:`treestore._engine.group.restore_vote`), so every process returns its tree or none does.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from treestore._engine.reading import region as _region
from treestore._engine.reading.memory import allocate, allocate_many
from treestore._engine.reading.read import ChunkReader
from treestore._engine.reading.share_plan import ALIGN, Batch, Shared
from treestore._format.manifest.columns import Columns
from treestore._kernels.digest import digest
from treestore._tree.jax_import import jax
from treestore.errors import BarrierTimeoutError, DeviceError


class Agreement(Protocol):
    """The votes of a restore's processes (:mod:`treestore._engine.group.restore_vote`)."""

    timeout: float

    def agree(self, token: str) -> None:
        """Return once every process has voted this step with the same ``token``; raise when
        one failed or voted otherwise, or when one has not voted within ``timeout`` seconds."""


def restore_shared(
    reader: ChunkReader,
    columns: Columns,
    batches: Sequence[Batch],
    threads: int,
    agreement: Agreement,
    token: str,
) -> dict[int, Any]:
    """The jax.Array of each shared leaf, by its position among the load's sharded leaves."""
    out: dict[int, Any] = {}
    for batch in batches:
        segments, (gather, cutters) = _prepared(reader, columns, batch, threads)
        agreement.agree(batch_token(token, batch))
        gathered = _bounded(functools.partial(gather, segments), agreement.timeout, columns.name)
        del segments  # not held while the next batch is read
        for parts in _leaves(batch):  # on this process's devices alone: no other process waits on it
            if cutters is None:
                out[parts[0].position] = _cut_on_host(gathered, parts, columns.name)
                continue
            start = np.array([[s.reader, s.offset // ALIGN] for s in parts], np.int32)
            starts = jax.make_array_from_callback(start.shape, _replicated(batch.mesh), start.__getitem__)
            out[parts[0].position] = cutters[_signature(parts)](gathered, starts)
        del gathered
    return out


def cuts_on_device(mesh: Any) -> bool:
    """Whether the leaves are cut from the gathered segments by a program on the devices (on
    accelerators), or on the host (CPU devices: the gathered bytes are in host memory already,
    and a copy of a leaf's bytes costs less than compiling a program to take them)."""
    return any(d.platform != "cpu" for d in mesh.devices.flat)


def _leaves(batch: Batch) -> list[list[Shared]]:
    """The batch's leaves, each as its parts in the order of their rows (one part: the leaf
    whole)."""
    found: dict[int, list[Shared]] = {}
    for s in batch.leaves:
        found.setdefault(s.position, []).append(s)
    return [sorted(parts, key=lambda s: s.start) for parts in found.values()]


def _cut_on_host(gathered: Any, parts: list[Shared], checkpoint: str) -> Any:
    """A leaf (its ``parts``) from the gathered segments on CPU devices: on each of this
    process's devices, each part's bytes in its reader's segment copied out, one after the
    other, and taken back as the leaf's dtype (the bits as stored, as the device cut's bitcast;
    a bool is a byte that is not zero), in memory of its own: a leaf does not keep the batch's
    gathered bytes alive."""
    s = parts[0]
    n = math.prod(s.whole_shape) * s.dtype.itemsize
    shards = gathered.addressable_shards
    outs = allocate_many([(n,)] * len(shards), s.slot.address, checkpoint, np.uint8)
    arrays = []
    for shard, out in zip(shards, outs, strict=True):
        held = np.asarray(shard.data)
        for part in parts:
            raw = held[part.reader, part.offset : part.offset + part.region_bytes]
            into = out[part.start : part.start + part.region_bytes]
            if s.dtype == np.bool_:
                np.not_equal(raw, 0, out=into.view(np.bool_))
            else:
                into[:] = raw
        # Aligned: jax takes it onto the CPU device as it is, with no second copy.
        arrays.append(jax.device_put(out.view(s.dtype).reshape(s.whole_shape), shard.device))
    sharding = jax.sharding.NamedSharding(gathered.sharding.mesh, s.sharding.spec)
    return jax.make_array_from_single_device_arrays(s.shape, sharding, arrays)


def batch_token(token: str, batch: Batch) -> str:
    """What a batch shares, as a digest every process must agree on: the checkpoint (``token``),
    the mesh, and each leaf's (or part's) address, shape, dtype, partition, rows, reader and
    offset."""
    parts = [token, f"{batch.mesh.axis_names}|{[d.id for d in batch.mesh.devices.flat]}|{batch.size}"]
    parts += [
        f"{s.slot.address}|{s.shape}|{s.dtype}|{tuple(s.sharding.spec)}|{s.rows}|{s.reader}|{s.offset}"
        for s in batch.leaves
    ]
    return digest("\n".join(parts).encode()).hex()


def _prepared(reader: ChunkReader, columns: Columns, batch: Batch, threads: int) -> tuple[Any, Programs]:
    """This process's devices' segments of ``batch``, read and placed, and the batch's compiled
    programs (the gather, and a cut per kind of leaf): all that can fail before the collective."""
    mesh = batch.mesh
    everywhere = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(tuple(mesh.axis_names)))
    # Compiled while the regions are read (an XLA compile takes tens of milliseconds a program).
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="treestore-compile") as pool:
        compiled = pool.submit(_compiled, batch, everywhere)
        segments = _segments(reader, columns, batch, threads, everywhere)
        return segments, compiled.result()


def _segments(reader: ChunkReader, columns: Columns, batch: Batch, threads: int, everywhere: Any) -> Any:
    """The segments of ``batch`` as a global array: on each of this process's devices, the
    regions its replica index reads in its replica group, read from storage, at their offsets."""
    mesh = batch.mesh
    devices = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    jobs = {d: _reads(batch, d) for d in devices}
    wanted: dict[int, list[int]] = {}  # leaf -> the regions of it this process reads
    for pairs in jobs.values():
        for j, k in pairs:
            if k not in wanted.setdefault(j, []):
                wanted[j].append(k)
    leaves = sorted(wanted)
    asked = [_asked(columns, batch.leaves[j], wanted[j]) for j in leaves]
    data: dict[tuple[int, int], np.ndarray[Any, Any]] = {}
    for j, outs in zip(leaves, _region.read_many(reader, asked, threads), strict=True):
        data.update(((j, k), out) for k, out in zip(wanted[j], outs, strict=True))
    arrays = []
    for d in devices:
        segment = allocate(batch.size, f"segment of {len(batch.leaves)} shared leaves", columns.name)
        end = 0  # the bytes not laid yet are zeros, not what the memory held before
        for j, k in sorted(jobs[d], key=lambda job: batch.leaves[job[0]].offset):
            s = batch.leaves[j]
            got = data[j, k] if data[j, k].dtype == s.dtype else data[j, k].astype(s.dtype)
            bits = np.ascontiguousarray(got).reshape(-1).view(np.uint8)
            segment[end : s.offset] = 0
            segment[s.offset : s.offset + s.region_bytes] = bits
            end = s.offset + s.region_bytes
        segment[end:] = 0
        arrays.append(jax.device_put(segment, d))  # aligned: taken as it is, not copied
    return jax.make_array_from_single_device_arrays((batch.size * mesh.devices.size,), everywhere, arrays)


def _compiled(batch: Batch, everywhere: Any) -> Programs:
    """The batch's gather and its cuts (one per kind of leaf; none where the leaves are cut on
    the host: :func:`cuts_on_device`), compiled."""
    mesh = batch.mesh
    gather = _gather(mesh, batch.axes)
    segments = jax.ShapeDtypeStruct((batch.size * mesh.devices.size,), np.uint8, sharding=everywhere)
    if not cuts_on_device(mesh):
        return gather.lower(segments).compile(), None
    replicas = batch.leaves[0].layout.replicas
    gathered = jax.ShapeDtypeStruct((mesh.devices.size * replicas, batch.size), np.uint8, sharding=everywhere)
    cutters = {}
    for signature in dict.fromkeys(_signature(parts) for parts in _leaves(batch)):
        starts = jax.ShapeDtypeStruct((len(signature[3]), 2), np.int32, sharding=_replicated(mesh))
        cutters[signature] = _cut(mesh, *signature).lower(gathered, starts).compile()
    return gather.lower(segments).compile(), cutters


def _reads(batch: Batch, device: Any) -> list[tuple[int, int]]:
    """What ``device`` reads of ``batch``: (leaf, the region of its replica group) for each leaf
    whose reader is its replica index."""
    out = []
    for j, s in enumerate(batch.leaves):
        group, replica = s.layout.place[device]
        if replica == s.reader:
            out.append((j, group))
    return out


def _asked(columns: Columns, s: Shared, groups: list[int]) -> tuple[_region.LeafPieces, list[Any]]:
    """What :func:`_region.read_many` reads of leaf ``s``: its regions of ``groups``."""
    return _region.leaf_pieces(columns, s.index), [s.region(k) for k in groups]


Signature = tuple[
    Any, tuple[int, ...], np.dtype[Any], tuple[int, ...]
]  # spec, region shape, dtype, parts' bytes


Programs = tuple[Callable[..., Any], dict[Signature, Callable[..., Any]] | None]  # the gather, the cuts


def _signature(parts: list[Shared]) -> Signature:
    s = parts[0]
    return (s.sharding.spec, s.whole_shape, s.dtype, tuple(p.region_bytes for p in parts))


def _replicated(mesh: Any) -> Any:
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


@functools.lru_cache(maxsize=32)
def _gather(mesh: Any, axes: tuple[str, ...]) -> Any:
    """The collective of a batch: every device's segment gathered, along ``axes``, by every
    device of its replica group ([replicas, size] on each device)."""
    everywhere = jax.sharding.PartitionSpec(tuple(mesh.axis_names))

    def body(segment: Any) -> Any:
        return jax.lax.all_gather(segment, axes)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=everywhere, out_specs=everywhere, check_vma=False)
    return jax.jit(mapped, out_shardings=jax.sharding.NamedSharding(mesh, everywhere))


@functools.lru_cache(maxsize=256)
def _cut(mesh: Any, spec: Any, shape: tuple[int, ...], dtype: np.dtype[Any], sizes: tuple[int, ...]) -> Any:
    """A leaf of ``shape`` (a region) and ``dtype`` cut from the gathered segments: its parts,
    of ``sizes`` bytes, at ``starts`` (each part's reader, and its offset in units of
    :data:`ALIGN`), one after the other, their bytes taken back as its dtype, onto ``spec``: one
    program per kind of leaf, however many leaves of that kind (a program per leaf took XLA
    about 13 ms each to compile)."""
    everywhere = jax.sharding.PartitionSpec(tuple(mesh.axis_names))

    def body(gathered: Any, starts: Any) -> Any:
        blocks = gathered.reshape(gathered.shape[0], -1, ALIGN)
        pieces = []
        for i, n in enumerate(sizes):
            rows = -(-n // ALIGN)
            at = (starts[i, 0], starts[i, 1], 0)
            pieces.append(jax.lax.dynamic_slice(blocks, at, (1, rows, ALIGN)).reshape(-1)[:n])
        raw = pieces[0] if len(pieces) == 1 else jax.numpy.concatenate(pieces)
        if dtype == np.bool_:
            return (raw != 0).reshape(shape)
        if dtype.itemsize == 1:
            return jax.lax.bitcast_convert_type(raw, dtype).reshape(shape)
        return jax.lax.bitcast_convert_type(raw.reshape((*shape, dtype.itemsize)), dtype)

    in_specs = (everywhere, jax.sharding.PartitionSpec())
    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=spec, check_vma=False)
    return jax.jit(mapped, out_shardings=jax.sharding.NamedSharding(mesh, spec))


def _bounded(run: Callable[[], Any], timeout: float, checkpoint: str) -> Any:
    """``run()`` (the collective) waited for at most ``timeout`` seconds, on a thread of its own:
    a process that hangs in it must not hang the others. DeviceError when it fails (another
    process died in it), BarrierTimeoutError when it does not finish in time."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["out"] = jax.block_until_ready(run())
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, name="treestore-share", daemon=True)
    thread.start()
    thread.join(timeout)
    where = f"multi-process restore of checkpoint {checkpoint!r}"
    if thread.is_alive():
        raise BarrierTimeoutError(
            f"{where}: the collective that shares the replicated leaves did not finish within "
            f"{timeout:g} s (a process stopped in it?); the restore returns nothing",
            checkpoint=checkpoint,
        )
    error = box.get("error")
    if error is not None:
        raise DeviceError(
            f"{where}: the collective that shares the replicated leaves failed ({type(error).__name__}: "
            f"{str(error).strip()[:500]}); the restore returns nothing",
            checkpoint=checkpoint,
        ) from error
    return box["out"]


__all__ = ["Agreement", "batch_token", "restore_shared"]
