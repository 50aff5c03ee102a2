"""The accelerator benchmark (``benchmarks.bench_device``) runs on whatever backend jax has: on
the CPU with ``--quick`` (as here), and every load it times is checked to give back, bit for
bit, what its save wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import bench_device as B

ROOT = Path(__file__).resolve().parent.parent.parent


def test_a_load_that_differs_from_its_save_stops_the_benchmark() -> None:
    saved = {"a": {"w": jnp.arange(6.0).reshape(2, 3)}, "n": jnp.asarray(3)}
    B.check_same("treestore", {"a": {"w": jnp.arange(6.0).reshape(2, 3)}, "n": jnp.asarray(3)}, saved)
    B.check_same(
        "safetensors", {"a.w": np.arange(6.0, dtype=np.float32).reshape(2, 3), "n": np.int32(3)}, saved
    )
    with pytest.raises(SystemExit, match="treestore: a load did not give back"):
        B.check_same("treestore", {"a": {"w": jnp.arange(6.0).reshape(2, 3)}, "n": jnp.asarray(4)}, saved)
    with pytest.raises(SystemExit, match="orbax: a load did not give back"):  # -0.0 is not 0.0
        B.check_same(
            "orbax",
            {"a": {"w": jnp.arange(6.0).reshape(2, 3) * -1 * 0}, "n": jnp.asarray(3)},
            {"a": {"w": jnp.zeros((2, 3))}, "n": jnp.asarray(3)},
        )
    with pytest.raises(SystemExit, match="safetensors: the load's keys differ"):
        B.check_same(
            "safetensors", {"a.v": np.arange(6.0, dtype=np.float32).reshape(2, 3), "n": np.int32(3)}, saved
        )


def test_the_quick_run_prints_every_row_for_both_trees() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "benchmarks.bench_device", "--quick", "--rounds", "1", "--no-memory"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    for tree in ("decoder", "gpt2"):
        assert f"**{tree}**" in run.stdout
    rows = [line.split("|")[1].strip() for line in run.stdout.splitlines() if line.startswith("| ")]
    for method in ("treestore", "treestore stats=False", "orbax", "safetensors"):
        assert rows.count(method) == 2, rows
    assert run.stdout.count("Async save, time the loop is blocked") == 2
