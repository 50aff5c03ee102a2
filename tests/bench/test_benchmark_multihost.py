"""The multi-process commit benchmark (``benchmarks.bench_multihost``) times process 0's commit
where the save commits: a small job of each sharding runs and reports a commit time."""

from __future__ import annotations

import json
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


def test_the_restore_table_reads_each_process_s_results() -> None:
    """The rows of the restores table (``--restores``) from the workers' RESULT lines: bytes over
    the checkpoint's (the server's count from S3, the processes' rchar summed from local files),
    the slowest process's times, process 0's share of time in the collective and votes, and the
    time its first shared restore spent compiling."""
    from benchmarks import multihost_restore as R

    lines = ["ORBAX_BYTES 300"]
    for run in range(3):
        for process in range(2):
            common = {"run": run, "process": process, "seconds": 1.0 + process, "votes": 0.25}
            common["compile"] = 0.4 if run == 0 else 0.0
            s3 = {"method": "treestore-s3-shared", "rchar": 0, "collective": 0.5, **common}
            if process == 0:
                s3["served"] = 100
            lines.append("RESULT " + json.dumps(s3))
            local = {"method": "orbax-local", "rchar": 150, "collective": 0.0, **common}
            lines.append("RESULT " + json.dumps(local))
    rows = {row[1]: row for row in R.rows_of(2, "\n".join(lines), {"s3": 100, "local": 100})}
    assert rows["treestore-s3-shared"][2:6] == (1.0, 2.0, 2.0, (0.75, 0.5, 0.4))
    assert rows["orbax-local"][2] == 1.0  # 2 x 150 bytes of a 300-byte orbax checkpoint
    assert rows["treestore-local-each"][2] is None  # not run: a row that says so
