"""Start-up: what a user waits for before treestore does anything, on a fresh install.

    python -m benchmarks.bench_startup [--runs 7] [--fresh]

With ``--fresh`` a new virtualenv gets ``pip install .`` from the package index (the newest
version of every dependency the project allows, as a new user gets them) and everything runs in
it; otherwise in this interpreter. Each figure is the median wall time of ``runs`` fresh
interpreters, run round-robin so noise spreads evenly:

* ``import X`` for treestore, for its peers where installed (safetensors, orbax-checkpoint, flax
  serialization) and for each of treestore's dependencies alone: the floor under treestore's own
  modules, and where a dependency's import cost comes from;
* the commands a user types first, ``treestore ls``, ``show`` and ``diff``, on a small store of two
  checkpoints, beside ``python -c pass`` (the interpreter's own start).

One table goes to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

IMPORTS = [
    ("treestore", "import treestore"),
    ("safetensors (peer)", "import safetensors.numpy"),
    ("orbax-checkpoint (peer)", "import orbax.checkpoint"),
    ("flax serialization (peer)", "import flax.serialization"),
    ("numpy", "import numpy"),
    ("fsspec", "import fsspec"),
    ("zstandard", "import zstandard"),
    ("msgpack", "import msgpack"),
    ("blake3", "import blake3"),
    ("click (CLI only)", "import click"),
    ("numpy + fsspec + zstandard + msgpack + blake3", "import numpy, fsspec, zstandard, msgpack, blake3"),
    ("ml_dtypes (extended dtypes only)", "import ml_dtypes"),
    ("jax (jax leaves only)", "import jax"),
]

STORE = """
import numpy as np, sys, treestore
url = sys.argv[1]
for step in (1, 2):
    tree = {"params": {"w": np.full((64, 64), step, np.float32), "b": np.zeros(64)}, "step": step}
    treestore.save(url, tree, f"step-{step}", metadata={"step": step})
"""


def log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


def fresh_venv(folder: Path) -> str:
    """A new virtualenv with treestore installed from this checkout: its python."""
    log(f"creating a virtualenv in {folder} and installing treestore with the newest dependencies ...")
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
    python = str(folder / "bin" / "python")
    for what in (["--upgrade", "pip"], [str(ROOT)]):
        pip = [python, "-m", "pip", "install", "--quiet", *what]
        subprocess.run(pip, check=True, stdout=subprocess.DEVNULL)
    return python


def available(python: str, code: str) -> bool:
    return subprocess.run([python, "-c", code], capture_output=True, cwd="/").returncode == 0


def versions(python: str) -> str:
    code = (
        "import importlib.metadata as m\n"
        "for p in ('treestore','numpy','fsspec','zstandard','msgpack','blake3','ml_dtypes','jax'):\n"
        "    try: print(p, m.version(p))\n"
        "    except m.PackageNotFoundError: pass\n"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout
    return ", ".join(line.replace(" ", "=") for line in out.splitlines())


def timed(argv: list[str]) -> float:
    """Wall seconds of one run; NaN when it fails (diff exits 1 for "different": not a failure)."""
    start = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")
    seconds = time.perf_counter() - start
    return seconds if done.returncode in (0, 1) else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_startup")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--fresh", action="store_true", help="run in a new virtualenv (pip install .)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="treestore-startup-") as tmp:
        python = fresh_venv(Path(tmp) / "venv") if args.fresh else sys.executable
        cli = [python, "-m", "treestore"]
        store = str(Path(tmp) / "store")
        subprocess.run([python, "-c", STORE, store], check=True)
        rows: list[tuple[str, list[str]]] = [("python -c pass", [python, "-c", "pass"])]
        for label, code in IMPORTS:
            if available(python, code):
                rows.append((f"import: {label}", [python, "-c", code]))
            else:
                log(f"skipped (not installed): {label}")
        rows += [
            ("treestore ls (2 checkpoints)", [*cli, "ls", store]),
            ("treestore show", [*cli, "show", f"{store}#step-1"]),
            ("treestore diff", [*cli, "diff", f"{store}#step-1", f"{store}#step-2"]),
        ]
        for _, command in rows:  # warm the page cache and the bytecode caches
            subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")
        times: dict[str, list[float]] = {label: [] for label, _ in rows}
        for run in range(args.runs):
            log(f"run {run + 1}/{args.runs}")
            for label, command in rows:
                times[label].append(timed(command))
        floor = statistics.median(times["python -c pass"])
        where = "a fresh virtualenv" if args.fresh else "this environment"
        print(f"\nStart-up, medians of {args.runs} fresh interpreters, in {where}")
        print(f"versions: {versions(python)}\n")
        print("| what | wall (s) | minus interpreter start (s) |")
        print("|---|---:|---:|")
        for label, _ in rows:
            t = statistics.median(times[label])
            print(f"| {label} | {t:.3f} | {t - floor:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
