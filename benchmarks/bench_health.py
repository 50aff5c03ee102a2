"""A run's health from manifests alone, beside what a safetensors user has to do for it.

    python -m benchmarks.bench_health [--steps 300] [--runs 5] [--store DIR]

Two questions over a run of hundreds of checkpoints: which checkpoints and leaves first held
NaN/inf (``treestore health URL``), and each leaf's L2 norm at each checkpoint (``treestore
timeline --norms URL``). Both are timed as a user runs them: the command in a new process,
wall time, medians of ``--runs``; the answer is checked each time.

The run: a GPT-2-small-shaped training state (the parameters and Adam's ``mu`` and ``nu``: 445
leaves, 1.4 GB of float32) saved once, then ``--steps`` checkpoints derived from it
(``Store.derive``), each with new values in one block's layer norm, and from two thirds of the
way on a NaN in that leaf. Every checkpoint's manifest is whole (each leaf's chunks and
statistics), so reading it costs what a real run's does; the store holds unchanged chunks once,
so the run fits on one disk.

safetensors records nothing of the kind: its user reads every tensor of every checkpoint
(``load_file``) and checks it (``np.isfinite``; ``np.linalg.norm``). That is timed on the same
state, saved as one ``.safetensors`` file, read ``--runs`` times from the page cache (a lower
bound: a real run's files would not all be cached), and multiplied by the run's length: the
"run" figure of that column is per checkpoint × steps, not a measured run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from . import trees

BAD_LEAF = 'params/h/"3"/ln_1/g'  # the address of key "3" of a dict (SPEC section 7)


def training_state() -> dict[str, Any]:
    params = trees.gpt2_small()
    return {
        "params": params,
        "opt_state": {
            "mu": trees.map_leaves(lambda p: p * np.float32(0.1), params),
            "nu": trees.map_leaves(lambda p: p * p, params),
        },
        "step": np.int64(0),
    }


def make_run(url: str, state: dict[str, Any], steps: int) -> str:
    """Save ``state`` as step 0 and derive ``steps`` more; return the first step holding NaN."""
    import treestore

    store = treestore.Store(url)
    store.save(state, "step_00000")
    g = trees.get_leaf(state, trees.SEP.join(["params", "h", "3", "ln_1", "g"]))
    bad_from = steps * 2 // 3
    for i in range(1, steps + 1):
        value = g + np.float32(i * 1e-3)
        if i >= bad_from:
            value[7] = np.nan
        store.derive(f"step_{i - 1:05d}", f"step_{i:05d}", set={BAD_LEAF: value, "step": np.int64(i)})
    return f"step_{bad_from:05d}"


def _command(args: list[str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    """Run ``treestore ARGS`` in a new process, as an installed command runs: with its modules'
    bytecode cached (a first call writes it where PYTHONDONTWRITEBYTECODE would forbid it)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "treestore", *args], capture_output=True, text=True, env=env)
    return time.perf_counter() - start, done


def time_health(url: str, first_bad: str, runs: int) -> float:
    """``treestore health URL`` as a user reads it (its table), after one ``--json`` call whose
    answer is checked: the NaN leaf, first in ``first_bad``."""
    _, done = _command(["health", url, "--json"])
    answer = json.loads(done.stdout)["first_nonfinite"]
    if done.returncode != 1 or answer != {BAD_LEAF: first_bad}:
        raise SystemExit(f"health answered wrong: exit {done.returncode}, {answer}")
    times = []
    for _ in range(runs):
        took, done = _command(["health", url])
        if done.returncode != 1 or first_bad not in done.stdout:
            raise SystemExit(f"health failed: exit {done.returncode}, {done.stderr}")
        times.append(took)
    return statistics.median(times)


def time_norms(url: str, steps: int, leaves: int, runs: int) -> float:
    """``treestore timeline --norms URL`` as a user reads it (its heatmap), after one ``--json``
    call whose answer is checked: every checkpoint, every array leaf."""
    _, done = _command(["timeline", "--norms", url, "--json"])
    answer = json.loads(done.stdout)
    if done.returncode != 0 or (len(answer["checkpoints"]), len(answer["rows"])) != (steps + 1, leaves):
        raise SystemExit(f"timeline --norms answered wrong: exit {done.returncode}, {done.stderr}")
    times = []
    for _ in range(runs):
        took, done = _command(["timeline", "--norms", url])
        if done.returncode != 0 or len(done.stdout.splitlines()) != 1 + leaves:
            raise SystemExit(f"timeline --norms failed: exit {done.returncode}, {done.stderr}")
        times.append(took)
    return statistics.median(times)


def time_safetensors(state: dict[str, Any], folder: Path, runs: int) -> tuple[float, float]:
    """Per checkpoint: (read every tensor and check it is finite, read every tensor and take its
    norm), medians of ``runs`` reads of one file from the page cache."""
    from safetensors.numpy import load_file, save_file

    path = folder / "state.safetensors"
    save_file({"/".join(p): np.asarray(x) for p, x in trees.iter_leaves(state)}, str(path))
    load_file(str(path))  # into the page cache

    def finite() -> bool:
        return all(bool(np.isfinite(t).all()) for t in load_file(str(path)).values())

    def norms() -> list[float]:
        return [float(np.linalg.norm(t)) for t in load_file(str(path)).values()]

    out = []
    for fn in (finite, norms):
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        out.append(statistics.median(times))
    return out[0], out[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--store", default=None, help="folder for the run (default: a temporary one)")
    args = parser.parse_args(argv)
    root = Path(args.store or tempfile.mkdtemp(prefix="bench-health-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        state = training_state()
        leaves, mb = trees.num_leaves(state), trees.nbytes(state) / 1e6
        print(f"making a run of {args.steps + 1} checkpoints of {leaves} leaves ...", file=sys.stderr)
        url = str(root / "run")
        first_bad = make_run(url, state, args.steps)
        health = time_health(url, first_bad, args.runs)
        norms = time_norms(url, args.steps, leaves, args.runs)
        st_finite, st_norms = time_safetensors(state, root, args.runs)
    finally:
        if not args.store:
            shutil.rmtree(root, ignore_errors=True)
    n = args.steps + 1
    print(f"A run of {n} checkpoints, {leaves} leaves ({mb:.0f} MB) each; medians of {args.runs}.\n")
    print("| question | treestore (manifests) | safetensors (read every tensor) | ratio |")
    print("|---|---:|---:|---:|")
    for what, ours, theirs in (
        ("first NaN/inf of each leaf: whole run", health, st_finite * n),
        ("first NaN/inf: per checkpoint", health / n, st_finite),
        ("every leaf's norm at every step: whole run", norms, st_norms * n),
        ("norms: per checkpoint", norms / n, st_norms),
    ):
        print(f"| {what} | {_fmt(ours)} | {_fmt(theirs)} | {theirs / ours:,.0f}× |")
    print(
        "\ntreestore: `treestore health URL` / `treestore timeline --norms URL` in a new process,"
        " wall, with their modules' bytecode cached, answers checked. safetensors: per checkpoint"
        " measured (`load_file` of one cached file, then `np.isfinite` / `np.linalg.norm` of each"
        f" tensor); its run = that × {n}."
    )


def _fmt(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 0.1 else f"{seconds:.2f} s"


if __name__ == "__main__":
    main()
