"""Checkpoint managers in a training loop: treestore (sync, async) vs orbax's CheckpointManager (async).

    python -m benchmarks.bench_manager [--saves 8] [--tmp-root DIR]

The loop holds the GPT-2-small-shaped tree (``trees.gpt2_small()``, ~498 MB fp32) as jax arrays.
Step 0 saves it whole; each later step replaces one of the 12 blocks (``h.N``) with new arrays
(the others stay the same array objects, as a frozen part of a model does) and saves again.
Every save is followed by waiting for it to finish and ``os.sync()``, inside the timed region.

Measured per incremental save (medians): bytes written (treestore: ``SaveResult.bytes_written``;
orbax: growth of its directory), the save's wall time (call to durable), and the time the loop
is blocked inside ``save()``. A fourth row repeats the async loop with *every* leaf a new array
each step (as a jitted update returns), so nothing can be recognised as unchanged before hashing.

Targets (issue 5), for treestore async: bytes ≤ 10% of a full save, save wall time ≤ 0.2× a full
save, blocked time ≤ 0.15× a synchronous save (treestore sync's median incremental save).
Progress goes to stderr; one markdown table goes to stdout.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import treestore

from . import peers
from . import trees as T

BLOCKS = T.GPT2_LAYERS


@dataclass(frozen=True)
class Sample:
    bytes_written: int
    wall: float  # from the call to save() to durable on disk
    blocked: float  # inside save()


def _log(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


def _jax_tree() -> dict[str, Any]:
    tree = T.gpt2_small()
    out = T.map_leaves(jnp.asarray, tree)
    jax.block_until_ready(out)
    return out


def _change_block(tree: dict[str, Any], step: int, everything: bool) -> dict[str, Any]:
    """The next step's tree: block ``step % 12`` gets new values; with ``everything`` every other
    leaf also becomes a new array with the same values."""
    block = str(step % BLOCKS)
    delta = np.float32(1e-3)
    new = T.map_leaves(lambda a: jnp.array(a, copy=True) if everything else a, tree)
    new["h"] = dict(new["h"])
    new["h"][block] = T.map_leaves(lambda a: a + delta, tree["h"][block])
    jax.block_until_ready(new)
    return new


def _loop(
    tree: dict[str, Any],
    saves: int,
    save: Callable[[int, Any], None],
    finish: Callable[[], None],
    written: Callable[[], int],
    everything: bool = False,
) -> list[Sample]:
    samples = []
    for step in range(saves + 1):
        if step:
            tree = _change_block(tree, step, everything)
        t0 = time.perf_counter()
        save(step, tree)
        t1 = time.perf_counter()
        finish()
        os.sync()
        t2 = time.perf_counter()
        samples.append(Sample(written(), t2 - t0, t1 - t0))
        _log(f"  step {step}: {samples[-1]}")
    return samples


def run_treestore(
    root: str, tree: Any, saves: int, async_save: bool, everything: bool = False
) -> list[Sample]:
    m = treestore.CheckpointManager(root, async_save=async_save)

    def written() -> int:
        assert m.last_result is not None
        return m.last_result.bytes_written

    try:
        return _loop(tree, saves, lambda s, t: m.save(s, t), m.wait, written, everything)
    finally:
        m.close()


def run_orbax(root: str, tree: Any, saves: int) -> list[Sample]:
    import orbax.checkpoint as ocp

    logging.getLogger("absl").setLevel(logging.ERROR)
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
    m = ocp.CheckpointManager(root, options=options)
    size = [0]

    def written() -> int:
        before, size[0] = size[0], peers.files_and_bytes(root)[1]
        return size[0] - before

    try:
        return _loop(
            tree, saves, lambda s, t: m.save(s, args=ocp.args.StandardSave(t)), m.wait_until_finished, written
        )
    finally:
        m.close()


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def _s(t: float) -> str:
    return f"{t * 1000:,.0f} ms" if t < 1 else f"{t:,.2f} s"


def table(results: dict[str, list[Sample]]) -> str:
    sync_save = statistics.median(s.blocked for s in results["treestore sync"][1:])
    rows = [
        "| run | full save (step 0) | bytes / incremental save | ÷ full | save wall time | ÷ full "
        "| blocked in save() | ÷ sync save |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ratios = {}
    for name, samples in results.items():
        full, inc = samples[0], samples[1:]
        b = statistics.median(s.bytes_written for s in inc)
        w = statistics.median(s.wall for s in inc)
        k = statistics.median(s.blocked for s in inc)
        ratios[name] = (b / full.bytes_written, w / full.wall, k / sync_save)
        rb, rw, rk = ratios[name]
        rows.append(
            f"| {name} | {_mb(full.bytes_written)}, {_s(full.wall)} | {_mb(b)} | {rb:.1%} | {_s(w)} "
            f"| {rw:.2f}× | {_s(k)} | {rk:.2f}× |"
        )
    rb, rw, rk = ratios["treestore async"]

    def mark(ok: bool) -> str:
        return "met" if ok else "NOT met"

    rows.append("")
    rows.append(
        f"Targets (treestore async): bytes ≤ 10% of a full save: {rb:.1%}, {mark(rb <= 0.10)}; "
        f"save time ≤ 0.2× a full save: {rw:.2f}×, {mark(rw <= 0.2)}; "
        f"blocked ≤ 0.15× a synchronous save ({_s(sync_save)}): {rk:.2f}×, {mark(rk <= 0.15)}."
    )
    n = len(next(iter(results.values()))) - 1
    rows.append(
        f"GPT-2-small-shaped tree, 498 MB fp32 as jax arrays on CPU, one of 12 blocks changes per step; "
        f"medians of {n} incremental saves; each save waited for and os.sync()'d; "
        f"÷ sync save: against treestore sync's median time in save(); {os.cpu_count()} CPUs."
    )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_manager", description=__doc__)
    ap.add_argument("--saves", type=int, default=8, help="incremental saves per run (default 8)")
    ap.add_argument("--tmp-root", default=os.environ.get("TREESTORE_BENCH_TMP"), help="local-disk folder")
    ap.add_argument("--no-orbax", action="store_true", help="skip the orbax row")
    args = ap.parse_args(argv)
    _log("building the GPT-2-shaped tree ...")
    tree = _jax_tree()
    runs: list[tuple[str, Callable[[str], list[Sample]]]] = [
        ("treestore sync", lambda d: run_treestore(d, tree, args.saves, async_save=False)),
        ("treestore async", lambda d: run_treestore(d, tree, args.saves, async_save=True)),
        (
            "treestore async, all leaves new arrays",
            lambda d: run_treestore(d, tree, args.saves, async_save=True, everything=True),
        ),
    ]
    if not args.no_orbax:
        runs.append(("orbax CheckpointManager (async)", lambda d: run_orbax(d, tree, args.saves)))
    results = {}
    for name, run in runs:
        work = tempfile.mkdtemp(prefix="bench-manager-", dir=args.tmp_root)
        _log(f"{name} in {work}")
        try:
            results[name] = run(os.path.join(work, "ckpt"))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
