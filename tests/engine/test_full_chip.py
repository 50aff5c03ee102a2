"""A save on a full chip (issues 60 and 61): it never takes device memory the training step needs,
compiles no program per small leaf shape, gives one record for one tree wherever it lives, and
falls back or fails cleanly when the device fails it. CI has no accelerator: the device path is
forced onto the CPU (``device_path="always"``), a device that reports little free memory is a
stand-in for :func:`device_memory.stats`, and faults are injected where jax would raise them."""

from __future__ import annotations

import collections
import gc
import math
import threading
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import treestore
from tests.support.compiles import compiles
from tests.support.devices import ALWAYS, OOM, MiB, counting, device_reports, raising
from treestore._api.manager import save_queue
from treestore._engine.saving import device_fetch, slicing, snapshot
from treestore._tree.leaves import ArrayLeaf
from treestore.errors import DeviceError


def _live() -> int:
    gc.collect()
    return len(jax.live_arrays())


def _big_tree(seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    return {
        "a": jnp.asarray(rng.standard_normal((1000, 3001)).astype(np.float32)),  # 12 MB: sliced
        "b": jnp.asarray(rng.standard_normal(1_500_000).astype(ml_dtypes.bfloat16)),  # 3 MB
        "c": jnp.asarray(rng.standard_normal((300, 500)).astype(np.float32)),  # 600 KB: whole
    }


def _assert_same(store: treestore.Store, name: str, tree: dict[str, Any]) -> None:
    loaded = store.load(name)
    for k, v in tree.items():
        np.testing.assert_array_equal(np.asarray(loaded[k]), np.asarray(v))


# -- device memory ---------------------------------------------------------------------------------
def test_a_device_without_room_for_slices_beside_the_step_s_peak_gets_none() -> None:
    """Slices in flight take up to the window's bytes on the device. A device whose peak leaves
    less room than that (however little it holds between steps) gets no slicing program: its
    leaves are fetched whole, and the save stores the same chunks."""
    tree = _big_tree()
    store = treestore.Store("memory://full-chip/no-slices")
    store.save(tree, "host", options=treestore.SaveOptions(**{**ALWAYS, "device_path": "never"}))
    with pytest.MonkeyPatch.context() as mp:
        roomy = counting(mp, slicing, "slicer")
        store.save(tree, "roomy", options=treestore.SaveOptions(**ALWAYS))
    assert roomy  # the big leaves are sliced where the device has room
    with pytest.MonkeyPatch.context() as mp:
        device_reports(mp, limit=16 << 30, in_use=1 << 30, peak=16 * (1 << 30) - 3 * MiB)
        full = counting(mp, slicing, "slicer")
        r = store.save(tree, "full", options=treestore.SaveOptions(**ALWAYS))
    assert full == []
    assert r.chunks_written == 0  # the chunks of the save from host memory, byte for byte
    _assert_same(store, "full", tree)


@pytest.mark.parametrize("room", ["full", "roomy"])
def test_an_async_snapshot_is_copied_on_the_device_only_beside_the_step_s_peak(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, room: str
) -> None:
    """Between steps the device holds little (1 GiB of 16), but the step peaked with 6 MiB to
    spare: a copy of the 4.4 MB tree would fit beside what the device holds now, and even beside
    the peak, but not with the save's 4 MiB window of slices too. So the snapshot is taken on
    the host, and the next step keeps its memory. With a peak of 4 GiB the copy is made on the
    device."""
    peak = (16 << 30) - 6 * MiB if room == "full" else 4 << 30
    device_reports(monkeypatch, limit=16 << 30, in_use=1 << 30, peak=peak)
    copies = counting(monkeypatch, snapshot, "_copier")
    tree = {"w": jnp.ones((512, 1024)), "s": jnp.arange(300_000.0)}
    with treestore.CheckpointManager(tmp_path / "run", options=treestore.SaveOptions(**ALWAYS)) as m:
        m.save(1, tree)
        m.wait()
    assert (copies != []) == (room == "roomy")
    store = treestore.Store(str(tmp_path / "run"))
    _assert_same(store, store.list()[0].name, tree)


def test_a_step_s_reserved_temporaries_leave_no_room_for_a_device_snapshot(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TPU reserves a program's temporaries when it loads the program, apart from its buffers:
    on a v5e, a step sorting 1.2e9 floats beside a 4.2 GiB tree reserved 8.9 GiB and left the
    peak of bytes in use at the tree's. A device copy of the tree fitted beside that peak, and the
    next step could not load (5 of 5 times, before the reserved bytes were counted). Here, scaled
    to this 4.4 MB tree: the step's reserved temporaries leave 6 MiB, too little for the copy and
    the 4 MiB window, so the snapshot is taken on the host."""
    device_reports(monkeypatch, limit=16 << 30, in_use=1 << 30, peak=1 << 30, reserved=(15 << 30) - 6 * MiB)
    copies = counting(monkeypatch, snapshot, "_copier")
    tree = {"w": jnp.ones((512, 1024)), "s": jnp.arange(300_000.0)}
    with treestore.CheckpointManager(tmp_path / "run", options=treestore.SaveOptions(**ALWAYS)) as m:
        m.save(1, tree)
        m.wait()
    assert copies == []
    store = treestore.Store(str(tmp_path / "run"))
    _assert_same(store, store.list()[0].name, tree)


def test_an_async_snapshot_drops_jax_s_host_copies_before_the_next_one() -> None:
    """Host copies of accelerator arrays are jax's own and cannot be written into: the snapshot
    drops those of arrays gone before it copies the next tree, so it never holds two trees."""
    snap = snapshot.HostSnapshot()
    leaf = ArrayLeaf("jax", "float32", np.zeros(3, np.float32))
    old_array = jnp.ones(3)
    snap._kept = {"w": snapshot._Kept(weakref.ref(old_array), leaf, owned=False)}
    seen: list[bool] = []
    real = snapshot.prepare

    def prepare(tree: Any, leaf: Any, before: Any) -> Any:
        def spy(values: list[Any]) -> None:
            before(values)
            seen.append("w" in snap._kept)

        return real(tree, leaf=leaf, before=spy)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(snapshot, "prepare", prepare)
        snap.take({"w": jnp.zeros(3)})
    assert seen == [False]  # dropped before any leaf of the new tree was copied
    del old_array


# -- programs compiled -----------------------------------------------------------------------------
def test_a_save_of_many_leaf_shapes_compiles_no_program() -> None:
    """A cold process paid one compile per leaf shape (256 shapes: 68 s on a TPU). Leaves up to a
    slice move to the host with no program and statistics are measured on the host: a tree of
    100 distinct shapes compiles nothing, on its first save or any later one."""
    rng = np.random.default_rng(5)
    tree = {f"w{i}": jnp.asarray(rng.standard_normal((100 + i, 37)).astype(np.float32)) for i in range(100)}
    jax.block_until_ready(tree)
    store = treestore.Store("memory://full-chip/shapes")
    with compiles() as compiled:
        store.save(tree, "a", options=treestore.SaveOptions(**{**ALWAYS, "small_leaf": 1024}))
    assert compiled == []
    _assert_same(store, "a", tree)
    assert store.open("a").stats("w99")["w99"].nan == 0


def test_compile_log_counting_sees_a_slicing_program(monkeypatch: pytest.MonkeyPatch) -> None:
    """The counter above counts programs: a leaf over a slice, of a shape never sliced before,
    compiles one, and a second leaf of that shape none; the set of programs kept is bounded."""
    monkeypatch.setattr(slicing, "_programs", collections.OrderedDict())
    monkeypatch.setattr(slicing, "_kept", lambda: 2)
    rng = np.random.default_rng(6)
    tree = {
        f"w{i}": jnp.asarray(rng.standard_normal((787 + i % 3, 1117)).astype(np.float32)) for i in range(6)
    }
    jax.block_until_ready(tree)
    store = treestore.Store("memory://full-chip/programs")
    with compiles() as compiled:
        store.save(tree, "a", options=treestore.SaveOptions(**ALWAYS))
    assert len(compiled) >= 3  # each of the three shapes' slices at least once
    assert len(slicing._programs) <= 2
    _assert_same(store, "a", tree)


def test_a_leaf_compiles_one_slicing_program_where_its_last_slice_may_start_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A leaf that does not divide into whole slices has one program for all its slices, the
    last starting back from its end where that fetches again a chunk at most (it was compiled a
    second time, for the shorter last one); the chunks are the same as a save from host
    memory's."""
    monkeypatch.setattr(slicing, "_programs", collections.OrderedDict())
    x = jnp.asarray(np.random.default_rng(16).standard_normal((1400, 1019)).astype(np.float32))  # 2.7 slices
    store = treestore.Store("memory://full-chip/one-program")
    store.save({"w": x}, "host", options=treestore.SaveOptions(**{**ALWAYS, "device_path": "never"}))
    with compiles() as compiled:
        store.save({"w": x}, "device", options=treestore.SaveOptions(**ALWAYS))
    assert len(compiled) == 1
    assert store.open("device").chunk_objects() == store.open("host").chunk_objects()


def test_the_slicing_programs_of_a_save_are_compiled_ahead_on_threads_of_their_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cold save of leaves of several shapes over a slice starts compiling every program it
    will ask for before its first transfer, several at once, instead of each when its leaf
    comes; the save's own thread compiles none."""
    monkeypatch.setattr(slicing, "_programs", collections.OrderedDict())
    real = slicing._slice_rows
    threads: list[str] = []

    def traced(rows: int, flat: bool) -> Any:
        threads.append(threading.current_thread().name)
        return real(rows, flat)

    monkeypatch.setattr(slicing, "_slice_rows", traced)
    rng = np.random.default_rng(17)
    tree = {f"w{i}": jnp.asarray(rng.standard_normal((900 + i, 1031)).astype(np.float32)) for i in range(5)}
    store = treestore.Store("memory://full-chip/ahead")
    store.save(tree, "a", options=treestore.SaveOptions(**ALWAYS))
    assert len(threads) == 5 and all(t.startswith("treestore-compile") for t in threads)
    assert len(set(threads)) > 1  # several at once
    _assert_same(store, "a", tree)


# -- one tree, one record --------------------------------------------------------------------------
def _record_cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    nan_payloads = np.array([0x7FC00001, 0xFFC00002, 0x7F800003, 0x3F800000], np.uint32).view(np.float32)
    mixed = rng.standard_normal(3_000_000).astype(np.float32)  # 12 MB: sliced on the device path
    mixed[::1000] = np.float32(1e-40)
    mixed[1::1000] = np.float32(-1e-40)
    mixed[2::1000] = np.float32(-0.0)
    mixed[3] = np.nan
    return {
        "subnormal": np.full(1000, 1e-40, np.float32),
        "negative_subnormal": np.array([-1e-40, -3e-42, 2e-45], np.float32),
        "negative_zero": np.full(100, -0.0, np.float32),
        "signed_zeros": np.array([0.0, -0.0, 0.0], np.float32),
        "nan_payloads": nan_payloads,
        "bf16_subnormal": np.array([1e-39, -1e-40, 0.0], ml_dtypes.bfloat16),
        "f16_subnormal": np.array([1e-7, -6e-8], np.float16),
        "mixed": mixed,
    }


def _records(checkpoint: treestore.Checkpoint) -> dict[str, tuple[Any, ...]]:
    out = {}
    for k, v in checkpoint.stats().items():
        out[k] = (
            v.nan,
            v.posinf,
            v.neginf,
            v.min,
            math.copysign(1.0, v.min) if v.min == 0 else None,
            v.max,
            math.copysign(1.0, v.max) if v.max == 0 else None,
            v.l2,
        )
    return out


def test_one_tree_gets_one_record_on_the_device_path_the_host_path_and_an_async_snapshot(
    tmp_path: Any,
) -> None:
    """Subnormals, signed zeros and NaN payloads: the device path flushed subnormals to zero (a
    leaf of 1e-40 recorded min 0.0, its sign lost). Every path measures the stored bytes on the
    host now: the records are equal, bit for bit."""
    tree = {k: jnp.asarray(v) for k, v in _record_cases().items()}
    store = treestore.Store(str(tmp_path / "s"))
    store.save(
        tree, "host", options=treestore.SaveOptions(**{**ALWAYS, "device_path": "never", "small_leaf": 0})
    )
    store.save(tree, "device", options=treestore.SaveOptions(**{**ALWAYS, "small_leaf": 0}))
    with treestore.CheckpointManager(store.url, options=treestore.SaveOptions(**ALWAYS, small_leaf=0)) as m:
        m.save(1, tree)
        m.wait()
    async_name = next(c.name for c in store.list() if c.name not in ("host", "device"))
    host = _records(store.open("host"))
    assert host == _records(store.open("device")) == _records(store.open(async_name))
    assert host["subnormal"][3] == host["subnormal"][5] == np.float32(1e-40)
    assert host["negative_subnormal"][3] == np.float32(-1e-40)
    assert host["negative_zero"][4] == -1.0  # the sign of -0.0 kept
    assert host["nan_payloads"][:3] == (3, 0, 0)  # three NaNs of three payloads, and 1.0


# -- faults on the device path ---------------------------------------------------------------------
@pytest.mark.parametrize("when", ["compile", "run"])
def test_a_slicing_program_out_of_memory_falls_back_to_whole_leaves(
    monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """The slicing program cannot be compiled or loaded, or cannot run (RESOURCE_EXHAUSTED): the
    save fetches the leaves whole instead, and stores the same chunks."""
    tree = _big_tree(1)
    store = treestore.Store("memory://full-chip/slicer-oom-" + when)
    store.save(tree, "host", options=treestore.SaveOptions(**{**ALWAYS, "device_path": "never"}))
    before = _live()
    monkeypatch.setattr(slicing, "_programs", collections.OrderedDict())
    tried: list[str] = []

    class Unloadable:
        def lower(self, *args: Any) -> Any:
            tried.append("compile")
            raise jax.errors.JaxRuntimeError(OOM)

    if when == "compile":
        monkeypatch.setattr(slicing, "_slice_rows", lambda rows, flat: Unloadable())
    else:
        real = slicing.slicer

        def slicer(x: Any, rows: int, flat: bool) -> Any:
            real(x, rows, flat)
            tried.append("run")
            return raising()

        monkeypatch.setattr(slicing, "slicer", slicer)
    r = store.save(tree, "device", options=treestore.SaveOptions(**ALWAYS))
    assert tried and set(tried) == {when}
    assert r.chunks_written == 0
    _assert_same(store, "device", tree)
    assert _live() <= before


@pytest.mark.parametrize("where", ["slice transfer", "whole transfer"])
def test_a_failed_transfer_raises_a_device_error_and_commits_nothing(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    tree = _big_tree(2)
    store = treestore.Store("memory://full-chip/transfer-" + where.split()[0])
    before = _live()
    with pytest.MonkeyPatch.context() as mp:
        if where == "slice transfer":
            real = device_fetch.to_host

            def to_host(x: Any) -> Any:
                if isinstance(x, jax.Array):
                    raise jax.errors.JaxRuntimeError("INTERNAL: transfer to host failed")
                return real(x)

            mp.setattr(device_fetch, "to_host", to_host)
        else:
            mp.setattr(device_fetch, "whole", raising("INTERNAL: transfer to host failed"))
        with pytest.raises(DeviceError) as e:
            store.save(tree, "a", options=treestore.SaveOptions(**ALWAYS))
    assert e.value.address in tree and "transfer to host failed" in str(e.value)
    del e  # its traceback holds the save's frames, and their arrays
    assert store.list() == []
    assert _live() <= before
    store.save(tree, "a", options=treestore.SaveOptions(**ALWAYS))  # the next save works
    _assert_same(store, "a", tree)


def test_a_device_copy_that_fails_falls_back_to_a_host_snapshot(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(snapshot, "_copier", lambda: raising())
    tree = {"w": jnp.arange(400_000.0), "b": jnp.ones(3)}
    before = _live()
    with treestore.CheckpointManager(tmp_path / "run", options=treestore.SaveOptions(**ALWAYS)) as m:
        m.save(1, tree)
        m.wait()
        name = treestore.Store(str(tmp_path / "run")).list()[0].name
        del tree["b"]  # the caller's arrays go on being the caller's
        tree["w"].delete()
        _assert_same(
            treestore.Store(str(tmp_path / "run")), name, {"w": np.arange(400_000.0), "b": np.ones(3)}
        )
    assert _live() <= before


def test_a_background_that_cannot_start_writes_at_once_and_frees_the_device_copies(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_thread(self: Any, job: Any) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(save_queue.Background, "submit", no_thread)
    copies = counting(monkeypatch, snapshot, "_copier")
    tree = {"w": jnp.arange(400_000.0)}
    before = _live()
    with treestore.CheckpointManager(tmp_path / "run", options=treestore.SaveOptions(**ALWAYS)) as m:
        m.save(1, tree)
        assert copies  # the tree was copied on the device...
        assert _live() <= before  # ...and the copy freed once written, at once
        assert m.steps() == [1]
        m.save(2, {"w": tree["w"] + 1})
        assert m.steps() == [1, 2]


def test_a_leaf_moved_whole_goes_through_a_new_array_over_the_same_device_buffers() -> None:
    """The host copy jax caches on the array it fetched must not stay on the caller's leaf (it
    would hold the tree's bytes in host memory for as long as the caller holds the tree), and
    the leaf must not be copied on its device or through pinned host memory to get there. A CPU
    caches no host copy (its arrays are host memory), so this checks the means: a new array
    over the very same buffer."""
    x = jnp.arange(100_000.0)
    moved = device_fetch.whole(x)
    assert moved is not x
    assert moved.unsafe_buffer_pointer() == x.unsafe_buffer_pointer()
    np.testing.assert_array_equal(device_fetch.to_host(moved), np.arange(100_000.0, dtype=np.float32))


def test_leaves_moved_whole_store_the_same_bytes_as_the_host_path(monkeypatch: pytest.MonkeyPatch) -> None:
    moved = counting(monkeypatch, device_fetch, "whole")
    tree = {"w": jnp.arange(100_000.0), "v": jnp.ones((300, 70))}
    store = treestore.Store("memory://full-chip/whole")
    store.save(tree, "a", options=treestore.SaveOptions(**{**ALWAYS, "small_leaf": 0}))
    assert len(moved) == 2  # both leaves are smaller than a slice
    _assert_same(store, "a", tree)
