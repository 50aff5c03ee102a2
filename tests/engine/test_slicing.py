"""The slicing programs' kept set (treestore._engine.saving.slicing): compiled ahead on threads
of their own, each by one thread only, none left unresolved when a thread cannot start or the
compile is interrupted, and called as compiled whatever the calling thread's jax config."""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import treestore
from tests.support.devices import ALWAYS
from treestore._engine.saving import slicing


class _Array:
    """What the kept set reads of an array: its shape, dtype, size and sharding."""

    def __init__(self, n: int) -> None:
        self.shape, self.dtype, self.size, self.sharding = (n,), "f4", n, "s"


class _Program:
    compiles: ClassVar[list[str]] = []

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def lower(self, x: Any, start: Any) -> _Program:
        return self

    def compile(self) -> tuple[str, int]:
        _Program.compiles.append(threading.current_thread().name)
        time.sleep(0.05)
        return ("program", self.rows)


@pytest.fixture
def fake_programs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.setattr(slicing, "_programs", collections.OrderedDict())
    monkeypatch.setattr(slicing, "_slice_rows", lambda rows, flat: _Program(rows))
    _Program.compiles = []
    return _Program.compiles


class _OneThread(ThreadPoolExecutor):
    """A pool that starts its first thread and no more (a process out of threads): its
    ``submit`` raises after it has queued the job, as the standard library's does."""

    def _adjust_thread_count(self) -> None:
        if self._threads:
            raise RuntimeError("can't start new thread")
        super()._adjust_thread_count()


def test_a_program_whose_thread_cannot_start_is_compiled_once_by_the_caller(
    fake_programs: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second compile's thread cannot start: the caller compiles it, and the job the pool
    queued anyway, run later by the first thread, finds it taken and compiles nothing."""
    monkeypatch.setattr(slicing, "ThreadPoolExecutor", _OneThread)
    a, b = _Array(10), _Array(20)
    slicing.compile_ahead([(a, 1, False), (b, 1, False)])
    assert slicing.slicer(a, 1, False) == ("program", 1) and slicing.slicer(b, 1, False) == ("program", 1)
    time.sleep(0.3)  # the queued job has run by now
    assert len(fake_programs) == 2 and len(slicing._programs) == 2
    assert all(f.exception() is None for f in slicing._programs.values())


def test_an_interrupted_compile_ahead_leaves_no_program_waited_for(
    fake_programs: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while the compile is handed to its thread: the interrupt is raised, and the next
    save that asks for the program compiles it instead of waiting for it forever."""

    class Interrupted(ThreadPoolExecutor):
        def submit(self, *args: Any, **kwargs: Any) -> Any:
            raise KeyboardInterrupt

    a = _Array(10)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(slicing, "ThreadPoolExecutor", Interrupted)
        with pytest.raises(KeyboardInterrupt):
            slicing.compile_ahead([(a, 1, False)])
    got: list[Any] = []
    asker = threading.Thread(target=lambda: got.append(slicing.slicer(a, 1, False)), daemon=True)
    asker.start()
    asker.join(10)
    assert got == [("program", 1)]


def test_programs_are_compiled_ahead_on_threads_of_their_own(fake_programs: list[str]) -> None:
    arrays = [_Array(n) for n in (10, 20, 30, 40, 50)]
    slicing.compile_ahead([(x, 2, False) for x in arrays] + [(arrays[0], 2, False)])  # one of each
    assert [slicing.slicer(x, 2, False) for x in arrays] == [("program", 2)] * 5
    assert len(fake_programs) == 5 and all(t.startswith("treestore-compile") for t in fake_programs)


def test_a_save_inside_an_enable_x64_context_calls_its_programs_as_they_were_compiled() -> None:
    """The programs are compiled on other threads, under the process's jax config; a caller
    inside ``jax.enable_x64(True)`` (a config of its thread alone) passed the start row as an
    int64 to a program compiled for an int32, and the save failed with a TypeError."""
    store = treestore.Store("memory://slicing/x64")
    with jax.enable_x64(True):
        x = jnp.asarray(np.arange(700_000, dtype=np.float64).reshape(1000, 700))  # 5.6 MB: sliced
        store.save({"w": x}, "a", options=treestore.SaveOptions(**ALWAYS))
        np.testing.assert_array_equal(np.asarray(store.load("a")["w"]), np.asarray(x))


def test_the_programs_of_a_sharded_leaf_are_kept_for_every_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A leaf sharded over eight devices is fetched shard by shard, a program for each device:
    the kept set bounds programs per device, so that saving it again compiles nothing (bounded
    in all, it dropped each device's program before the next save asked for it)."""
    from tests.support.compiles import compiles

    monkeypatch.setattr(slicing, "_programs", collections.OrderedDict())
    monkeypatch.setattr(slicing, "PROGRAMS", 4)
    devices = jax.devices()[:8]
    assert len(devices) == 8  # the tests' CPU has eight
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    rng = np.random.default_rng(19)
    x = jax.device_put(rng.standard_normal((8 * 700, 1031)).astype(np.float32), sharding)  # 2.9 MB shards
    store = treestore.Store("memory://slicing/sharded")
    store.save({"w": x}, "a", options=treestore.SaveOptions(**ALWAYS))
    with compiles() as compiled:
        store.save({"w": x}, "b", options=treestore.SaveOptions(**ALWAYS))
    assert compiled == []
    np.testing.assert_array_equal(np.asarray(store.load("b")["w"]), np.asarray(x))
