"""Sharded jax.Arrays: saved shard by shard without gathering, restored onto any sharding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import treestore
from tests.support.helpers import same_bytes

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS in conftest)")


def mesh(shape, names):
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, names)


def sharded(array, sharding):
    return jax.device_put(array, sharding)


def host(x):
    return np.asarray(jax.device_get(x))


@pytest.fixture
def values():
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((64, 48)).astype(np.float32),
        "v": rng.standard_normal((40,)).astype(np.float32),
        "b": rng.integers(0, 100, (16, 8, 6)).astype(np.int32),
        "s": np.float32(3.5),
    }


def tree_on(values, m, specs):
    return {k: sharded(v, NamedSharding(m, specs[k])) for k, v in values.items()}


def like_on(values, m, specs):
    return {
        k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype, sharding=NamedSharding(m, specs[k]))
        for k, v in values.items()
    }


SPECS_8 = {"w": P("x", "y"), "v": P("x"), "b": P(None, "y"), "s": P()}


def test_save_writes_each_shard_once_without_gathering(store_url, values):
    m = mesh((4, 2), ("x", "y"))
    tree = tree_on(values, m, SPECS_8)
    store = treestore.Store(store_url)
    store.save(tree, "c")
    manifest = store.manifest("c")
    by = {e.address: e for e in manifest.leaves}
    assert len(by["w"].pieces) == 8  # 4 x 2 blocks
    assert {p.shape for p in by["w"].pieces} == {(16, 24)}
    assert len(by["v"].pieces) == 4  # replicated over y: one replica writes
    assert len(by["b"].pieces) == 2
    assert by["s"].pieces == ()  # fully replicated: one plain leaf
    # Without a template: host numpy arrays, bit-identical.
    out = store.load("c")
    for k, v in values.items():
        assert same_bytes(host(out[k]), v), k


@pytest.mark.parametrize(
    ("mesh_shape", "specs"),
    [
        ((8,), {"w": P("x"), "v": P("x"), "b": P("x"), "s": P()}),
        ((4,), {"w": P(None, "x"), "v": P(), "b": P(None, "x"), "s": P()}),
        ((2, 2), {"w": P("y", "x"), "v": P("y"), "b": P("x", "y"), "s": P()}),
        ((1,), {"w": P(), "v": P(), "b": P(), "s": P()}),
    ],
)
def test_restore_onto_any_sharding(store_url, values, mesh_shape, specs):
    store = treestore.Store(store_url)
    store.save(tree_on(values, mesh((4, 2), ("x", "y")), SPECS_8), "c")
    names = ("x", "y")[: len(mesh_shape)]
    m = mesh(mesh_shape, names)
    out = store.load("c", like=like_on(values, m, specs))
    for k, v in values.items():
        assert out[k].sharding == NamedSharding(m, specs[k]), k
        assert same_bytes(host(out[k]), v), k
        for shard in out[k].addressable_shards:
            assert same_bytes(np.asarray(shard.data), v[shard.index]), (k, shard.index)


def test_reshard_8_to_4_to_1(store_url, values):
    store = treestore.Store(store_url)
    store.save(
        tree_on(values, mesh((8,), ("x",)), {"w": P("x"), "v": P("x"), "b": P("x"), "s": P()}), "eight"
    )
    four = store.load(
        "eight",
        like=like_on(
            values,
            mesh((2, 2), ("x", "y")),
            {"w": P("x", "y"), "v": P("y"), "b": P(None, "x", "y"), "s": P()},
        ),
    )
    store.save(four, "four")
    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    like = {
        k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype, sharding=single) for k, v in values.items()
    }
    one = store.load("four", like=like)
    for k, v in values.items():
        assert same_bytes(host(one[k]), v), k
    # Same data, different layouts: the diff compares data and finds nothing.
    assert not treestore.diff(f"{store_url}#eight", f"{store_url}#four")


def test_sharded_leaves_are_read_together_within_a_byte_budget(store_url, values, monkeypatch):
    """Small sharded leaves' chunks are decoded in one batch (one leaf at a time left the reading
    threads waiting on the caller between leaves), and no batch holds more than the budget of
    host buffers unless one leaf alone is bigger."""
    from treestore._engine.reading import region
    from treestore._tree import template

    store = treestore.Store(store_url)
    store.save(tree_on(values, mesh((4, 2), ("x", "y")), SPECS_8), "c")
    like = like_on(
        values, mesh((2, 2), ("x", "y")), {"w": P("x", "y"), "v": P("y"), "b": P(None, "x"), "s": P()}
    )
    batches: list[list[int]] = []
    real = region.read_many

    def recording(reader, wanted, threads=0):
        found = real(reader, wanted, threads)
        batches.append([sum(a.nbytes for a in arrays) for arrays in found])
        return found

    monkeypatch.setattr(region, "read_many", recording)
    out = store.load("c", like=like)
    assert [len(b) for b in batches] == [4]  # one batch: every leaf is on several devices
    monkeypatch.setattr(template, "BATCH_BYTES", values["w"].nbytes)
    batches.clear()
    again = store.load("c", like=like)
    assert len(batches) >= 2 and all(len(b) == 1 or sum(b) <= values["w"].nbytes for b in batches), batches
    for k, v in values.items():
        assert same_bytes(host(out[k]), v) and same_bytes(host(again[k]), v), k


def test_lazy_slices_and_select_on_sharded_leaves(store_url, values):
    store = treestore.Store(store_url)
    store.save(tree_on(values, mesh((4, 2), ("x", "y")), SPECS_8), "c")
    w = store.open("c")["w"]
    assert same_bytes(w[10:30], values["w"][10:30])
    assert same_bytes(w[:, 5], values["w"][:, 5])
    assert same_bytes(w.region((slice(15, 17), slice(20, 30))), values["w"][15:17, 20:30])
    assert same_bytes(store.load("c", select="b")["b"], values["b"])


def test_sharded_prng_keys_and_bf16(store_url):
    m = mesh((8,), ("x",))
    keys = jax.random.split(jax.random.key(3), 16)
    keys = jax.device_put(keys, NamedSharding(m, P("x")))
    bf = jax.device_put(jnp.arange(64, dtype=jnp.bfloat16).reshape(16, 4), NamedSharding(m, P("x")))
    treestore.save(store_url, {"keys": keys, "bf": bf}, "c")
    out = treestore.load(store_url)
    assert same_bytes(jax.random.key_data(out["keys"]), jax.random.key_data(keys))
    assert same_bytes(out["bf"], bf)


def test_hostile_pieces_are_rejected(store_url, values):
    from tests.support import hostile

    treestore.save(store_url, tree_on(values, mesh((4, 2), ("x", "y")), SPECS_8), "c")

    def overlap(m):
        for leaf in m["leaves"]:
            if leaf["address"] == "w":
                leaf["pieces"][1][0] = list(leaf["pieces"][0][0])  # two pieces at one place: a hole

    hostile.mutate_manifest(store_url, "c", overlap)
    with pytest.raises(treestore.errors.ManifestDamagedError, match="w: pieces overlap or leave holes"):
        treestore.load(store_url)


def test_restored_shards_go_onto_cpu_devices_without_a_copy(tmp_path):
    """Load results are 64-byte aligned host buffers, which jax's CPU client uses in place, so a
    leaf (or a restored shard) is not copied again on its way to a CPU device."""
    rng = np.random.default_rng(3)
    host = {"w": rng.standard_normal((512, 1024)).astype(np.float32), "b": np.arange(7, dtype=np.int8)}
    url = str(tmp_path / "s")
    treestore.save(url, host, "c")
    loaded = treestore.load(url, "c")
    assert loaded["w"].ctypes.data % 64 == 0
    on_device = jax.device_put(loaded["w"], jax.devices()[0])
    assert np.shares_memory(np.asarray(on_device), loaded["w"])  # in place, not copied
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    like = {
        "w": jax.ShapeDtypeStruct((512, 1024), jnp.float32, sharding=NamedSharding(mesh, P("d"))),
        "b": jax.ShapeDtypeStruct((7,), jnp.int8),
    }
    out = treestore.load(url, "c", like=like)
    assert same_bytes(np.asarray(out["w"]), host["w"])


def test_big_load_results_are_faulted_in_with_ordinary_pages(tmp_path):
    """A result of 4 MiB or more gets no huge pages (numpy asks for them; faulting them in
    stalls where memory is fragmented): its pages are marked so before it is filled."""
    w = np.arange(2**21, dtype=np.float32)  # 8 MiB
    url = str(tmp_path / "s")
    treestore.save(url, {"w": w}, "c")
    loaded = treestore.load(url, "c")["w"]
    start = loaded.ctypes.data + 2 * 4096  # (the first, partial page is left as it was)
    with open("/proc/self/smaps") as f:
        blocks = f.read().split("\n")
    for i, line in enumerate(blocks):
        lo, _, hi = line.partition(" ")[0].partition("-")
        if hi and all(c in "0123456789abcdef" for c in lo + hi) and int(lo, 16) <= start < int(hi, 16):
            flags = next(b for b in blocks[i + 1 :] if b.startswith("VmFlags:"))
            break
    else:
        pytest.fail("the result's mapping is not in /proc/self/smaps")
    assert " nh" in flags, flags  # MADV_NOHUGEPAGE on the result's pages
    assert same_bytes(loaded, w)
