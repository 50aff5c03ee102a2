"""Health-aware retention: a run whose newest steps hold NaN/inf keeps its last healthy step, in
both tiers; ``latest_step(healthy=True)`` and ``restore(healthy=True)`` find it from manifests."""

from __future__ import annotations

import json

import numpy as np
import pytest

import treestore
from tests.engine.test_stats import run_cli
from tests.support import hostile
from treestore._api.manager.retention import Policy, apply_retention
from treestore._format.paths import step_name

LAST_1, LAST_2 = treestore.Retention(keep_last=1), treestore.Retention(keep_last=2)
NAN = {"w": np.array([np.nan, 1.0, 2.0])}
# Every way a step's health becomes unknown: the SaveOptions it is saved with, and what is done
# to its checkpoint after (given the store's URL and the checkpoint's name).
UNKNOWN = {
    "saved-without-statistics": (treestore.SaveOptions(stats=False), lambda url, name: None),
    "statistics-column-unreadable": (None, hostile.damage_stats),
    "manifest-unreadable": (None, hostile.damage_manifest),
}


def finite(tree) -> bool:
    import jax

    return all(bool(np.all(np.isfinite(np.asarray(x)))) for x in jax.tree_util.tree_leaves(tree))


@pytest.mark.timeout(300)
def test_a_diverging_training_loop_keeps_its_last_good_step(tmp_path):
    """A small jax MLP trained with a learning rate that makes it diverge on purpose: keep_last=2
    would delete every finite step; the manager keeps the newest healthy one, finds it without
    reading data, restores it, and the CLI names the first step that held NaN/inf."""
    import jax
    import jax.numpy as jnp

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k1, (64, 8))
    y = jnp.sin(x.sum(axis=1, keepdims=True))
    params = {
        "l1": {"w": jax.random.normal(k2, (8, 16)) * 0.3, "b": jnp.zeros(16)},
        "l2": {"w": jax.random.normal(k3, (16, 1)) * 0.3, "b": jnp.zeros(1)},
    }

    def loss_fn(p):
        h = jax.nn.relu(x @ p["l1"]["w"] + p["l1"]["b"])
        return jnp.mean((h @ p["l2"]["w"] + p["l2"]["b"] - y) ** 2)

    @jax.jit
    def step_fn(p, lr):
        loss, grads = jax.value_and_grad(loss_fn)(p)
        return jax.tree_util.tree_map(lambda a, g: a - lr * g, p, grads), loss

    url = str(tmp_path / "run")
    saved: dict[int, dict] = {}
    first_bad = None
    with treestore.CheckpointManager(url, retention=LAST_2, async_save=False) as m:
        for step in range(200):
            lr = 0.01 if step < 5 else 50.0  # then diverge on purpose
            params, loss = step_fn(params, lr)
            m.save(step, {"params": params}, metrics={"loss": float(loss)})
            saved[step] = jax.tree_util.tree_map(np.asarray, params)
            if first_bad is None and not finite(params):
                first_bad = step
            if first_bad is not None and step >= first_bad + 4:
                break
        assert first_bad is not None and first_bad > 5, "the run did not diverge"
        last_good = first_bad - 1
        # keep_last=2 keeps the two newest (unhealthy) steps, and the last good one stays.
        assert m.steps() == [last_good, step - 1, step]
        assert m.latest_step() == step and m.latest_step(healthy=True) == last_good
        restored = m.restore(healthy=True)
        want = jax.tree_util.tree_leaves(saved[last_good])
        for a, b in zip(jax.tree_util.tree_leaves(restored), want, strict=True):
            assert np.array_equal(np.asarray(a), b)
    found = json.loads(run_cli("health", "--json", url).output)  # the steps retention kept
    assert [c["healthy"] for c in found["checkpoints"]] == [True, False, False]
    assert min(found["first_nonfinite"].values()) == f"step-{step - 1:09d}"


def test_without_keep_healthy_the_last_good_step_goes(tmp_path):
    url = str(tmp_path / "run")
    with treestore.CheckpointManager(url, retention=LAST_1, async_save=False, keep_healthy=False) as m:
        m.save(0, {"w": np.ones(3)})
        m.save(1, {"w": np.array([np.nan])})
        assert m.steps() == [1] and m.latest_step(healthy=True) is None
        with pytest.raises(treestore.errors.CheckpointNotFoundError, match="no healthy step"):
            m.restore(healthy=True)


def test_a_callers_check_and_unknown_statistics(tmp_path):
    """The caller's check over the statistics (a norm that exploded) marks a step unhealthy; a
    step saved without statistics is unknown: never taken for healthy, never deleted for it."""
    url = str(tmp_path / "run")

    def small_norm(info, stats):
        return stats["w"].l2 < 100

    with treestore.CheckpointManager(url, retention=LAST_1, async_save=False, healthy=small_norm) as m:
        m.save(0, {"w": np.ones(3)})
        m.save(1, {"w": np.full(3, 1e6)})  # finite, but the caller's check fails it
        assert m.steps() == [0, 1] and m.latest_step(healthy=True) == 0
        m.save(2, {"w": np.ones(3)})  # healthy again: step 0 and 1 go
        assert m.steps() == [2]
    off = treestore.SaveOptions(stats=False)
    with treestore.CheckpointManager(
        str(tmp_path / "off"), retention=LAST_1, async_save=False, options=off
    ) as m:
        m.save(0, {"w": np.array([np.nan])})
        assert m.latest_step(healthy=True) is None and m.steps() == [0]  # unknown, and kept
        with pytest.raises(treestore.errors.CheckpointNotFoundError, match="none is known to hold no NaN"):
            m.restore(healthy=True)


def test_a_complex_leaf_holding_nan_is_never_healthy(tmp_path):
    """A complex leaf is measured by its real and imaginary parts: a NaN in either makes the step
    unhealthy (library, retention and the health command alike), and retention keeps the step
    before it (it was reported healthy: complex leaves had no statistics)."""
    url = str(tmp_path / "run")
    with treestore.CheckpointManager(url, retention=LAST_1, async_save=False) as m:
        m.save(0, {"w": np.ones(3, np.float32), "z": np.ones(2, np.complex64)})
        m.save(1, {"w": np.ones(3, np.float32), "z": np.array([complex(1, np.nan), 1], np.complex64)})
        assert treestore.open(f"{url}#step-000000000").healthy is True
        ckpt = treestore.open(f"{url}#step-000000001")
        assert ckpt.healthy is False and ckpt.nonfinite() == ["z"]
        assert m.steps() == [0, 1] and m.latest_step(healthy=True) == 0
    found = json.loads(run_cli("health", "--json", url).output)
    assert [c["healthy"] for c in found["checkpoints"]] == [True, False]


def test_an_unknown_newer_step_does_not_take_the_healthy_steps_protection(tmp_path):
    """Steps 1-2 finite, 3-4 NaN, keep_last=2; step 5 saved without statistics: step 2, the
    newest known healthy, is kept, and latest_step(healthy=True) names it."""
    url = str(tmp_path / "run")
    with treestore.CheckpointManager(url, retention=LAST_2, async_save=False) as m:
        for step in (1, 2):
            m.save(step, {"w": np.ones(3)})
        for step in (3, 4):
            m.save(step, {"w": np.array([np.nan, 1, 2])})
        assert m.steps() == [2, 3, 4]
    off = treestore.SaveOptions(stats=False)
    with treestore.CheckpointManager(url, retention=LAST_2, async_save=False, options=off) as m:
        m.save(5, {"w": np.ones(3)})
        assert m.steps() == [2, 4, 5] and m.latest_step(healthy=True) == 2


def test_the_remote_tier_keeps_its_last_healthy_step(tmp_path):
    local, remote = str(tmp_path / "local"), str(tmp_path / "remote")
    with treestore.CheckpointManager(
        local=local, remote=treestore.RemoteTier(remote, keep_last=1), async_save=False
    ) as m:
        m.save(0, {"w": np.ones(3)})
        m.wait()
        for step in (1, 2):
            m.save(step, {"w": np.array([np.inf])})
            m.wait()
    names = [c.name for c in treestore.Store(remote).list()]
    assert names == ["step-000000000", "step-000000002"]
    # The same rule applied to a store directly.
    apply_retention(treestore.Store(remote), Policy(keep_last=1, keep_healthy=False))
    assert [c.name for c in treestore.Store(remote).list()] == ["step-000000002"]


def test_negative_infinity_alone_makes_a_step_unhealthy(tmp_path):
    """A step whose only non-finite value is -inf is unhealthy: retention keeps the finite step
    before it, and the library and the CLI name it."""
    url = str(tmp_path / "run")
    with treestore.CheckpointManager(url, retention=LAST_1, async_save=False) as m:
        m.save(0, {"w": np.ones(3, np.float32)})
        m.save(1, {"w": np.array([1.0, -np.inf, 2.0], np.float32)})
        assert treestore.open(f"{url}#step-000000001").healthy is False
        assert m.steps() == [0, 1] and m.latest_step(healthy=True) == 0
    found = json.loads(run_cli("health", "--json", url).output)
    assert [c["healthy"] for c in found["checkpoints"]] == [True, False]


def test_a_check_that_accepts_everything_cannot_override_recorded_nan(tmp_path):
    """The caller's healthy= check is asked only of steps whose statistics show no NaN/inf: a
    check that accepts every step never makes a NaN step healthy."""
    url = str(tmp_path / "run")
    with treestore.CheckpointManager(
        url, retention=LAST_1, async_save=False, healthy=lambda info, s: True
    ) as m:
        m.save(0, {"w": np.ones(3)})
        m.save(1, {"w": np.array([np.nan, 1.0])})
        assert m.steps() == [0, 1] and m.latest_step(healthy=True) == 0
        restored = m.restore(healthy=True)
        np.testing.assert_array_equal(np.asarray(restored["w"]), np.ones(3))


@pytest.mark.parametrize("how", UNKNOWN)
def test_with_no_step_known_healthy_the_newest_not_known_unhealthy_is_kept(tmp_path, how):
    """Step 1's health becomes unknown, then steps 2 and 3 hold NaN, keep_last=1: no step is
    known healthy, so retention keeps step 1 (never shown unhealthy) beside the newest.
    restore(healthy=True) still loads only a step known healthy: it refuses, naming step 1 and
    how to load it."""
    url = str(tmp_path / "run")
    options, make_unknown = UNKNOWN[how]
    with treestore.CheckpointManager(url, retention=LAST_1, async_save=False, options=options) as m:
        m.save(1, {"w": np.ones(3)})
    make_unknown(url, step_name(1))
    with treestore.CheckpointManager(url, retention=LAST_1, async_save=False) as m:
        for step in (2, 3):
            m.save(step, NAN)
        assert m.steps() == [1, 3]
        assert m.latest_step(healthy=True) is None  # unknown is never taken for healthy
        with pytest.raises(treestore.errors.CheckpointNotFoundError, match=r"restore\(step=1\) loads it"):
            m.restore(healthy=True)
        if how != "manifest-unreadable":
            np.testing.assert_array_equal(np.asarray(m.restore(step=1)["w"]), np.ones(3))


def test_a_step_known_healthy_takes_the_protection_from_older_and_newer_unknown_ones(tmp_path):
    """Unknown steps are protected only where no step is known healthy: the newest of them
    (step 1 of 0-1), and none once step 2 is known healthy, even with step 3 unknown after it."""
    url = str(tmp_path / "run")
    off = treestore.SaveOptions(stats=False)
    with treestore.CheckpointManager(url, retention=LAST_1, async_save=False, options=off) as m:
        m.save(0, {"w": np.ones(3)})
        m.save(1, {"w": np.ones(3)})
    with treestore.CheckpointManager(url, retention=LAST_1, async_save=False) as m:
        m.save(4, NAN)
        assert m.steps() == [1, 4]  # the newer of the two unknown steps
        m.save(5, {"w": np.ones(3)})
        m.save(6, NAN)
        assert m.steps() == [5, 6]  # step 5 is known healthy: step 1 goes
    with treestore.CheckpointManager(url, retention=LAST_1, async_save=False, options=off) as m:
        m.save(7, {"w": np.ones(3)})
    with treestore.CheckpointManager(url, retention=LAST_1, async_save=False) as m:
        m.save(8, NAN)
        assert m.steps() == [5, 8] and m.latest_step(healthy=True) == 5  # step 7 goes
