"""The link benchmark (``benchmarks.device_link``) runs on whatever backend jax has: on the CPU
with ``--quick``, one row per dtype with a rate for every route."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def test_the_quick_run_prints_a_rate_for_every_route_and_dtype() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "benchmarks.device_link", "--quick"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("| ")]
    header, rows = lines[0], lines[1:]
    assert "device_get" in header and "pinned_host" in header  # the CPU has the pinned kind
    assert "treestore fetch" in header
    assert [row.split("|")[1].strip() for row in rows] == ["bfloat16", "float32", "int8"]
    for row in rows:
        rates = [float(cell) for cell in row.split("|")[5:-1]]
        assert len(rates) == 4 and all(rate > 0 for rate in rates), row
    assert "fresh pages filled at" in run.stdout
