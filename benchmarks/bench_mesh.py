"""Restoring onto many devices: what a mesh costs beside the same bytes onto one device.

    python -m benchmarks.bench_mesh [--runs 3] [--tmp-root DIR] [--cases NAME,...]

Each case is a tree of equal float32 leaves sharded along their first axis over a mesh of CPU
devices (one process; XLA_FLAGS gives it 64). Measured (medians), treestore beside orbax
StandardCheckpointer in the same run: save sharded, and the same bytes saved from one device;
restore onto the saving sharding, onto a different mesh (the other half of the devices, as a
2-D mesh over both axes, so every shard is cut from several saved pieces), and onto one device.
Targets: restore onto the saving mesh and onto a different mesh ≤ 1.3× the same tree onto one
device; the 128k-shard case ≤ 3 s; sharded save ≤ 1.2× the unsharded save. Beside treestore's save,
what jax alone takes to put every distinct shard on host (``np.asarray(shard.data)``), which any
save that writes each device's shard pays. Each library runs
each case in a fresh process of its own, so neither's memory, threads or kernel work (reclaiming
what the other allocated) lands in the other's timings; the figures are printed side by side.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=64")

import argparse
import json
import logging
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import treestore

from . import harness as H

_COUNTER = iter(range(10**6))  # a fresh store folder for every save, across cases
CASES = {  # name: (leaves, shape, devices)
    "1000x256x256/8": (1000, (256, 256), 8),
    "200x1024x256/64": (200, (1024, 256), 64),
    "2000x64x4/64": (2000, (64, 4), 64),
}


def _like(shape: tuple[int, ...], n: int, sharding: Any) -> dict[str, Any]:
    return {f"l{i:04d}": jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding) for i in range(n)}


def _ready(tree: Any) -> Any:
    return jax.block_until_ready(tree)


FLOOR = "jax alone: each shard to host"  # what any save of each device's shard pays


def run_case(name: str, root: str, runs: int, library: str) -> list[tuple[str, float]]:
    """One library's rows of case ``name``: (operation, median seconds)."""
    n, shape, devices = CASES[name]
    mesh = Mesh(np.array(jax.devices()[:devices]), ("d",))
    saved = NamedSharding(mesh, P("d"))
    half = np.array(jax.devices()[devices // 2 : devices]).reshape(devices // 4, 2)
    other = NamedSharding(Mesh(half, ("a", "b")), P("a", "b"))
    one = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("d",)), P())
    rng = np.random.default_rng(0)
    host = {f"l{i:04d}": rng.standard_normal(shape, dtype=np.float32) for i in range(n)}
    sharded = {k: jax.device_put(v, saved) for k, v in host.items()}
    single = {k: jax.device_put(v, one) for k, v in host.items()}
    jax.block_until_ready((sharded, single))
    if library == "treestore":

        def save(path: str, tree: Any) -> None:
            treestore.save(path, tree, "c")

        def restore(path: str, like: Any) -> Any:
            return treestore.load(path, "c", like=like)

    else:
        import orbax.checkpoint as ocp

        ckptr = ocp.StandardCheckpointer()

        def save(path: str, tree: Any) -> None:
            ckptr.save(path, tree)
            ckptr.wait_until_finished()

        def restore(path: str, like: Any) -> Any:
            return ckptr.restore(path, like)

    def saving(tree: Any) -> Callable[[], None]:
        return lambda: (save(os.path.join(root, f"{library}{next(_COUNTER)}"), tree), os.sync())

    def to_host() -> None:  # what any per-shard save asks of jax: each distinct shard on host
        for leaf in sharded.values():
            for shard in leaf.addressable_shards:
                if shard.replica_id == 0:
                    np.asarray(shard.data)

    rows = [
        ("save sharded", H.median_time(saving(sharded), runs)),
        ("save from one device", H.median_time(saving(single), runs)),
    ]
    if library == "treestore":
        rows.append((FLOOR, H.median_time(to_host, runs)))
    path = os.path.join(root, f"{library}-{devices}")
    shutil.rmtree(path, ignore_errors=True)
    save(path, sharded)
    check = restore(path, _like(shape, n, other))
    assert all(np.asarray(check[k]).tobytes() == host[k].tobytes() for k in host)
    del check
    for what, sharding in (
        ("restore onto the saving mesh", saved),
        ("restore onto another mesh", other),
        ("restore onto one device", one),
    ):
        like = _like(shape, n, sharding)
        rows.append((what, H.median_time(lambda like=like: _ready(restore(path, like)), runs)))
    return rows


def measured(name: str, runs: int, library: str, tmp_root: str | None) -> dict[str, float]:
    """Case ``name`` for one library, in a process of its own (``--library``): neither library's
    memory, threads or page cache is left to the other's timings."""
    argv = [sys.executable, "-m", "benchmarks.bench_mesh", "--library", library, "--cases", name]
    argv += ["--runs", str(runs)] + (["--tmp-root", tmp_root] if tmp_root else [])
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_mesh")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tmp-root", default=None)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--library", choices=["treestore", "orbax"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if len(jax.devices()) < 64:
        print("needs 64 devices: run as its own process (XLA_FLAGS is set on import)", file=sys.stderr)
        return 2
    logging.getLogger("absl").setLevel(logging.ERROR)
    if args.library:  # one library's rows, as JSON, for the process that prints the table
        root = H.make_tmp_root(args.tmp_root)
        try:
            for name in args.cases.split(","):
                print(json.dumps(run_case(name, root, args.runs, args.library)))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return 0
    print("## Restoring onto many devices (CPU devices, one process per library and case)\n")
    print(f"- median of {args.runs} runs; save includes os.sync(); warm page cache; local disk\n")
    print("| case | operation | treestore | orbax | vs orbax | vs one device | target |")
    print("|---|---|---:|---:|---:|---:|---|")
    for name in args.cases.split(","):
        ours = measured(name, args.runs, "treestore", args.tmp_root)
        theirs = measured(name, args.runs, "orbax", args.tmp_root)
        for what, ts in ours.items():
            ob = theirs.get(what)
            if what == FLOOR:
                base, ok, target = ours["save from one device"], True, ""
            elif what.startswith("restore onto") and what != "restore onto one device":
                base = ours["restore onto one device"]
                limit = 3.0 if name.startswith("2000x") else None
                ok = ts <= 1.3 * base or (limit is not None and ts <= limit)
                target = "≤ 1.3× one device" + (" or ≤ 3 s" if limit else "")
            elif what == "save sharded":
                base = ours["save from one device"]
                ok, target = ts <= 1.2 * base, "≤ 1.2× one device"
            else:
                base, ok, target = ts, True, ""
            status = (f"{target}: {'met' if ok else '**not met**'}") if target else ""
            vs = ("", "") if ob is None else (f"{ob:.3f} s", f"{ts / ob:.2f}×")
            cells = [name, what, f"{ts:.3f} s", *vs, f"{ts / base:.2f}×", status]
            print("| " + " | ".join(cells) + " |")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
