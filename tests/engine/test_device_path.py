"""The device path of a save (issue 44): statistics measured on the device, big leaves fetched in
a bounded window of host memory, and the async manager's snapshot on the device. CI has no
accelerator, so the path is forced onto the CPU (``device_path="always"``); on a TPU these tests
run as they are and take the real path."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import treestore
from tests.support.devices import ALWAYS
from treestore._engine.saving import device_fetch
from treestore._engine.saving.chunk_writer import ChunkWriter
from treestore._format import stats as host_stats


def _cases() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    with_nonfinite = rng.standard_normal((300, 517)).astype(np.float32)
    with_nonfinite[3, 4] = with_nonfinite[9, 9] = np.nan
    with_nonfinite[5, 6] = np.inf
    with_nonfinite[7, 7] = -np.inf
    return [
        with_nonfinite,
        rng.standard_normal(70_000).astype(ml_dtypes.bfloat16),
        rng.standard_normal(5000).astype(ml_dtypes.float8_e4m3fn),
        rng.standard_normal(5000).astype(ml_dtypes.float8_e5m2),
        rng.standard_normal(3000).astype(np.float16),
        np.zeros((0, 3), np.float32),
        np.array(3.5, np.float32),
        np.full(10, np.nan, np.float32),
        np.array([np.inf, -np.inf, 1.0], np.float32),
        (rng.standard_normal(1000) * 1e30).astype(np.float32),  # squares beyond float32
        (rng.standard_normal(1000) * 1e-30).astype(np.float32),  # squares below float32
        np.concatenate([rng.standard_normal(200_000), [np.nan] * 3]).astype(np.float32),  # blocks
    ]


def test_device_statistics_of_a_sharded_array_equal_the_host_reference() -> None:
    devices = jax.devices()
    values = np.random.default_rng(1).standard_normal((len(devices) * 64, 300)).astype(np.float32)
    values[5, 5] = np.nan
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    x = jax.device_put(values, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")))
    store = treestore.Store("memory://device-path/sharded")
    store.save({"w": x}, "a", options=treestore.SaveOptions(**ALWAYS))
    got = store.open("a").stats("w")["w"]
    want = host_stats.measure(values)
    assert (got.nan, got.posinf, got.neginf, got.min, got.max) == tuple(want[1:6])
    assert math.isclose(got.l2, math.sqrt(want[6]), rel_tol=1e-5)
    np.testing.assert_array_equal(np.asarray(store.load("a")["w"]), values)


def test_a_save_through_the_device_path_stores_the_same_chunks() -> None:
    rng = np.random.default_rng(2)
    tree = {
        "a": jnp.asarray(rng.standard_normal((1000, 3001)).astype(np.float32)),  # chunks span slices
        "b": jnp.asarray(rng.standard_normal(700_000).astype(ml_dtypes.bfloat16)),
        "c": jnp.arange(300_000, dtype=jnp.int32).reshape(1000, 300),  # measured on the host
        "d": jnp.ones(10),
        "e": np.ones(100_000),
    }
    store = treestore.Store("memory://device-path/same")
    store.save(tree, "host", options=treestore.SaveOptions(**{**ALWAYS, "device_path": "never"}))
    r = store.save(tree, "device", options=treestore.SaveOptions(**ALWAYS))
    assert r.chunks_written == 0  # every chunk already stored by the save from host memory
    assert treestore.diff(store.url + "#host", store.url + "#device").changed == ()
    loaded = store.load("device")
    for k, v in tree.items():
        np.testing.assert_array_equal(np.asarray(loaded[k]), np.asarray(v))
    a, b = store.open("host").stats(), store.open("device").stats()
    for k in tree:
        assert (a[k].nan, a[k].min, a[k].max) == (b[k].nan, b[k].min, b[k].max)
        assert math.isclose(a[k].l2, b[k].l2, rel_tol=1e-6)


def test_the_host_window_bounds_the_bytes_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes fetched from the device and not yet stored, counted at the two ends (not by the
    window itself), never exceed ``host_window``. The leaves divide into whole slices, so that
    every byte fetched is stored once (no last slice starting back)."""
    window = 4 << 20
    state = {"fetched": 0, "stored": 0, "most": 0}
    fetch, put = device_fetch.to_host, ChunkWriter.put_measured

    def counted_fetch(x):  # type: ignore[no-untyped-def]
        out = fetch(x)
        state["fetched"] += out.nbytes
        state["most"] = max(state["most"], state["fetched"] - state["stored"])
        return out

    def counted_put(self, raw, *args, **kwargs):  # type: ignore[no-untyped-def]
        try:
            return put(self, raw, *args, **kwargs)
        finally:
            state["stored"] += raw.nbytes

    monkeypatch.setattr(device_fetch, "to_host", counted_fetch)
    monkeypatch.setattr(ChunkWriter, "put_measured", counted_put)
    rng = np.random.default_rng(3)
    tree = {f"w{i}": jnp.asarray(rng.standard_normal((768, 2048)).astype(np.float32)) for i in range(6)}
    treestore.save("memory://device-path/window", tree, "a", options=treestore.SaveOptions(**ALWAYS))
    total = sum(int(x.nbytes) for x in tree.values())
    assert state["fetched"] >= total > 4 * window  # every byte came through the window, many times over
    assert 0 < state["most"] <= window
    loaded = treestore.load("memory://device-path/window", "a")
    for k, v in tree.items():
        np.testing.assert_array_equal(np.asarray(loaded[k]), np.asarray(v))


def test_an_async_save_survives_the_next_step_donating_its_buffers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The manager's snapshot is a copy on the device: the step that follows ``save`` donates the
    saved arrays (their buffers are reused at once), and every step still saves what it held."""
    state = {"w": jnp.ones((512, 1024)), "b": jnp.arange(100_000.0)}
    state = _saved_while_donating(tmp_path, state, treestore.SaveOptions(**ALWAYS), steps=4)
    assert state["w"].is_deleted() is False


def _saved_while_donating(path, state, options, steps):  # type: ignore[no-untyped-def]
    """Save ``state`` at each step with an async manager, the next step donating its arrays;
    check every step loads back what it held; the last state."""
    step_fn = jax.jit(lambda s: jax.tree.map(lambda x: x * 2 + 1, s), donate_argnums=0)
    expected = {}
    with treestore.CheckpointManager(
        path, async_save=True, options=options, retention=treestore.Retention(keep_last=10)
    ) as m:
        for step in range(steps):
            expected[step] = jax.tree.map(np.array, state)
            m.save(step, state, force=True)
            state = step_fn(state)  # donates the arrays just saved
        m.wait()
    for step, want in expected.items():
        got = treestore.load(str(path), f"step-{step:09d}")
        for k in want:
            np.testing.assert_array_equal(np.asarray(got[k]), want[k])
    return state


def test_the_default_host_window_grows_with_the_chunk_size() -> None:
    """Unset, the window is 64 MiB, or four chunks where chunks are bigger: every chunk size the
    options accept saves with the default window."""
    biggest = treestore.SaveOptions(chunk_size=256 << 20)  # refused when the default was fixed
    assert biggest.window == 1 << 30
    assert treestore.SaveOptions(chunk_size=64 << 20).window == 256 << 20
    assert treestore.SaveOptions().window == 64 << 20
    assert treestore.SaveOptions(chunk_size=16 << 20).window == 64 << 20
    assert treestore.SaveOptions(chunk_size=32 << 20).window == 128 << 20
    assert treestore.SaveOptions(chunk_size=1 << 20, host_window=8 << 20).window == 8 << 20


def test_save_options_of_the_device_path_are_checked() -> None:
    with pytest.raises(treestore.InvalidInputError, match="host_window"):
        treestore.SaveOptions(host_window=1 << 20)
    with pytest.raises(treestore.InvalidInputError, match="host_window"):
        treestore.SaveOptions(chunk_size=64 << 20, host_window=128 << 20)
    with pytest.raises(treestore.InvalidInputError, match="device_path"):
        treestore.SaveOptions(device_path="sometimes")
    with pytest.raises(treestore.InvalidInputError, match="device_snapshot"):
        treestore.SaveOptions(device_snapshot=-1)


def test_a_load_onto_an_accelerator_reads_in_groups_and_waits_for_old_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the default device an accelerator (forced here on the CPU), a ``like=`` load reads
    the whole leaves in groups of at most the window's bytes (a bigger leaf alone), starts each
    group's copies to the device before reading the next, and waits for a group's copies before
    a third group is read: the tree is the one saved, leaf for leaf."""
    from treestore._engine.reading import load as load_module
    from treestore._engine.reading import load_leaves

    window = 1 << 20
    monkeypatch.setattr(load_module, "_to_accelerator", lambda: True)
    monkeypatch.setattr(load_module, "LOAD_WINDOW", window)
    events: list[tuple[str, int]] = []
    read, block = load_leaves.read_leaves, jax.block_until_ready

    def counted_read(reader, columns, which, **options):  # type: ignore[no-untyped-def]
        out = read(reader, columns, which, **options)
        events.append(("read", sum(int(a.nbytes) for a in out.values())))
        return out

    def counted_block(x):  # type: ignore[no-untyped-def]
        events.append(("wait", len(x)))
        return block(x)

    monkeypatch.setattr(load_leaves, "read_leaves", counted_read)
    monkeypatch.setattr(jax, "block_until_ready", counted_block)
    rng = np.random.default_rng(5)
    sizes = [100_000, 60_000, 3_000, 700_000, 40_000, 90_000, 5, 200_000, 150_000]
    tree = {f"w{i}": jnp.asarray(rng.standard_normal(n).astype(np.float32)) for i, n in enumerate(sizes)}
    tree["step"] = 7
    treestore.save("memory://device-path/grouped", tree, "a")
    like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) if hasattr(v, "shape") else 0 for k, v in tree.items()}
    loaded = treestore.load("memory://device-path/grouped", "a", like=like)
    assert loaded["step"] == 7
    for k, v in tree.items():
        if k != "step":
            assert isinstance(loaded[k], jax.Array)
            np.testing.assert_array_equal(np.asarray(loaded[k]), np.asarray(v))
    reads = [n for what, n in events if what == "read"]
    assert len(reads) >= 3 and sum(reads) == 4 * sum(sizes)
    assert all(n <= window for n in reads if n != 4 * 700_000)  # the 2.8 MB leaf is read alone
    waits = [i for i, (what, _) in enumerate(events) if what == "wait"]
    assert len(waits) == len(reads) - 2  # before the third group's read and every one after
    assert all(events[i - 1][0] == "read" and events[i - 2][0] == "read" for i in waits[:1])


def test_a_complex_leaf_on_the_device_path_is_measured_by_its_parts_on_the_host() -> None:
    z = (np.arange(50_000) + 1j * np.arange(50_000)[::-1]).astype(np.complex64)
    z[7] = complex(np.nan, 0)
    store = treestore.Store("memory://device-path/complex")
    options = treestore.SaveOptions(**{**ALWAYS, "chunk_size": 64 * 1024})
    store.save({"z": jnp.asarray(z)}, "a", options=options)
    got = store.open("a").stats()["z"]
    want = host_stats.measure(z)
    assert (got.nan, got.posinf, got.neginf, got.min, got.max) == tuple(want[1:6]) and got.nan == 1
    assert math.isclose(got.l2, math.sqrt(want[6]), rel_tol=1e-12) and store.open("a").healthy is False


def test_a_load_onto_an_accelerator_reuses_two_host_buffers_and_returns_none_of_their_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The groups of a load onto an accelerator (forced here on the CPU) are read into two host
    buffers, each made once and reused: the host memory the load holds is two groups' worth,
    not the tree's. Nothing returned shares a buffer's memory: numpy leaves of the template and
    jax arrays on a CPU device (which may use host bytes in place) are copied out, and each leaf
    is the one saved although the buffers were overwritten by later groups."""
    from treestore._engine.reading import load as load_module
    from treestore._engine.reading import staging

    window = 1 << 20
    monkeypatch.setattr(load_module, "_to_accelerator", lambda: True)
    monkeypatch.setattr(load_module, "LOAD_WINDOW", window)
    made: list[np.ndarray] = []
    new_buffer = staging._new_buffer

    def counted(nbytes: int, checkpoint: str) -> np.ndarray:
        made.append(new_buffer(nbytes, checkpoint))
        return made[-1]

    monkeypatch.setattr(staging, "_new_buffer", counted)
    rng = np.random.default_rng(9)
    tree: dict[str, object] = {
        f"w{i}": jnp.asarray(rng.standard_normal(n).astype(np.float32))
        for i, n in enumerate([100_000, 60_000, 200_000, 90_000, 150_000, 120_000, 80_000])
    }
    tree["n"] = rng.standard_normal((300, 300)).astype(np.float32)  # a numpy leaf, 360 KB
    tree["h"] = jnp.asarray(rng.standard_normal(50_000).astype(ml_dtypes.bfloat16))
    tree["key"] = jax.random.key(3)
    small_chunks = treestore.SaveOptions(chunk_size=1 << 16)
    treestore.save("memory://device-path/staged", tree, "a", options=small_chunks)
    like = {
        k: v if isinstance(v, np.ndarray) else jax.ShapeDtypeStruct(v.shape, v.dtype)  # type: ignore[attr-defined]
        for k, v in tree.items()
    }
    loaded = treestore.load("memory://device-path/staged", "a", like=like)
    assert len(made) == 2  # five groups or more, two buffers
    biggest = max(int(v.nbytes) for v in tree.values())  # type: ignore[attr-defined]
    assert all(len(b) <= max(window, biggest) + 64 * len(tree) for b in made)
    spans = [(b.ctypes.data, b.ctypes.data + len(b)) for b in made]
    for k, v in tree.items():
        got = loaded[k]
        if k == "key":
            assert jnp.array_equal(jax.random.key_data(got), jax.random.key_data(v))  # type: ignore[arg-type]
            continue
        np.testing.assert_array_equal(np.asarray(got), np.asarray(v))
        if isinstance(got, np.ndarray):
            at = got.ctypes.data
        else:
            assert isinstance(got, jax.Array)
            at = got.unsafe_buffer_pointer()
        assert not any(lo <= at < hi for lo, hi in spans), k


def test_a_staging_buffer_hands_out_aligned_views_to_its_leaves_and_copies_what_shares_it() -> None:
    """An arena gives the leaves it stages aligned views of its buffer, one after another, and
    fresh arrays to other leaves and once the buffer is used up; what it detaches is copied
    only where it shares the buffer's memory."""
    from treestore._engine.reading import staging

    arena = staging.Arena(np.zeros(1000, np.uint8), {"a", "b"})
    a = arena.allocate((3,), "a", "c", np.float32)
    b = arena.allocate(100, "b", "c")
    other = arena.allocate(10, "x", "c")
    full = arena.allocate(900, "b", "c")  # past the end of the buffer: a fresh array
    assert np.shares_memory(a, arena.buf) and np.shares_memory(b, arena.buf)
    assert a.ctypes.data % 64 == 0 and b.ctypes.data % 64 == 0 and not np.shares_memory(a, b)
    assert not np.shares_memory(other, arena.buf) and not np.shares_memory(full, arena.buf)
    a[:] = 5.0
    copied = arena.detach(a)
    assert not np.shares_memory(copied, arena.buf) and copied.tolist() == [5.0, 5.0, 5.0]
    assert arena.detach(other) is other
    on_cpu = jax.device_put(np.arange(3.0), jax.devices("cpu")[0])  # on a TPU machine too
    assert arena.detach(on_cpu) is not on_cpu  # a CPU device may use host bytes in place
    np.testing.assert_array_equal(np.asarray(arena.detach(on_cpu)), [0.0, 1.0, 2.0])


@pytest.mark.parametrize("bound", [1 << 20, None])
def test_an_async_snapshot_over_its_device_bound_is_copied_to_host(tmp_path, monkeypatch, bound) -> None:  # type: ignore[no-untyped-def]
    """``SaveOptions.device_snapshot`` bounds the bytes an async save copies on the devices: a
    tree over it (a 2 MiB leaf against 1 MiB) is copied to host instead, sharded leaves shard by
    shard, and survives the next step's donation as the device copy does; within the bound
    (none set) the copy is made on the devices."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from treestore._engine.saving import snapshot

    calls: list[int] = []
    copier = snapshot._copier
    monkeypatch.setattr(snapshot, "_copier", lambda: (calls.append(1), copier())[1])
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    sharded = jax.device_put(jnp.arange(64 * 64.0).reshape(64, 64), NamedSharding(mesh, P("x")))
    state = {"w": jnp.ones((512, 1024)), "s": sharded}
    _saved_while_donating(tmp_path, state, treestore.SaveOptions(**ALWAYS, device_snapshot=bound), steps=3)
    assert (calls == []) == (bound is not None)


def _fetched(
    arrays: list,  # type: ignore[type-arg]
    window: device_fetch.Window,
    chunk: int,
    target: int = device_fetch.SLICE,
    exact: bool = False,
) -> list[bytes]:
    """The chunks a Fetcher with ``window`` submits for ``arrays``, each leaf's in order."""
    import concurrent.futures as cf

    fetcher = device_fetch.Fetcher(window, chunk, target, exact=exact)
    pool = cf.ThreadPoolExecutor(2)
    futures = [
        fetcher.add(x, chunk, lambda raw: pool.submit(lambda r=raw: bytes(r)))  # type: ignore[misc]
        for x in arrays
    ]
    try:
        fetcher.run()
        return [f.result() for fs in futures for f in fs]
    finally:
        pool.shutdown(wait=True)


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize(
    ("shape", "twice"),
    [
        ((47, 48), True),  # rows of 192 bytes: slices of whole chunks, reaching a row past each end
        ((5, 301), False),  # rows bigger than a chunk: chunks that span slices put together
        ((20, 150), False),  # rows of 600 bytes, two more than a chunk: the same
        ((900, 7), True),  # rows of 28 bytes
        ((900, 3), False),  # rows of 12 bytes, 250 to a slice of three whole chunks
        ((40, 250), False),  # rows that divide the chunk: no chunk spans two slices
    ],
)
def test_the_fetcher_hands_over_the_leaf_s_bytes_in_chunks_whatever_its_rows(
    shape: tuple[int, int], twice: bool, exact: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slices of whole rows, chunks every ``chunk`` bytes of the leaf, in the window. Where two
    rows fit in a chunk, a slice's rows reach past its whole chunks to the rows that hold their
    first and last bytes (at most two rows per slice fetched twice); where they do not, the
    chunks that span two slices are put together. The last slice may start back from the leaf's
    end, to have the others' height (one program), fetching again a chunk at most; ``exact``, no
    byte but those rows."""
    fetched: list[int] = []
    to_host = device_fetch.to_host
    monkeypatch.setattr(device_fetch, "to_host", lambda piece: fetched.append(piece.nbytes) or to_host(piece))
    x = jnp.asarray(np.random.default_rng(5).standard_normal(shape).astype(np.float32))
    window = device_fetch.Window(10_000)
    chunks = _fetched([x], window, chunk=1000, target=3000, exact=exact)
    raw = np.asarray(x).tobytes()
    assert chunks == [raw[i : i + 1000] for i in range(0, len(raw), 1000)]
    assert window.held == 0 and 0 < window.peak <= 10_000
    rows_twice = 2 * 4 * shape[1] * len(fetched) if twice else 0
    if exact:
        assert x.nbytes + (rows_twice > 0) <= sum(fetched) <= x.nbytes + rows_twice
    else:  # one height, and the last's where starting back would fetch more than a chunk again
        assert len(set(fetched[:-1])) == 1
        assert x.nbytes <= sum(fetched) <= x.nbytes + 1000 + rows_twice


def test_the_fetcher_cuts_chunks_at_the_leaf_s_boundaries_whatever_its_slices() -> None:
    """Slices smaller than a chunk (each chunk put together from several), a leaf whose one row
    is bigger than a slice (fetched through a flat view) and an empty leaf: the chunks are the
    leaf's bytes cut every ``chunk`` bytes, and the window is empty again after."""
    rng = np.random.default_rng(4)
    small_slices = jnp.asarray(rng.standard_normal((30, 25)).astype(np.float32))  # rows of 100 bytes
    wide_rows = jnp.asarray(rng.standard_normal((2, 3000)).astype(np.float32))  # rows of 12,000 bytes
    empty = jnp.zeros((0, 3), jnp.float32)
    window = device_fetch.Window(2300)
    chunks = _fetched([small_slices, wide_rows, empty], window, chunk=1000, target=300)
    raw = [np.asarray(x).tobytes() for x in (small_slices, wide_rows)]
    want = [r[i : i + 1000] for r in raw for i in range(0, len(r), 1000)]
    assert chunks == want
    assert window.held == 0 and 0 < window.peak <= 2300


def test_a_fetch_that_fails_gives_its_window_back() -> None:
    """A leaf that cannot be sliced (deleted before the fetch) raises its error, and every byte
    taken for slices started before it is given back to the window."""
    first = jnp.arange(5000.0, dtype=jnp.float32)
    gone = jnp.arange(5000.0, dtype=jnp.float32)
    gone.delete()
    window = device_fetch.Window(1 << 20)
    with pytest.raises(RuntimeError, match="deleted"):
        _fetched([first, gone], window, chunk=4096)
    assert window.held == 0 and window.peak > 0
