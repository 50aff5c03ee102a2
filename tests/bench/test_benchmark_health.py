"""The health benchmark (``benchmarks.bench_health``) times commands that answer what it asks:
its run holds a NaN from two thirds of the way on, and each timed command is checked."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks import bench_health as H


def test_the_run_holds_its_nan_where_it_says_and_the_commands_find_it(tmp_path: Path) -> None:
    state = {
        "params": {"h": {"3": {"ln_1": {"g": np.ones(8, np.float32)}}}},
        "w": np.zeros(4),
        "step": np.int64(0),
    }
    url = str(tmp_path / "run")
    first_bad = H.make_run(url, state, 6)
    assert first_bad == "step_00004"
    assert H.time_health(url, first_bad, 1) > 0
    assert H.time_norms(url, 6, 3, 1) > 0
    with pytest.raises(SystemExit, match="health answered wrong"):
        H.time_health(url, "step_00005", 1)
