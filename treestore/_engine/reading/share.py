"""Leaves replicated across processes, read once and shared over the devices' interconnect.

For the shared leaves of a load (:mod:`treestore._engine.reading.share_plan`), in batches of
about :data:`BATCH_BYTES`, the same on every process:

1. Each process reads the regions the plan gives it, every chunk checked against its digest, as
   any load does; then puts each region's bytes, as unsigned integers of the leaf's width (the
   same bits), on the device the plan names, and zeros on the region's other devices.
2. It compiles the batch's program: over each leaf's mesh, a ``psum`` along the mesh axes the
   leaf is replicated along (the sum of one region's bytes and zeros is those bytes, exactly:
   integer addition), then the bits taken back as the leaf's dtype.
3. Every process votes (:class:`Agreement`): each says it read and prepared everything and what
   it is about to share; a process that failed, or a plan that differs, makes every process
   raise before any collective starts, and one that never votes makes them raise
   ``BarrierTimeoutError`` after the barrier timeout.
4. The program runs; a collective that fails (a process died in it) raises ``DeviceError``, one
   that does not finish within the barrier timeout ``BarrierTimeoutError``.

The caller votes once more after the last batch (:mod:`treestore._engine.group.restore_vote`), so
every process returns its tree or every process raises.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from treestore._engine.reading import region as _region
from treestore._engine.reading.read import ChunkReader
from treestore._engine.reading.share_plan import Shared, key_of, region_of
from treestore._format.manifest.columns import Columns
from treestore._kernels.digest import digest
from treestore._tree.jax_import import jax
from treestore.errors import BarrierTimeoutError, DeviceError

BATCH_BYTES = 256 * 2**20  # bytes of shared leaves per collective, at most (a bigger leaf alone)


class Agreement(Protocol):
    """The votes of a restore's processes (:mod:`treestore._engine.group.restore_vote`)."""

    timeout: float

    def agree(self, token: str) -> None:
        """Return once every process has voted this step with the same ``token``; raise when
        one failed or voted otherwise, or when one has not voted within ``timeout`` seconds."""


def restore_shared(
    reader: ChunkReader,
    columns: Columns,
    shared: Sequence[Shared],
    threads: int,
    agreement: Agreement,
    token: str,
) -> dict[int, Any]:
    """The jax.Array of each shared leaf, by its position among the load's sharded leaves."""
    out: dict[int, Any] = {}
    me = jax.process_index()
    for batch in batches(shared):
        args, program = _prepared(reader, columns, batch, me, threads)
        agreement.agree(batch_token(token, batch))
        arrays = _bounded(functools.partial(program, *args), agreement.timeout, columns.name)
        out.update((s.position, a) for s, a in zip(batch, arrays, strict=True))
    return out


def batches(shared: Sequence[Shared]) -> list[list[Shared]]:
    """``shared`` by mesh (one program runs over one mesh), each mesh's leaves in runs of at most
    :data:`BATCH_BYTES` (a bigger leaf alone): the same runs on every process."""
    by_mesh: dict[Any, list[Shared]] = {}
    for s in shared:
        by_mesh.setdefault(s.sharding.mesh, []).append(s)
    out: list[list[Shared]] = []
    for leaves in by_mesh.values():
        run: list[Shared] = []
        size = 0
        for s in leaves:
            if run and size + s.nbytes > BATCH_BYTES:
                out.append(run)
                run, size = [], 0
            run.append(s)
            size += s.nbytes
        out.append(run)
    return out


def batch_token(token: str, batch: Sequence[Shared]) -> str:
    """What a batch shares, as a digest every process must agree on: the checkpoint (``token``)
    and each leaf's address, shape, dtype, partition, mesh and readers."""
    parts = [token]
    for s in batch:
        mesh = s.sharding.mesh
        parts.append(
            f"{s.slot.address}|{s.shape}|{s.dtype}|{tuple(s.sharding.spec)}|{mesh.axis_names}|"
            f"{[d.id for d in mesh.devices.flat]}|{[d.id for d in s.readers]}"
        )
    return digest("\n".join(parts).encode()).hex()


def _prepared(
    reader: ChunkReader, columns: Columns, batch: Sequence[Shared], me: int, threads: int
) -> tuple[list[Any], Callable[..., Any]]:
    """This process's regions of ``batch`` read and placed (zeros on the devices that do not
    read), and the batch's compiled program: all that can fail before the collective."""
    mine = [s.read_by(me) for s in batch]
    wanted = [
        (_region.leaf_pieces(columns, s.index), [s.layout.regions[k] for k in ks])
        for s, ks in zip(batch, mine, strict=True)
        if ks
    ]
    found = iter(_region.read_many(reader, wanted, threads))
    args = []
    for s, ks in zip(batch, mine, strict=True):
        data = dict(zip(ks, next(found), strict=True)) if ks else {}
        args.append(_placed(s, data))
    program = _program(batch[0].sharding.mesh, tuple(_signature(s) for s in batch))
    compiled = program.lower(*args).compile()
    return args, compiled


def _placed(s: Shared, data: dict[int, np.ndarray[Any, Any]]) -> Any:
    """Leaf ``s`` as a global array of its wire type: on each of this process's devices, the
    region's bytes where the device is its reader (``data``, by region), else zeros."""
    arrays = []
    for device, index in s.sharding.addressable_devices_indices_map(s.shape).items():
        k = s.layout.keys[key_of(region_of(index, s.shape))]
        found = data.get(k) if s.readers[k] == device else None
        if found is None:
            shape = tuple(r.stop - r.start for r in s.layout.regions[k])
            bits = np.zeros(shape, s.wire)
        else:
            bits = (found if found.dtype == s.dtype else found.astype(s.dtype)).view(s.wire)
        arrays.append(jax.device_put(bits, device))
    return jax.make_array_from_single_device_arrays(s.shape, s.sharding, arrays)


Signature = tuple[Any, tuple[str, ...], np.dtype[Any]]  # spec, axes, dtype


def _signature(s: Shared) -> Signature:
    return (s.sharding.spec, s.layout.axes, s.dtype)


@functools.lru_cache(maxsize=32)
def _program(mesh: Any, leaves: tuple[Signature, ...]) -> Any:
    """The jitted program that shares a batch: per leaf, a psum of its wire bits along its
    replicated axes, taken back as its dtype, onto its own sharding."""
    specs = tuple(spec for spec, _, _ in leaves)

    def body(*bits: Any) -> tuple[Any, ...]:
        out = []
        for x, (_, axes, dtype) in zip(bits, leaves, strict=True):
            summed = jax.lax.psum(x, axes)
            out.append(summed != 0 if dtype == np.bool_ else jax.lax.bitcast_convert_type(summed, dtype))
        return tuple(out)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=specs, check_vma=False)
    shardings = tuple(jax.sharding.NamedSharding(mesh, spec) for spec in specs)
    return jax.jit(mapped, out_shardings=shardings)


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


__all__ = ["BATCH_BYTES", "Agreement", "batch_token", "batches", "restore_shared"]
