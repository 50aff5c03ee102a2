"""One process of a jax.distributed job that saves or restores sharded arrays (tests only).

usage: distributed_worker.py PORT PROCESS_ID NUM_PROCESSES STORE MODE
MODE "save": build the global arrays on a (processes x 2) mesh and save them as "dist".
MODE "load": restore "dist" onto a mesh with another partition spec and check every shard.
MODE "fail": like save (as "broken"), but process 1's chunk writes fail: every process must raise.
MODE "absent": process 0 saves "absent" with a 3 s barrier timeout and process 1 never does: process
0 must raise BarrierTimeoutError naming process 1.
Prints "OK <process id>" on success.
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def expected() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(42)
    return {
        "w": rng.standard_normal((32, 24)).astype(np.float32),
        "v": rng.integers(0, 1000, (16,)).astype(np.int32),
        "r": rng.standard_normal((8, 4)).astype(np.float32),  # fully replicated
    }


def main() -> None:
    port, pid, nproc, store, mode = sys.argv[1:]
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"  # read when jax starts
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=int(nproc), process_id=int(pid)
    )
    import treestore

    values = expected()
    devices = np.array(jax.devices()).reshape(int(nproc), -1)
    if mode in ("save", "fail", "absent"):
        mesh = Mesh(devices, ("x", "y"))
        specs = {"w": P("x", "y"), "v": P(("x", "y")), "r": P()}
    else:
        mesh = Mesh(devices.T, ("x", "y"))  # another device order
        specs = {"w": P("y", None), "v": P(), "r": P("x")}
    shardings = {k: NamedSharding(mesh, specs[k]) for k in values}
    if mode == "absent":
        from jax._src import distributed

        if pid == "0":
            os.environ["TREESTORE_BARRIER_TIMEOUT"] = "3"
            tree = {
                k: jax.make_array_from_callback(v.shape, shardings[k], lambda idx, v=v: v[idx])
                for k, v in values.items()
            }
            try:
                treestore.save(store, tree, "absent")
            except treestore.errors.BarrierTimeoutError as exc:
                assert exc.missing == (1,), exc.missing
                print(f"raised {type(exc).__name__}: {exc}", flush=True)
            else:
                raise SystemExit("the save did not time out")
        distributed.global_state.client.wait_at_barrier("test-absent-done", 120_000)
    elif mode in ("save", "fail"):
        tree = {
            k: jax.make_array_from_callback(v.shape, shardings[k], lambda idx, v=v: v[idx])
            for k, v in values.items()
        }
        if mode == "save":
            treestore.save(store, tree, "dist", metadata={"processes": int(nproc)})
        else:
            from treestore._storage import local as _local

            if pid == "1":
                real = _local.LocalStorage._write_tmp

                def broken(self, full, buffers):
                    if "/chunks/" in full:
                        raise PermissionError("disk on fire")
                    return real(self, full, buffers)

                _local.LocalStorage._write_tmp = broken  # type: ignore[method-assign]
            try:
                treestore.save(store, tree, "broken")
            except treestore.TreestoreError as exc:
                print(f"raised {type(exc).__name__}: {exc}", flush=True)
            else:
                raise SystemExit("the save did not fail")
    else:
        like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in values.items()}
        out = treestore.load(store, "dist", like=like)
        for k, v in values.items():
            assert out[k].sharding == shardings[k], k
            for shard in out[k].addressable_shards:
                got = np.asarray(shard.data)
                assert got.tobytes() == v[shard.index].tobytes(), (k, shard.index)
    print(f"OK {pid}", flush=True)


if __name__ == "__main__":
    main()
