"""CheckpointManager: interval and retention policy, async saves and their errors, snapshots,
incremental saves, gc next to saves in flight, preemption in-process, and flax/equinox states."""

from __future__ import annotations

import math
import signal
import threading
import time
import uuid
from typing import ClassVar

import fsspec
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from fsspec.implementations.memory import MemoryFileSystem

import treestore
from tests.support.helpers import assert_tree_equal
from treestore._api.manager.retention import Policy, StepInfo
from treestore._format.paths import step_name

RNG = np.random.default_rng(0)


class GatedFileSystem(MemoryFileSystem):
    """fsspec's memory filesystem as ``gated://``, sharing its objects with ``memory://``: chunk
    writes wait for ``gate`` and fail while ``fail`` is set."""

    protocol = ("gated",)
    gate: ClassVar[threading.Event] = threading.Event()
    waiting: ClassVar[threading.Event] = threading.Event()  # a chunk write waits at the gate
    fail: ClassVar[bool] = False
    chunk_writes: ClassVar[int] = 0

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.removeprefix("gated://"))

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        if "/chunks/" in path:
            if GatedFileSystem.fail:
                raise PermissionError(f"injected failure writing {path}")
            if not GatedFileSystem.gate.is_set():
                GatedFileSystem.waiting.set()
            if not GatedFileSystem.gate.wait(30):
                raise PermissionError("the test never opened the gate")
            GatedFileSystem.chunk_writes += 1
        return super().pipe_file(path, value, mode=mode, **kwargs)


fsspec.register_implementation("gated", GatedFileSystem, clobber=True)


@pytest.fixture
def gated():
    """A fresh path on ``gated://`` (and the same objects on ``memory://``), gate open."""
    GatedFileSystem.gate.set()
    GatedFileSystem.waiting.clear()
    GatedFileSystem.fail = False
    GatedFileSystem.chunk_writes = 0
    path = f"treestore-tests/{uuid.uuid4().hex}"
    yield path
    GatedFileSystem.gate.set()
    GatedFileSystem.fail = False


def mem() -> str:
    return f"memory://treestore-tests/{uuid.uuid4().hex}"


def big(value: float = 0.0, n: int = 32768) -> np.ndarray:
    """An array of its own chunk (over the 64 KiB small-leaf limit)."""
    return np.full(n, value, np.float32)


def info(step: int, **metrics: float) -> StepInfo:
    return StepInfo(step, step_name(step), 0.0, metrics, None)


def saved_steps(steps, **kwargs) -> list[int]:
    with treestore.CheckpointManager(mem(), async_save=False, **kwargs) as m:
        for s in steps:
            m.save(s, {"s": s}, metrics={"loss": float(s)})
        return m.steps()


# -- interval -----------------------------------------------------------------------------------
def test_save_every_steps():
    with treestore.CheckpointManager(mem(), save_every_steps=10, async_save=False) as m:
        assert [s for s in range(26) if m.save(s, {"s": s})] == [0, 10, 20]
        assert m.steps() == [0, 10, 20]


def test_save_every_seconds_uses_the_clock():
    now = [1000.0]
    m = treestore.CheckpointManager(mem(), save_every_seconds=60, clock=lambda: now[0], async_save=False)
    done = []
    for step, t in [(1, 1000), (2, 1059), (3, 1060), (4, 1100), (5, 1121), (6, 1180)]:
        now[0] = t
        done.append(m.save(step, {"s": step}))
    assert done == [False, False, True, False, True, False]
    assert m.steps() == [3, 5]


def test_steps_or_seconds_either_saves():
    now = [0.0]
    m = treestore.CheckpointManager(
        mem(), save_every_steps=5, save_every_seconds=10, clock=lambda: now[0], async_save=False
    )
    for step in range(1, 12):
        now[0] = step * 3.0  # seconds pass faster than steps: 10 s after the save at step 5
        m.save(step, {"s": step})
    assert m.steps() == [4, 5, 9, 10]  # 12 s since start; step 5; 15 s after step 5; step 10


def test_no_interval_saves_every_call_and_force_ignores_the_interval():
    assert saved_steps([1, 2, 3]) == [1, 2, 3]
    with treestore.CheckpointManager(mem(), save_every_steps=100, async_save=False) as m:
        assert not m.save(7, {"x": 1})
        assert m.save(7, {"x": 1}, force=True)
        assert m.steps() == [7]


# -- retention ----------------------------------------------------------------------------------
def test_keep_last():
    assert saved_steps(range(1, 6), retention=treestore.Retention(keep_last=2)) == [4, 5]


def test_keep_every_and_the_newest():
    assert saved_steps(range(1, 8), retention=treestore.Retention(keep_every=3)) == [3, 6, 7]


@pytest.mark.parametrize(("mode", "best"), [("min", [2, 4]), ("max", [1, 3])])
def test_keep_best(mode, best):
    losses = {1: 0.9, 2: 0.1, 3: 0.8, 4: 0.2, 5: 0.5}
    with treestore.CheckpointManager(
        mem(),
        retention=treestore.Retention(keep_best=2, best_metric="loss", best_mode=mode),
        async_save=False,
    ) as m:
        for s, loss in losses.items():
            m.save(s, {"s": s}, metrics={"loss": loss, "other": 1})
        assert m.steps() == sorted({*best, 5})  # the newest is always kept
        assert m.info(best[0]).metrics == {"loss": losses[best[0]], "other": 1.0}


def test_rules_combine_as_a_union():
    policy = Policy(keep_last=2, keep_every=4, keep_best=1, best_metric="acc", best_mode="max")
    infos = {s: info(s, acc=a) for s, a in [(1, 0.5), (2, 0.9), (3, 0.1), (4, 0.2), (5, 0.3), (6, 0.0)]}
    assert policy.retained(infos) == {5, 6, 4, 2}
    assert Policy().retained(infos) == set(infos)  # no rule keeps everything
    assert Policy(keep_last=1).retained({}) == set()


def test_best_ignores_steps_without_the_metric_and_nan():
    policy = Policy(keep_best=2, best_metric="loss")
    infos = {1: info(1, loss=math.nan), 2: info(2), 3: info(3, loss=5.0), 4: info(4, loss=6.0), 5: info(5)}
    assert policy.retained(infos) == {3, 4, 5}
    tied = {1: info(1, loss=1.0), 2: info(2, loss=1.0), 3: info(3, loss=3.0)}
    assert Policy(keep_best=1, best_metric="loss").retained(tied) == {2, 3}  # ties: the newer


@pytest.mark.parametrize(
    "kwargs",
    [
        {"keep_last": 0},
        {"keep_last": -1},
        {"keep_last": True},
        {"keep_last": 1.5},
        {"keep_every": 0},
        {"save_every_steps": 0},
        {"save_every_steps": -5},
        {"save_every_seconds": 0},
        {"save_every_seconds": math.inf},
        {"save_every_seconds": "60"},
        {"keep_best": 2},
        {"keep_best": 0, "best_metric": "loss"},
        {"best_metric": "loss"},
        {"best_mode": "max"},
        {"keep_best": 1, "best_metric": "loss", "best_mode": "mean"},
        {"keep_best": 1, "best_metric": ""},
    ],
)
def test_invalid_options_fail_at_construction(kwargs):
    rules = {k: v for k, v in kwargs.items() if not k.startswith("save_every")}
    with pytest.raises(treestore.InvalidInputError):
        retention = treestore.Retention(**rules) if rules else None
        treestore.CheckpointManager(
            mem(), retention=retention, **{k: kwargs[k] for k in kwargs.keys() - rules}
        )


def test_invalid_saves():
    with treestore.CheckpointManager(
        mem(), retention=treestore.Retention(keep_best=1, best_metric="loss"), async_save=False
    ) as m:
        for step in (-1, "3", True, 1.0):
            with pytest.raises(treestore.InvalidInputError, match="step must be"):
                m.save(step, {})
        with pytest.raises(treestore.InvalidInputError, match="'loss' must be a real number"):
            m.save(1, {}, metrics={"loss": "low"})
        with pytest.raises(treestore.InvalidInputError, match=r"got metrics \['lss'\]"):
            m.save(1, {}, metrics={"lss": 1.0})
        with pytest.raises(treestore.InvalidInputError, match="metadata must be plain data"):
            m.save(1, {}, metrics={"loss": 1.0}, user=object())
        assert m.steps() == []
        assert m.save(1, {"x": 1}, metrics={"loss": jnp.float32(0.5), "n": 3})
        assert m.info(1).metrics == {"loss": 0.5, "n": 3.0}


def test_closed_manager():
    m = treestore.CheckpointManager(mem())
    m.close()
    m.close()
    with pytest.raises(treestore.InvalidInputError, match="closed"):
        m.save(1, {})


def test_a_saved_step_is_an_error_unless_forced():
    with treestore.CheckpointManager(mem(), async_save=False) as m:
        m.save(1, {"x": big(1)})
        with pytest.raises(treestore.errors.CheckpointExistsError, match="force=True") as err:
            m.save(1, {"x": big(2)})
        assert isinstance(err.value, FileExistsError)
        assert m.save(1, {"x": big(3)}, force=True)
        assert m.restore()["x"][0] == 3


def test_metadata_restore_and_reopen():
    url = mem()
    store = treestore.Store(url)
    store.save({"unrelated": 1}, "other")
    with treestore.CheckpointManager(url, retention=treestore.Retention(keep_last=1)) as m:
        m.save(1, {"w": big(1)}, metrics={"loss": np.float64(0.25)}, user={"lr": 0.1})
        m.save(2, {"w": big(2)}, metrics={"loss": 0.125})
        m.wait()
        assert m.steps() == [2] and m.latest_step() == 2
        assert store.exists("other")  # other checkpoints are never managed
        got = m.info(2)
        assert (got.name, got.metrics, got.user) == ("step-000000002", {"loss": 0.125}, None)
        assert abs(got.created - time.time()) < 60
    m2 = treestore.CheckpointManager(url)
    assert m2.steps() == [2]
    assert m2.restore()["w"][0] == 2 and m2.restore(step=2)["w"][0] == 2
    with pytest.raises(treestore.errors.CheckpointNotFoundError, match="saved steps: 2"):
        m2.restore(step=1)
    with pytest.raises(treestore.errors.CheckpointNotFoundError):
        m2.info(5)
    empty = treestore.CheckpointManager(mem())
    assert empty.latest_step() is None
    with pytest.raises(treestore.errors.CheckpointNotFoundError, match="no steps saved"):
        empty.restore()


# -- async saves --------------------------------------------------------------------------------
def test_save_returns_before_the_write_and_snapshots_the_tree(gated):
    GatedFileSystem.gate.clear()
    m = treestore.CheckpointManager(f"gated://{gated}")
    arr = big(1.0)
    t0 = time.perf_counter()
    assert m.save(1, {"a": arr, "j": jnp.arange(4.0)})
    assert time.perf_counter() - t0 < 20  # a synchronous save would have waited for the gate (30 s)
    arr[:] = 7.0  # the caller changes its array while the save is in flight
    assert m.steps() == [] and GatedFileSystem.chunk_writes == 0
    GatedFileSystem.gate.set()
    m.wait()
    assert m.steps() == [1]
    assert (m.restore()["a"] == 1.0).all()
    m.close()


def test_one_save_in_flight(gated):
    GatedFileSystem.gate.clear()
    m = treestore.CheckpointManager(f"gated://{gated}")
    m.save(1, {"a": big(1)})
    second = threading.Thread(target=m.save, args=(2, {"a": big(2)}))
    second.start()
    second.join(0.3)
    assert second.is_alive()  # waiting for the first save
    GatedFileSystem.gate.set()
    second.join(30)
    m.close()
    assert m.steps() == [1, 2]


def test_unchanged_jax_arrays_are_reused_and_changed_ones_copied(monkeypatch):
    """A jax array that is the same object as at the last save is not copied to host again (its
    host copy is reused); one that changed is copied, into the last copy's buffer (on CPU, where
    the host copy is the manager's own). Each step still restores its own values."""
    copied: list[str] = []  # addresses whose host copy a save made
    prepare_leaf = treestore._engine.saving.snapshot.prepare_leaf
    monkeypatch.setattr(
        "treestore._engine.saving.snapshot.prepare_leaf",
        lambda value, address: copied.append(address) or prepare_leaf(value, address),
    )
    url = mem()
    a, b = jnp.arange(40000.0), jnp.ones(40000)
    a2, b2 = a * 2, b + 1
    own_buffers = jax.default_backend() == "cpu"
    with treestore.CheckpointManager(url) as m:

        def step(n, tree, want_copied):
            before = {k: kept.leaf.data for k, kept in m._snapshot._kept.items()}
            copied.clear()
            m.save(n, tree)
            m.wait()
            assert sorted(copied) == want_copied, f"step {n}: copied {copied}"
            now = {k: kept.leaf.data for k, kept in m._snapshot._kept.items()}
            for k, data in now.items():
                np.testing.assert_array_equal(data, np.asarray(tree[k]))
                if k not in want_copied:
                    assert data is before[k], f"step {n}: {k} unchanged, but its host copy was not reused"
                elif own_buffers and k in before and isinstance(tree[k], jax.Array):
                    assert data is before[k], f"step {n}: {k} was not copied into its last buffer"
            return now

        first = step(1, {"a": a, "b": b}, ["a", "b"])
        second = step(2, {"a": a, "b": b2}, ["b"])
        step(3, {"a": a2, "b": b2, "n": np.ones(3)}, ["a", "n"])
        step(4, {"a": a2}, [])
        assert second["a"] is first["a"]
    for n, want in [(1, (a, b)), (2, (a, b2)), (3, (a2, b2)), (4, (a2,))]:
        got = treestore.CheckpointManager(url).restore(step=n)
        for key, x in zip("ab", want, strict=False):
            np.testing.assert_array_equal(got[key], x)


def test_a_failed_snapshot_keeps_no_stale_buffer():
    url = mem()
    a = jnp.arange(40000.0)
    with treestore.CheckpointManager(url) as m:
        m.save(1, {"a": a})
        with pytest.raises(treestore.errors.UnsupportedLeafError):
            m.save(2, {"a": a + 1, "z": object()})  # "a" was copied before "z" failed
        m.save(3, {"a": a})
        m.wait()
        assert m.steps() == [1, 3]
        np.testing.assert_array_equal(m.restore(step=3)["a"], a)


@pytest.mark.parametrize("where", ["save", "wait", "close", "restore", "exit"])
def test_background_errors_surface_once(gated, where):
    m = treestore.CheckpointManager(f"gated://{gated}")
    GatedFileSystem.fail = True
    assert m.save(1, {"a": big(1)})  # the write fails in the background
    with pytest.raises(treestore.StorageError, match="injected failure"):
        if where == "save":
            m.save(2, {"a": big(2)})
        elif where == "wait":
            m.wait()
        elif where == "close":
            m.close()
        elif where == "restore":
            m.restore()
        else:
            with m:
                pass
    assert m.steps() == []  # nothing visible
    GatedFileSystem.fail = False
    if where in ("close", "exit"):
        return
    m.wait()  # raised once, not again
    assert m.save(3, {"a": big(3)})
    m.close()
    assert m.steps() == [3]


def test_sync_errors_raise_at_once(gated):
    GatedFileSystem.fail = True
    m = treestore.CheckpointManager(f"gated://{gated}", async_save=False)
    with pytest.raises(treestore.StorageError):
        m.save(1, {"a": big(1)})
    assert m.steps() == []


# -- incremental saves and gc -------------------------------------------------------------------
def test_fine_tuning_writes_about_the_head():
    backbone = {"w1": jnp.asarray(RNG.standard_normal((512, 1024), np.float32))}
    backbone["w2"] = jnp.asarray(RNG.standard_normal((1024, 512), np.float32))
    head = {"w": jnp.asarray(RNG.standard_normal((512, 128), np.float32) * 0.01), "b": jnp.zeros(128)}
    tx = optax.adam(1e-2)
    x = jnp.asarray(RNG.standard_normal((16, 512), np.float32))

    @jax.jit
    def step(head, opt, backbone):
        def loss(h):
            feats = jnp.tanh(jnp.tanh(x @ backbone["w1"]) @ backbone["w2"])
            return jnp.mean((feats @ h["w"] + h["b"]) ** 2)

        updates, opt = tx.update(jax.grad(loss)(head), opt, head)
        return optax.apply_updates(head, updates), opt

    opt = tx.init(head)
    trainable = 3 * sum(v.nbytes for v in head.values())  # params, adam's mu and nu
    with treestore.CheckpointManager(mem()) as m:
        m.save(0, {"backbone": backbone, "head": head, "opt": opt})
        m.wait()
        full = m.last_result
        assert full is not None and full.bytes_written > 4 * 2**20 * 0.8
        for s in range(1, 4):
            head, opt = step(head, opt, backbone)
            m.save(s, {"backbone": backbone, "head": head, "opt": opt})
            m.wait()
            r = m.last_result
            assert r is not None and r.chunks_reused >= 2  # the backbone's chunks
            assert 0.5 * trainable <= r.bytes_written <= 1.05 * trainable + 16384, (r, trainable)
            assert r.bytes_written < 0.25 * full.bytes_written


def chunk_objects(store: treestore.Store) -> set[str]:
    return {o.path.rsplit("/", 1)[-1] for o in store._storage.list("chunks")}


def live_chunks(store: treestore.Store) -> set[str]:
    return {d.hex() for c in store.list() for d in store.manifest(c.name).chunk_digests()}


def test_retention_deletes_and_gc_frees_their_chunks():
    url = mem()
    with treestore.CheckpointManager(url, retention=treestore.Retention(keep_last=1)) as m:
        for s in range(1, 4):
            m.save(s, {"a": big(s), "b": big(-s)})
    store = treestore.Store(url)
    assert [c.name for c in store.list()] == ["step-000000003"]
    assert chunk_objects(store) == live_chunks(store) and len(live_chunks(store)) == 2
    assert store._storage.list("manifests") and len(store._storage.list("manifests")) == 1


def test_gc_never_removes_a_chunk_of_a_save_in_flight(gated):
    shared = {"a": big(1), "b": big(2)}
    trainer = treestore.CheckpointManager(
        f"memory://{gated}", retention=treestore.Retention(keep_last=1), async_save=False
    )
    trainer.save(1, shared)  # chunks of a and b exist now
    GatedFileSystem.gate.clear()
    slow = treestore.CheckpointManager(f"gated://{gated}")
    slow.save(1000, {**shared, "c": big(3)})  # reuses a's and b's chunks, then waits to write c
    assert GatedFileSystem.waiting.wait(30)
    trainer.save(2, {"a": big(4)})  # retention deletes step 1; its gc must defer
    assert trainer.steps() == [2] and trainer._gc_due
    with pytest.raises(treestore.errors.StoreBusyError, match="in flight"):
        treestore.Store(f"memory://{gated}").gc(grace=0, wait=0)
    GatedFileSystem.gate.set()
    slow.close()
    store = treestore.Store(f"memory://{gated}")
    assert_tree_equal(store.load("step-000001000"), {**shared, "c": big(3)})  # verified digests
    trainer.save(3, {"a": big(5)})  # the deferred gc runs now (step 1000 is the newest: kept)
    assert not trainer._gc_due
    assert chunk_objects(store) == live_chunks(store)
    assert_tree_equal(store.load("step-000001000"), {**shared, "c": big(3)})


# -- preemption in-process ----------------------------------------------------------------------
def test_sigterm_saves_at_once_and_chains_to_the_previous_handler():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        m = treestore.CheckpointManager(mem(), save_every_steps=100, preemption=True)
        assert not m.save(1, {"x": 1}) and not m.reached_preemption(1)
        signal.raise_signal(signal.SIGTERM)
        assert seen == [signal.SIGTERM]
        assert not m.reached_preemption(1)  # step 1 is not saved: the loop goes on
        assert m.save(2, {"x": 2})  # saves at once and waits for the commit
        assert m.reached_preemption(2) and m.steps() == [2]
        assert not m.save(2, {"x": 2})  # already saved: nothing to do
        m.close()
        assert not m._preemption.installed()
        signal.raise_signal(signal.SIGTERM)
        assert seen == [signal.SIGTERM] * 2
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_preemption_needs_the_main_thread():
    errors = []

    def make():
        try:
            treestore.CheckpointManager(mem(), preemption=True)
        except treestore.InvalidInputError as exc:
            errors.append(exc)

    t = threading.Thread(target=make)
    t.start()
    t.join()
    assert len(errors) == 1 and "main thread" in str(errors[0])


# -- framework states ---------------------------------------------------------------------------
def test_flax_train_state_round_trips_with_like():
    import flax.linen as nn
    from flax.training import train_state

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(nn.relu(nn.Dense(16)(x)))

    model = MLP()
    params = model.init(jax.random.key(0), jnp.ones((1, 3)))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))
    grads = jax.tree_util.tree_map(jnp.ones_like, state.params)
    state = state.apply_gradients(grads=grads)
    with treestore.CheckpointManager(mem()) as m:
        m.save(int(state.step), state)
        fresh = train_state.TrainState.create(
            apply_fn=model.apply, params=model.init(jax.random.key(1), jnp.ones((1, 3))), tx=optax.adam(1e-3)
        )
        restored = m.restore(like=fresh)
    assert type(restored) is type(state) and restored.apply_fn == model.apply
    assert_tree_equal(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(state))


def test_equinox_module_round_trips_with_like():
    import equinox as eqx

    model = eqx.nn.MLP(3, 2, width_size=8, depth=2, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    with treestore.CheckpointManager(mem()) as m:
        m.save(5, {"model": params, "key": jax.random.key(3)})
        other = eqx.nn.MLP(3, 2, width_size=8, depth=2, key=jax.random.key(9))
        like = {"model": eqx.filter(other, eqx.is_array), "key": jax.random.key(0)}
        restored = m.restore(like=like)
    out = eqx.combine(restored["model"], static)
    x = jnp.ones(3)
    np.testing.assert_array_equal(out(x), model(x))
    assert_tree_equal(restored["key"], jax.random.key(3))
