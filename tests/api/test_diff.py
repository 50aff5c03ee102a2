"""Exact diffs from manifests, the change of values from changed chunks, across stores and
filesystems."""

from __future__ import annotations

import json
import math
import uuid

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import treestore
from tests import strategies
from tests.support.counting import CountingFileSystem

RNG = np.random.default_rng(11)
OPTIONS = treestore.SaveOptions(chunk_size=64 * 1024)


def tree():
    return {
        "layers": [
            {"w": RNG.standard_normal((256, 256)).astype(np.float32), "b": np.zeros(256, np.float32)}
            for _ in range(3)
        ],
        "step": 100,
        "name": "run-1",
    }


def test_diff_kinds(store_url):
    a = tree()
    b = {
        "layers": [dict(layer) for layer in a["layers"]],
        "step": 200,
        "name": "run-1",
        "new": np.ones(2),
    }
    b["layers"][1]["w"] = a["layers"][1]["w"].copy()
    b["layers"][1]["w"][:8] += 1.0  # first chunk only
    b["layers"][2]["b"] = np.zeros(255, np.float32)  # shape
    b["layers"][0]["b"] = np.zeros(256, np.float64)  # dtype
    del b["name"]
    store = treestore.Store(store_url)
    store.save(a, "a", options=OPTIONS)
    store.save(b, "b", options=OPTIONS)
    d = treestore.diff(f"{store_url}#a", f"{store_url}#b")
    assert d and len(d) == 6
    assert d.added == ("new",) and d.removed == ("name",)
    assert set(d.changed) == {"layers/1/w", "step"}
    assert [x.address for x in d.by_status("shape_changed")] == ["layers/2/b"]
    assert [x.address for x in d.by_status("dtype_changed")] == ["layers/0/b"]
    assert set(d.unchanged) == {"layers/0/w", "layers/1/b", "layers/2/w"}
    (w,) = [x for x in d if x.address == "layers/1/w"]
    assert w.chunks_changed == 0.25 and w.change is None
    text = str(d)
    assert "~  layers/1/w" in text and "+  new" in text and "-  name" in text
    assert text.endswith("3 leaves unchanged")
    data = json.loads(json.dumps(d.to_json()))
    assert data["counts"]["changed"] == 2 and data["identical"] is False
    assert d.filter("layers/*").added == ()


def test_diff_reads_only_manifests(tmp_path):
    url = f"counting://diff/{uuid.uuid4().hex}"
    store = treestore.Store(url)
    a = tree()
    store.save(a, "a", options=OPTIONS)
    a["layers"][0]["w"] = a["layers"][0]["w"] * 2
    store.save(a, "b", options=OPTIONS)
    CountingFileSystem.reset()
    d = treestore.diff(f"{url}#a", f"{url}#b")
    assert d.changed == ("layers/0/w",)
    assert CountingFileSystem.bytes_read("chunks") == 0
    CountingFileSystem.reset()
    d = treestore.diff(f"{url}#a", f"{url}#b", values=True)
    leaf = treestore.open(url, "a")["layers/0/w"].entry
    # values are read for the changed leaf only: both sides' differing chunks
    assert CountingFileSystem.bytes_read("chunks") <= 2 * leaf.stored_bytes + 1024
    (w,) = list(d)
    assert w.change is not None and w.change.frac_changed == 1.0
    assert w.change.rel_l2 == pytest.approx(1.0, rel=1e-6)


def test_value_change_figures(store_url):
    a = np.linspace(-1, 1, 100_000).astype(np.float32)
    b = a.copy()
    b[:10] += 0.5
    b[20] = np.nan
    b[30] = np.inf
    store = treestore.Store(store_url)
    store.save({"x": a}, "a", options=OPTIONS)
    store.save({"x": b}, "b", options=OPTIONS)
    (x,) = list(treestore.diff(f"{store_url}#a", f"{store_url}#b", values=True))
    s = x.change
    assert s.nan_a == 0 and s.nan_b == 1 and s.inf_b == 1 and s.inf_a == 0
    assert s.frac_changed == pytest.approx(12 / 100_000)
    assert s.max_abs == float("inf")
    assert x.chunks_changed == pytest.approx(1 / 7)
    c = a.copy()
    c[:10] += 0.5
    store.save({"x": c}, "c", options=OPTIONS)
    (x,) = list(treestore.diff(f"{store_url}#a", f"{store_url}#c", values=True))
    assert x.change.max_abs == pytest.approx(0.5, rel=1e-6)
    assert x.change.mean_abs == pytest.approx(10 * 0.5 / 100_000, rel=1e-5)
    expected = np.linalg.norm(c.astype(np.float64) - a) / np.linalg.norm(a.astype(np.float64))
    assert x.change.rel_l2 == pytest.approx(expected, rel=1e-9)


def test_diff_across_stores_and_filesystems(tmp_path):
    a = tree()
    local = str(tmp_path / "local")
    memory = f"memory://diff/{uuid.uuid4().hex}"
    treestore.save(local, a, "x")
    treestore.save(memory, a, "y")
    assert not treestore.diff(local, memory)  # newest of each
    a["step"] = 101
    treestore.save(memory, a, "z")
    assert treestore.diff(f"{local}#x", memory).changed == ("step",)


def test_diff_with_different_chunk_sizes_compares_data(store_url):
    a = tree()
    store = treestore.Store(store_url)
    store.save(a, "small", options=OPTIONS)
    store.save(a, "big", options=treestore.SaveOptions(chunk_size=1 << 20))
    assert not treestore.diff(f"{store_url}#small", f"{store_url}#big")
    a["layers"][2]["w"] = a["layers"][2]["w"] + 1
    store.save(a, "big2", options=treestore.SaveOptions(chunk_size=1 << 20))
    d = treestore.diff(f"{store_url}#small", f"{store_url}#big2", values=True)
    (w,) = list(d)
    assert w.address == "layers/2/w" and w.change is not None and w.change.max_abs == pytest.approx(1.0)


def test_missing_chunk_while_comparing_values_names_the_address(store_url):
    a = tree()
    store = treestore.Store(store_url)
    store.save(a, "a", options=OPTIONS)
    a["layers"][0]["w"] = a["layers"][0]["w"] + 1
    store.save(a, "b", options=OPTIONS)
    from treestore._format import paths as _paths

    entry = store.open("b")["layers/0/w"].entry
    store._storage.delete(_paths.chunk_path(entry.chunks[0].digest))
    assert treestore.diff(f"{store_url}#a", f"{store_url}#b").changed == ("layers/0/w",)  # manifests only
    with pytest.raises(treestore.errors.ChunkMissingError, match="layers/0/w"):
        treestore.diff(f"{store_url}#a", f"{store_url}#b", values=True)


trees = strategies.trees(
    strategies.scalars() | strategies.arrays() | strategies.arrays([np.float32], max_dims=1, max_side=20),
    keys=strategies.KEYS | st.text("abc", min_size=1, max_size=3),
    containers=("dict", "list", "tuple"),
)


@settings(max_examples=40, deadline=None)
@given(trees)
def test_property_diff_of_a_checkpoint_with_itself_is_empty(t):
    url = f"memory://diffprop/{uuid.uuid4().hex}"
    treestore.save(url, t, "x")
    d = treestore.diff(f"{url}#x", f"{url}#x", values=True)
    assert not d and len(d) == 0 and d.to_json()["identical"]


def test_select_limits_the_comparison_and_its_values(store_url):
    a = tree()
    store = treestore.Store(store_url)
    store.save(a, "a", options=OPTIONS)
    for layer in a["layers"]:
        layer["w"] = layer["w"] + 1
    store.save(a, "b", options=OPTIONS)
    d = treestore.diff(f"{store_url}#a", f"{store_url}#b", values=True, select="layers/1/*")
    assert [x.address for x in d.leaves] == ["layers/1/b", "layers/1/w"]  # manifest (jax) order
    assert d.changed == ("layers/1/w",) and d.leaves[1].change is not None


def _described(e) -> str:
    return f"{e.dtype}[{', '.join(map(str, e.shape))}]" if e.is_array else e.kind


def _reference(ea, eb) -> tuple[str, float | None]:
    """How two leaf entries at one address differ, decided entry by entry from their fields: the
    oracle the column-wise diff is checked against."""
    if ea.is_array != eb.is_array or (not ea.is_array and ea.kind != eb.kind):
        return "dtype_changed", None
    if not ea.is_array:
        return ("unchanged" if ea.digest == eb.digest else "changed"), None
    if ea.shape != eb.shape:
        return "shape_changed", None
    if ea.dtype != eb.dtype or ea.prng_impl != eb.prng_impl:
        return "dtype_changed", None
    if ea.digest == eb.digest:
        return "unchanged", None

    def cut(e):
        return [(p.start, p.shape, [c.raw_size for c in p.chunks]) for p in e.all_pieces]

    if cut(ea) == cut(eb):
        differ = sum(ca.digest != cb.digest for ca, cb in zip(ea.chunks, eb.chunks, strict=True))
        return ("changed" if differ else "unchanged"), differ / max(len(ea.chunks), 1)
    return "cut", None


def test_column_wise_diff_agrees_with_comparing_leaf_entries(tmp_path):
    """The diff tells apart the leaves whose chunks alone differ column by column; every leaf
    gets the status, types and share of changed chunks that comparing its two leaf entries
    gives (statuses of every kind, chunked and packed leaves, other chunk sizes)."""

    rng = np.random.default_rng(4)
    big = rng.standard_normal((64, 256)).astype(np.float32)  # 64 KiB: 16 chunks of 4 KiB
    a = {
        "big": big,
        "rows": big.copy(),
        "same": big[:8].copy(),
        "small": np.arange(6, dtype=np.int32),
        "retyped": np.zeros(4, np.float32),
        "same_bytes": np.ones(4, np.int32),
        "reshaped": np.zeros((2, 3)),
        "n": 3,
        "gone": 1.0,
    }
    b = dict(a)
    b["big"] = big + 1  # every chunk
    rows = big.copy()
    rows[10] += 1  # one chunk of 16
    b["rows"] = rows
    b["small"] = np.arange(6, dtype=np.int32) * 2
    b["retyped"] = np.zeros(4, np.float16)
    b["same_bytes"] = np.ones(4, np.int32).view(np.float32)  # another dtype, the same bytes
    b["reshaped"] = np.zeros((3, 2))
    b["n"] = 4
    del b["gone"]
    b["new"] = "x"
    url = str(tmp_path / "s")
    opts = treestore.SaveOptions(chunk_size=4096, small_leaf=1024)
    treestore.save(url, a, "a", options=opts)
    treestore.save(url, b, "b", options=opts)
    treestore.save(
        url, {**b, "rows": rows}, "c", options=treestore.SaveOptions(chunk_size=8192, small_leaf=1024)
    )  # layout
    for x, y in (("a", "b"), ("b", "c"), ("a", "c")):
        d = treestore.diff(f"{url}#{x}", f"{url}#{y}")
        ea = {e.address: e for e in treestore.Store(url).manifest(x).leaves}
        eb = {e.address: e for e in treestore.Store(url).manifest(y).leaves}
        for leaf in d.leaves:
            if leaf.address not in ea or leaf.address not in eb:
                assert leaf.status == ("added" if leaf.address not in ea else "removed")
                continue
            status, frac = _reference(ea[leaf.address], eb[leaf.address])
            if status == "cut":  # equal types cut into other chunks: the bytes decide
                same = (
                    treestore.load(url, x)[leaf.address].tobytes()
                    == treestore.load(url, y)[leaf.address].tobytes()
                )
                status, frac = ("unchanged" if same else "changed"), None
            assert (leaf.status, leaf.chunks_changed) == (status, frac), leaf
            assert (leaf.a, leaf.b) == (_described(ea[leaf.address]), _described(eb[leaf.address]))
    d = treestore.diff(f"{url}#a", f"{url}#b")
    assert d.by_status("changed") and dict((x.address, x.chunks_changed) for x in d)["rows"] == 1 / 16


@pytest.mark.parametrize(
    ("a", "b", "rel", "nonfinite_changed"),
    [
        ([np.inf, 1, 2], [np.inf, 5, 2], 4 / math.sqrt(5), 0),  # was 0.0: ||a|| = inf
        ([np.nan, 1, 2], [np.nan, 5, 2], 4 / math.sqrt(5), 0),  # was NaN
        ([-np.inf, 3, 4], [np.nan, 3, 4], 0.0, 1),  # only a non-finite element changed
        ([1, 3, 4], [1, 3, np.inf], 0.0, 1),
        ([1e200, 0, 0], [2e200, 0, 0], 1.0, 0),  # squares that overflow a float64
        ([1e-200, 0, 0], [3e-200, 0, 0], 2.0, 0),  # and underflow it
        ([0.0, np.nan, 0], [1.0, np.nan, 0], math.inf, 0),  # a is zero where finite
    ],
)
def test_rel_l2_is_measured_over_the_elements_finite_in_both(store_url, a, b, rel, nonfinite_changed):
    """A leaf holding inf used to show every change as 0.0, one holding NaN as NaN (absent in a
    timeline); the non-finite elements that changed are counted on their own."""
    store = treestore.Store(store_url)
    store.save({"x": np.array(a, np.float64)}, "a")
    store.save({"x": np.array(b, np.float64)}, "b")
    d = treestore.diff(f"{store_url}#a", f"{store_url}#b", values=True)
    (x,) = list(d)
    assert x.change.rel_l2 == pytest.approx(rel, rel=1e-12)
    assert x.change.nonfinite_changed == nonfinite_changed
    assert d.to_json()["leaves"][0]["change"]["nonfinite_changed"] == nonfinite_changed
    if nonfinite_changed:
        assert f", {nonfinite_changed} changed" in d.table()


def test_diff_of_leaves_saved_in_pieces_agrees_with_the_entries_and_with_numpy(tmp_path):
    """Leaves sharded over 8 devices (saved in pieces): a change in one shard is told apart chunk
    by chunk as the entry-by-entry rule tells it, its statistics equal numpy's, and the same
    values saved whole (another layout) are compared by their bytes."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS in conftest)")
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    sharding = NamedSharding(mesh, P("a", "b"))
    w = np.random.default_rng(0).standard_normal((256, 96)).astype(np.float32)
    v = w.copy()
    v[40:44, 30:34] += 1.0  # inside one shard of 64 x 48 (three chunks of 4 KiB)
    url = str(tmp_path / "s")
    opts = treestore.SaveOptions(chunk_size=4096, small_leaf=16)
    treestore.save(
        url, {"w": jax.device_put(w, sharding), "same": jax.device_put(w, sharding)}, "a", options=opts
    )
    treestore.save(
        url, {"w": jax.device_put(v, sharding), "same": jax.device_put(w, sharding)}, "b", options=opts
    )
    treestore.save(url, {"w": v, "same": w}, "whole", options=opts)
    ea = {e.address: e for e in treestore.Store(url).manifest("a").leaves}
    eb = {e.address: e for e in treestore.Store(url).manifest("b").leaves}
    assert all(e.pieces for e in ea.values())
    for values in (False, True):
        d = treestore.diff(f"{url}#a", f"{url}#b", values=values)
        got = {x.address: x for x in d.leaves}
        assert (got["w"].status, got["w"].chunks_changed) == _reference(ea["w"], eb["w"])
        assert 0 < got["w"].chunks_changed < 1 and got["same"].status == "unchanged"
        if values:
            assert got["w"].change.rel_l2 == pytest.approx(
                np.linalg.norm(v - w) / np.linalg.norm(w), rel=1e-6
            )
            assert got["w"].change.frac_changed == pytest.approx(16 / w.size)
    d = {x.address: x for x in treestore.diff(f"{url}#b", f"{url}#whole", values=True).leaves}
    assert (d["w"].status, d["w"].chunks_changed, d["same"].status) == ("unchanged", None, "unchanged")


def test_a_diff_of_values_reports_progress_chunk_by_chunk():
    url = f"memory://diff-progress/{uuid.uuid4().hex}"
    w = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
    options = treestore.SaveOptions(chunk_size=256 * 1024)
    treestore.save(url, {"w": w, "same": np.ones(1000)}, "a", options=options)
    treestore.save(url, {"w": w * 2, "same": np.ones(1000)}, "b", options=options)
    calls: list[tuple[int, int]] = []
    d = treestore.diff(
        f"{url}#a", f"{url}#b", values=True, progress=lambda done, total: calls.append((done, total))
    )
    assert d.changed == ("w",)
    assert calls[0] == (0, 2 * w.nbytes) and calls[-1] == (2 * w.nbytes, 2 * w.nbytes)
    assert len(calls) == 17 and [c for c, _ in calls] == sorted(c for c, _ in calls)
    treestore.diff(f"{url}#a", f"{url}#b", progress=lambda done, total: calls.append((-1, -1)))
    assert calls[-1] != (-1, -1)  # manifests alone: nothing to report


def test_the_table_marks_a_leaf_that_gained_a_nan_and_leaves_finite_leaves_blank():
    """A leaf that gained one NaN is marked `!` with its counts (it showed "max abs inf, rel L2
    0" and an empty bar, easy to read as unchanged); a finite leaf shows no NaN/Inf counts (it
    showed "NaN 0->0, Inf 0->0")."""
    url = f"memory://diff-nan/{uuid.uuid4().hex}"
    treestore.save(url, {"w": np.ones(100, np.float32), "v": np.arange(10.0)}, "a")
    w = np.ones(100, np.float32)
    w[3] = np.nan
    treestore.save(url, {"w": w, "v": np.arange(10.0) * 1.1}, "b")
    lines = treestore.diff(f"{url}#a", f"{url}#b", values=True).table().splitlines()
    row = {line.split()[1]: line for line in lines if line.startswith("~")}
    assert row["w"].endswith("NaN 0->1, 1 changed   !")
    assert "NaN" not in row["v"] and "Inf" not in row["v"] and row["v"].endswith("█")
    assert lines[-1].startswith("!: elements changed to, from or between NaN and ±inf")
    finite = treestore.diff(f"{url}#a", f"{url}#a", values=True).table()
    assert "!:" not in finite
