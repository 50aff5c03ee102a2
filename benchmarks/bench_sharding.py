"""Checkpoints of sharded arrays: treestore vs orbax StandardCheckpointer on 8 CPU devices, one process.

    python -m benchmarks.bench_sharding [--runs 3] [--tmp-root DIR]

The GPT-2-small-shaped tree (~498 MB fp32) is sharded over 8 devices (each leaf along its first
axis divisible by 8, else replicated). Measured (medians): save (to durable), restore onto the same
sharding, and restore onto a 2-device sharding. Targets (issue 7): save and restore ≤ 0.5× orbax.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import logging
import shutil
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import treestore

from . import harness as H
from . import trees as T


def spec_for(shape: tuple[int, ...], n: int) -> P:
    for axis, dim in enumerate(shape):
        if dim % n == 0:
            return P(*([None] * axis), "d")
    return P()


def shardings(tree: Any, mesh: Mesh) -> Any:
    n = mesh.devices.size
    return T.map_leaves(lambda x: NamedSharding(mesh, spec_for(tuple(x.shape), n)), tree)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_sharding")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tmp-root", default=None)
    args = ap.parse_args(argv)
    if len(jax.devices()) < 8:
        print("needs 8 devices: run as its own process (XLA_FLAGS is set on import)", file=sys.stderr)
        return 2
    logging.getLogger("absl").setLevel(logging.ERROR)
    import orbax.checkpoint as ocp

    root = H.make_tmp_root(args.tmp_root)
    try:
        host = T.gpt2_small()
        mesh8 = Mesh(np.array(jax.devices()), ("d",))
        mesh2 = Mesh(np.array(jax.devices()[:2]), ("d",))
        s8, s2 = shardings(host, mesh8), shardings(host, mesh2)
        tree = jax.tree.map(lambda x, s: jax.device_put(x, s), host, s8)
        jax.block_until_ready(tree)
        like8 = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), host, s8)
        like2 = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), host, s2)
        ckptr = ocp.StandardCheckpointer()
        counter = iter(range(10**6))

        def ts_save() -> None:
            treestore.save(os.path.join(root, f"ts{next(counter)}"), tree, "c")
            os.sync()

        def ob_save() -> None:
            ckptr.save(os.path.join(root, f"ob{next(counter)}"), tree)
            ckptr.wait_until_finished()
            os.sync()

        t_ts_save, t_ob_save = H.median_time(ts_save, args.runs), H.median_time(ob_save, args.runs)
        ts_path, ob_path = os.path.join(root, "ts-fixed"), os.path.join(root, "ob-fixed")
        treestore.save(ts_path, tree, "c")
        ckptr.save(ob_path, tree)
        ckptr.wait_until_finished()

        def ts_load(like: Any) -> Callable[[], Any]:
            return lambda: jax.block_until_ready(treestore.load(ts_path, "c", like=like))

        def ob_load(like: Any) -> Callable[[], Any]:
            return lambda: jax.block_until_ready(ckptr.restore(ob_path, like))

        check = treestore.load(ts_path, "c", like=like2)
        assert all(
            np.asarray(a).tobytes() == b.tobytes()
            for a, b in zip(jax.tree.leaves(check), jax.tree.leaves(host), strict=True)
        )
        rows = [
            ("save (8 devices)", t_ts_save, t_ob_save),
            (
                "restore onto the same 8-device sharding",
                H.median_time(ts_load(like8), args.runs),
                H.median_time(ob_load(like8), args.runs),
            ),
            (
                "restore onto 2 devices (reshard)",
                H.median_time(ts_load(like2), args.runs),
                H.median_time(ob_load(like2), args.runs),
            ),
        ]
        title = "## Checkpoints of sharded arrays, 8 CPU devices, one process"
        print(f"{title} (GPT-2-small shapes, 497.8 MB fp32)\n")
        print(f"- median of {args.runs} runs; save includes os.sync(); warm page cache; local disk\n")
        print("| operation | treestore | orbax StandardCheckpointer | ratio | target ≤ 0.5× orbax |")
        print("|---|---:|---:|---:|---|")
        for name, ts, ob in rows:
            status = "met" if ts <= 0.5 * ob else "**not met**"
            print(f"| {name} | {ts:.3f} s | {ob:.3f} s | {ts / ob:.2f}× | {status} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
