"""The multi-process commit benchmark (``benchmarks.bench_multihost``) times process 0's commit
where the save commits: a small job of each sharding runs and reports a commit time."""

from __future__ import annotations

import re

import pytest

from benchmarks import bench_multihost as B
from treestore._engine.group import distributed, stats_gather
from treestore._engine.saving import writing


def test_a_small_job_is_timed_from_its_first_barrier_to_its_commit(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for owner, name in ((distributed.Group, "barrier"), (writing, "commit"), (stats_gather, "combine")):
        monkeypatch.setattr(owner, name, getattr(owner, name))  # restored after the clock's patches
    argv = ["--runs", "1", "--leaves", "4", "--processes", "2", "--stages", "2", "--stats", "on"]
    assert B.main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| local")]
    assert len(rows) == 2, rows  # one stage and two
    for row in rows:
        commit_ms = float(row.split("|")[6])
        assert commit_ms > 0, row
        assert re.search(r"\| on \|", row)
