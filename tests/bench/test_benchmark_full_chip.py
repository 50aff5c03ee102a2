"""The full-chip benchmark (``benchmarks.bench_full_chip``) runs on whatever backend jax has: on the
CPU with ``--quick`` (a nominal 256 MiB device), here its ``full`` case, whose treestore row must
read every leaf back bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def test_the_quick_full_case_saves_both_ways_and_treestore_reads_back_exactly() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "benchmarks.bench_full_chip", "--quick", "--cases", "full"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {line.split("|")[1].strip(): line for line in run.stdout.splitlines() if line.startswith("| ")}
    treestore_row = [cell.strip() for cell in rows["treestore"].split("|")[1:-1]]
    assert treestore_row[2] == "True" and treestore_row[5] == "True", rows["treestore"]
    assert "failed" not in rows["orbax"], rows["orbax"]
