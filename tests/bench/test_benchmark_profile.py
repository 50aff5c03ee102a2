"""The save and load profile (``benchmarks.bench_profile``) counts every step it names: a step
treestore stops calling by that name would show as no time, which the profile cannot tell apart
from a free step."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import treestore
from benchmarks import bench_profile as P


def test_every_step_of_a_save_and_a_load_is_counted_and_unwrapped_after(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    tree = {"w": rng.standard_normal((512, 1024)).astype(np.float32), "b": np.ones(7, np.float32)}
    options = treestore.SaveOptions(stats=True, chunk_size=256 * 1024)
    real = [getattr(module, name) for module, name, _ in P.SAVE_STEPS + P.LOAD_STEPS]
    store = str(tmp_path / "s")
    saves = iter(range(10))
    # An object store copies each leaf's bytes before hashing them (a local disk does not).
    memory = "memory://bench-profile"
    save = P._profile(
        lambda: treestore.save(memory, tree, f"c{next(saves)}", options=options), P.SAVE_STEPS, 2
    )
    treestore.save(store, tree, "c", options=options)
    load = P._profile(lambda: treestore.load(store + "#c"), P.LOAD_STEPS, 2)
    for step in ("copy", "stats", "hash", "encode"):
        assert save[step] > 0, step
    for step in ("read", "decode", "verify"):
        assert load[step] > 0, step
    for result in (save, load):
        assert result["wall"] > 0 and result["user"] + result["kernel"] > 0
    assert [getattr(module, name) for module, name, _ in P.SAVE_STEPS + P.LOAD_STEPS] == real
