"""Two tiers: bytes uploaded per step when one of 12 layers changes, vs a full copy.

    python -m benchmarks.bench_two_tier [--steps 6] [--layer-mb 4] [--s3] [--tmp-root DIR]

A tree of 12 layers (``--layer-mb`` MB of random float32 each) is saved by a two-tier
``CheckpointManager`` (local folder + remote store) at step 0, then at each later step with one
layer replaced. The remote is a second local folder, or moto's S3 server with ``--s3``. Measured
per incremental step (medians): the bytes the replication uploaded (``last_replication``), the
time the loop was blocked in ``save()``, and the time until the remote committed the step. Beside
it: copying each step whole into an empty remote (what a copy that does not deduplicate sends),
and saving each step straight to the remote (one tier, synchronous). Progress goes to stderr; one
markdown table goes to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

import treestore

LAYERS = 12
MB = 1e6


def log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def layer(seed: int, mb: float) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(int(mb * MB / 4)).astype(np.float32)


@contextlib.contextmanager
def remote_root(s3: bool, tmp: str) -> Iterator[tuple[str, dict[str, Any] | None]]:
    if not s3:
        yield f"{tmp}/remote", None
        return
    from tests.support.servers import moto_s3_server

    with moto_s3_server() as backend:
        yield backend.url("run"), backend.storage_options


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_two_tier")
    ap.add_argument("--steps", type=int, default=6, help="incremental steps after step 0")
    ap.add_argument("--layer-mb", type=float, default=4.0)
    ap.add_argument("--s3", action="store_true", help="remote on moto's S3 server")
    ap.add_argument("--tmp-root", default=None)
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="bench-two-tier-", dir=args.tmp_root)
    tree = {f"layer{i:02d}": layer(i, args.layer_mb) for i in range(LAYERS)}
    rows: list[tuple[str, float, float, float]] = []
    try:
        with remote_root(args.s3, tmp) as (remote, opts):
            uploaded, blocked, committed = [], [], []
            m = treestore.CheckpointManager(
                local=f"{tmp}/local",
                remote=treestore.RemoteTier(f"{remote}/tiered", storage_options=opts),
                retention=treestore.Retention(keep_last=2),
            )
            m.save(0, tree)
            m.wait()
            assert m.last_replication is not None
            full = m.last_replication.bytes_copied
            for step in range(1, args.steps + 1):
                tree = {**tree, f"layer{step % LAYERS:02d}": layer(100 + step, args.layer_mb)}
                t0 = time.perf_counter()
                m.save(step, tree)
                blocked.append(time.perf_counter() - t0)
                m.wait()
                committed.append(time.perf_counter() - t0)
                assert m.last_replication is not None and m.last_replicated == step
                uploaded.append(m.last_replication.bytes_copied)
                log(f"two-tier step {step}: {uploaded[-1] / MB:.1f} MB uploaded")
            m.close()
            rows.append(
                (
                    "two-tier (local + replication)",
                    statistics.median(uploaded),
                    statistics.median(blocked),
                    statistics.median(committed),
                )
            )

            local = f"{tmp}/local"
            copies, times = [], []
            for step in range(1, args.steps + 1):
                t0 = time.perf_counter()
                # the newest step (local retention kept it) into an empty remote: a whole copy
                r = treestore.copy(
                    f"{local}#step-{args.steps:09d}", f"{remote}/full-{step}", dst_storage_options=opts
                )
                times.append(time.perf_counter() - t0)
                copies.append(r.bytes_copied)
            rows.append(
                ("full copy of each step", statistics.median(copies), float("nan"), statistics.median(times))
            )

            direct, dtimes = [], []
            store = treestore.Store(f"{remote}/direct", storage_options=opts)
            tree = {f"layer{i:02d}": layer(i, args.layer_mb) for i in range(LAYERS)}
            store.save(tree, "step-0")
            for step in range(1, args.steps + 1):
                tree = {**tree, f"layer{step % LAYERS:02d}": layer(100 + step, args.layer_mb)}
                t0 = time.perf_counter()
                direct.append(store.save(tree, f"step-{step}").bytes_written)
                dtimes.append(time.perf_counter() - t0)
            rows.append(
                (
                    "one tier, save to remote",
                    statistics.median(direct),
                    statistics.median(dtimes),
                    statistics.median(dtimes),
                )
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    where = "moto S3" if args.s3 else "a second local folder"
    print(
        f"\n{LAYERS} layers x {args.layer_mb:g} MB, 1 layer changed per step, remote on {where}; "
        f"a full checkpoint uploads {full / MB:.1f} MB\n"
    )
    print("| method | uploaded per step | vs full | save() blocked | until remote commit |")
    print("|---|---|---|---|---|")
    for name, up, blk, done in rows:
        blk_s = "—" if blk != blk else f"{blk * 1e3:.0f} ms"
        print(f"| {name} | {up / MB:.1f} MB | {up / full:.1%} | {blk_s} | {done * 1e3:.0f} ms |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
