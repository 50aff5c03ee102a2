"""What a save of many small leaves does per leaf, counted (issue 47: at 100k leaves each step
of a microsecond per leaf shows in the save's time; a count catches its return, a timing would
not in CI)."""

from __future__ import annotations

from typing import Any

import jax  # as a JAX user's process has: without jax, a save never looks it up
import numpy as np
import pytest

import treestore
from treestore._tree import jax_import


@pytest.fixture
def jax_lookups(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every attribute looked up on treestore's lazy jax stand-in: each is a Python call."""
    looked: list[str] = []
    real = jax_import._Deferred.__getattr__

    def counted(self: Any, name: str) -> Any:
        looked.append(name)
        return real(self, name)

    monkeypatch.setattr(jax_import._Deferred, "__getattr__", counted)
    return looked


def small_leaves(n: int) -> dict[str, Any]:
    """``n`` float32[4] leaves in dicts of 100."""
    return {
        f"g{g}": {f"w{j}": np.full(4, g * 100 + j, np.float32) for j in range(100)} for g in range(n // 100)
    }


def test_a_save_looks_jax_up_per_call_not_per_leaf(tmp_path, jax_lookups) -> None:
    """A save of 2,000 numpy leaves looked ``jax.Array`` up 2,000 times through the stand-in
    (70 ms of a 100k-leaf save) before; now a handful of times, whatever the leaf count."""
    store = treestore.Store(str(tmp_path / "s"))
    store.save(small_leaves(100), "warm")  # whatever a first save looks up once per process
    jax_lookups.clear()
    store.save(small_leaves(2000), "a")
    assert len(jax_lookups) < 20, sorted(set(jax_lookups))
    assert np.array_equal(store.load("a")["g19"]["w99"], np.full(4, 1999, np.float32))


def test_an_async_snapshot_looks_jax_up_per_call_not_per_leaf(tmp_path, jax_lookups) -> None:
    with treestore.CheckpointManager(str(tmp_path / "m")) as manager:
        manager.save(0, small_leaves(100))
        manager.wait()
        jax_lookups.clear()
        manager.save(1, small_leaves(2000))
        manager.wait()
        assert len(jax_lookups) < 20, sorted(set(jax_lookups))
        assert manager.latest_step() == 1


def test_a_load_with_a_template_looks_jax_up_per_call_not_per_leaf(tmp_path, jax_lookups) -> None:
    """Each numpy leaf of a template was asked whether it is a PRNG key through jax (four
    lookups a leaf; 0.3 s of a 100k-leaf load with ``like=``): a numpy array never is one."""
    tree = small_leaves(2000)
    store = treestore.Store(str(tmp_path / "s"))
    store.save(tree, "a")
    store.load("a", like=tree)  # whatever a first load looks up once per process
    jax_lookups.clear()
    back = store.load("a", like=tree)
    assert len(jax_lookups) < 20, sorted(set(jax_lookups))
    assert np.array_equal(back["g7"]["w3"], tree["g7"]["w3"])


def test_a_load_with_a_template_asks_each_template_leaf_once(tmp_path, monkeypatch) -> None:
    """A ``like=`` load asked each template leaf what it expects twice (to match it, then to
    restore it) and the columns for each stored leaf's fields one leaf at a time: at 100k leaves
    about 200 ms. Now once per leaf, and the stored leaves' fields in one pass."""
    from treestore._tree import template

    asked: list[Any] = []
    passes: list[int] = []
    expected, stored_rows = template._expected, template.stored_rows
    monkeypatch.setattr(template, "_expected", lambda like: asked.append(like) or expected(like))
    monkeypatch.setattr(
        template, "stored_rows", lambda columns, rows: passes.append(len(rows)) or stored_rows(columns, rows)
    )
    store = treestore.Store(str(tmp_path / "s"))
    tree = small_leaves(2000) | {"step": 3, "key": jax.random.key(0)}
    store.save(tree, "a")
    back = store.load("a", like=tree)
    assert len(asked) == 2002 and passes == [2002]
    assert back["step"] == 3 and np.array_equal(back["g19"]["w99"], np.full(4, 1999, np.float32))
    assert jax.random.key_data(back["key"]).tolist() == jax.random.key_data(tree["key"]).tolist()
