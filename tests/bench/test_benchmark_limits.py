"""The LIMIT row of the benchmarks times the bytes a save really stores (benchmarks/limits.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import treestore
from benchmarks import limits


def test_the_limit_writes_and_reads_as_many_bytes_as_a_save_stores(tmp_path: Path) -> None:
    """Planes too random to compress are stored whole; the write and read components must move
    them too (they once moved one byte per such plane, a quarter of the bytes of random fp32)."""
    rng = np.random.default_rng(0)
    leaves = [
        rng.standard_normal(3 << 20).astype(np.float32),  # 12 MiB: three 4 MiB chunks
        rng.integers(0, 2**31, 1 << 19, dtype=np.int64),  # 4 MiB, not split into planes
    ]
    stored = sum(len(b) for b in limits.stored_bytes(limits.encode(leaves, {})))
    treestore.save(tmp_path / "s", {"a": leaves[0], "b": leaves[1]}, "c")
    on_disk = sum(p.stat().st_size for p in (tmp_path / "s" / "chunks").rglob("*") if p.is_file())
    assert 0.99 * on_disk <= stored <= on_disk, (stored, on_disk)
