"""Per-leaf statistics recorded at save (the optional ``stats`` column of a version-2 manifest):
equal to an independent numpy reference, exact across chunks, packs and processes, optional, and
read as hostile input."""

from __future__ import annotations

import math

import ml_dtypes
import msgpack
import numpy as np
import pytest

import treestore
from tests.support.jobs import prepared, rows, run_job
from treestore._api.checkpoint import Checkpoint
from treestore._engine.group import stats_gather
from treestore._engine.group.group_runtime import LocalRuntime
from treestore._engine.reading import committed as _committed
from treestore._engine.write import SaveOptions
from treestore._format.manifest.codec import decode_any, decode_columns, encode_columns
from treestore._format.stats import STATS_DTYPE
from treestore._tree.prepare import prepare

SMALL = SaveOptions(chunk_size=4096, small_leaf=1024, pack_size=4096, threads=2)


def reference(x: np.ndarray) -> tuple[int, int, int, object, object, float]:
    """NaN, +inf, -inf counts, finite min and max, L2 norm: computed the plain way, in float64."""
    x = np.asarray(x)
    if x.dtype.kind == "c":  # its real and imaginary parts, as real numbers
        x = np.stack([x.real, x.imag], axis=-1)
    if x.dtype.kind in "iub":
        ints = x.astype(np.int64 if x.dtype.kind != "u" else np.uint64).ravel()
        lo = int(ints.min()) if ints.size else None
        hi = int(ints.max()) if ints.size else None
        if x.dtype == np.bool_:
            lo, hi = (None, None) if lo is None else (bool(lo), bool(hi))
        return 0, 0, 0, lo, hi, math.sqrt(float(np.sum(ints.astype(np.float64) ** 2)))
    f = x.astype(np.float64).ravel()
    fin = f[np.isfinite(f)]
    lo = float(fin.min()) if fin.size else None
    hi = float(fin.max()) if fin.size else None
    counts = int(np.isnan(f).sum()), int((f == np.inf).sum()), int((f == -np.inf).sum())
    with np.errstate(over="ignore"):
        return *counts, lo, hi, math.sqrt(float(np.sum(fin**2)))


def as_tuple(s: treestore.types.ValueStats) -> tuple[int, int, int, object, object, float]:
    return s.nan, s.posinf, s.neginf, s.min, s.max, s.l2


def check(got: treestore.types.ValueStats, x: np.ndarray) -> None:
    want = reference(x)
    assert as_tuple(got)[:5] == want[:5], (got, want)
    assert got.l2 == pytest.approx(want[5], rel=1e-12, abs=1e-300)
    assert got.size == np.asarray(x).size


def values() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    w = rng.standard_normal((300, 40)).astype(np.float32)  # 48 KB: 12 chunks of 4 KiB
    w[17, 3] = np.nan
    w[250, 0] = np.inf
    w[299, 39] = -np.inf
    w[100] = np.nan  # a whole row, across a chunk boundary
    return {
        "f32": w,
        "f64": rng.standard_normal(5000) * 1e160,  # squares overflow float64: the norm is inf
        "f16": rng.standard_normal(3000).astype(np.float16),
        "bf16": np.concatenate([rng.standard_normal(4000), [np.nan, -np.inf]]).astype(ml_dtypes.bfloat16),
        "f8": rng.standard_normal(5000).astype(ml_dtypes.float8_e4m3fn),
        "i8": rng.integers(-128, 128, 9000).astype(np.int8),
        "i64": np.array([-(2**63), 2**63 - 1, 0, 5] * 600, np.int64),
        "u64": np.array([0, 2**64 - 1, 7] * 700, np.uint64),
        "int4": rng.integers(-8, 8, 5000).astype(ml_dtypes.int4),
        "bool": rng.integers(0, 2, 7000).astype(bool),
        "small": np.array([1.5, -2.0, np.nan], np.float32),  # packed
        "small_int": np.arange(-3, 9, dtype=np.int16),  # packed
        "empty": np.zeros((0, 4), np.float32),
        "all_nan": np.full(2000, np.nan, np.float32),
        "inf_only": np.array([np.inf, -np.inf, np.inf]),
        "f32_big": rng.standard_normal(20000).astype(np.float32) * 3e18,  # float32 squares overflow
        "c64": _complex(rng, 3000, np.complex64),  # NaN and inf in either part, across chunks
        "c128": _complex(rng, 700, np.complex128),
        "c_small": np.array([1 + 2j, np.nan + 1j, 3 - np.inf * 1j], np.complex64),  # packed
    }


def _complex(rng: np.random.Generator, n: int, dtype: type) -> np.ndarray:
    z = (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dtype)
    z[5] = complex(np.nan, 1.0)
    z[n // 2] = complex(2.0, np.inf)
    z[n - 1] = complex(-np.inf, np.nan)
    return z


@pytest.mark.parametrize("options", [SMALL, SaveOptions()], ids=["many-chunks", "defaults"])
def test_stats_equal_an_independent_numpy_reference(options):
    tree = {
        **values(),
        "scalar": 2.5,
        "scalar_nan": float("nan"),
        "n": 3,
        "flag": True,
        "c": np.ones(3, complex),
        "c_finite": np.array([3 + 4j, 0j], np.complex64),
    }
    store = treestore.Store(f"memory://stats/ref-{options.chunk_size}")
    store.save(tree, "a", options=options)
    got = store.open("a").stats()
    for address, x in values().items():
        check(got[address], x)
    assert got["f64"].l2 == math.inf and got["f64"].healthy
    assert got["empty"].min is None and got["empty"].size == 0 and got["empty"].healthy
    assert (got["all_nan"].nan, got["all_nan"].min, got["all_nan"].l2) == (2000, None, 0.0)
    assert (got["scalar"].min, got["scalar"].l2) == (2.5, 2.5)
    assert got["scalar_nan"].nan == 1 and not got["scalar_nan"].healthy
    assert (got["n"].max, got["flag"].max) == (3, True)
    assert (got["c"].l2, got["c"].min, got["c"].max) == (math.sqrt(3), 0.0, 1.0)  # parts 1, 0
    assert got["c_finite"].l2 == 5.0 and got["c_finite"].healthy and got["c_finite"].finite == 4
    assert got["c64"].nonfinite == 4 and not got["c64"].healthy
    assert got["bool"].dtype == "bool" and got["bool"].max is True


def test_stats_select_healthy_and_nonfinite():
    store = treestore.Store("memory://stats/select")
    store.save({"a": {"w": np.ones(3), "b": np.array([np.nan])}, "c": np.zeros(2)}, "x")
    store.save({"a": {"w": np.ones(3)}}, "y")
    ckpt = store.open("x")
    assert list(ckpt.stats("a/*")) == ["a/b", "a/w"]
    assert ckpt.healthy is False and ckpt.nonfinite() == ["a/b"]
    assert store.open("y").healthy is True and store.open("y").nonfinite() == []
    store.save({"w": np.ones(3)}, "off", options=SaveOptions(stats=False))
    off = store.open("off")
    assert off.stats() == {} and off.healthy is None
    assert b"stats" not in manifest_record(store, "off")


def manifest_record(store: treestore.Store, name: str) -> dict:
    data = _committed.read_manifest_bytes(store._storage, _committed.read_commit_record(store._storage, name))
    return msgpack.unpackb(data, raw=False)


def test_a_manifest_with_stats_reencodes_byte_exact():
    store = treestore.Store("memory://stats/exact")
    store.save(values(), "a", options=SMALL)
    data = _committed.read_manifest_bytes(store._storage, _committed.read_commit_record(store._storage, "a"))
    columns = decode_any(data, "a")
    assert columns.stats is not None and encode_columns(columns) == data


def test_a_copy_keeps_the_statistics_renamed_or_not():
    store = treestore.Store("memory://stats/copy-src")
    store.save({"w": np.array([np.nan, 2.0])}, "a")
    treestore.copy("memory://stats/copy-src#a", "memory://stats/copy-dst")
    treestore.copy("memory://stats/copy-src#a", "memory://stats/copy-dst#renamed")
    for name in ("a", "renamed"):
        assert treestore.open(f"memory://stats/copy-dst#{name}").nonfinite() == ["w"]


def test_pieces_of_a_multi_process_save_combine_exactly():
    """Each process measures the pieces it owns; the primary combines them with its own records
    of the leaves that are not sharded, and readers see the whole leaf's statistics."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    w[5, 5] = np.nan  # process 0's rows
    w[40, 1] = -np.inf  # process 1's
    w[63, 31] = 1e6  # the largest, in process 1's last piece
    v = rng.integers(-1000, 1000, 128).astype(np.int32)
    tree = {"w": w, "v": v, "r": rng.standard_normal(10), "s": np.array([np.inf, 1.0], np.float32)}
    boxes = {"w": rows(64, 2, 32), "v": rows(128, 2)}
    storage = treestore.Store("memory://stats/job")._storage
    results = run_job(storage, [prepared(tree, boxes, i) for i in range(2)], "job", options=SMALL)
    assert not any(isinstance(r, BaseException) for r in results), results
    got = treestore.open("memory://stats/job#job").stats()
    for address, x in tree.items():
        check(got[address], x)
    assert treestore.open("memory://stats/job#job").nonfinite() == ["s", "w"]


def test_a_process_without_statistics_leaves_the_sharded_leaves_unknown():
    w = np.arange(64.0).reshape(16, 4)
    storage = treestore.Store("memory://stats/job-off")._storage
    trees = [prepared({"w": w, "r": np.ones(3)}, {"w": rows(16, 2, 4)}, i) for i in range(2)]
    run_job(storage, trees, "job", options=SMALL)
    assert set(treestore.open("memory://stats/job-off#job").stats()) == {"w", "r"}


def test_a_job_of_many_processes_gathers_statistics_up_a_tree_exactly():
    """40 processes: the primary combines the records of processes 1-16, each of which has
    combined its own children's first (17-39); every element counted once, extremes in any
    process's rows found."""
    count = 40
    assert max(stats_gather.children(1, count)) > 16  # the tree is two steps deep here
    rng = np.random.default_rng(5)
    w = rng.standard_normal((count * 2, 3))
    w[2 * 33, 1] = np.nan  # a grandchild's rows
    w[2 * 39 + 1, 2] = 1e9  # the last process's
    w[2 * 17, 0] = -np.inf
    v = rng.integers(-(2**40), 2**40, count * 4)
    v[4 * 25 + 3] = -(2**62)
    tree = {"w": w, "v": v, "r": np.arange(5.0)}
    boxes = {"w": rows(count * 2, count, 3), "v": rows(count * 4, count)}
    storage = treestore.Store("memory://stats/tree")._storage
    options = SaveOptions(threads=1)
    results = run_job(storage, [prepared(tree, boxes, i) for i in range(count)], "job", options=options)
    assert not any(isinstance(r, BaseException) for r in results), results
    got = treestore.open("memory://stats/tree#job").stats()
    for address, x in tree.items():
        check(got[address], x)


@pytest.mark.parametrize("count", [1, 2, 16, 17, 40, 300, 4097])
def test_every_process_but_the_primary_has_one_parent_that_lists_it(count):
    seen = [i for p in range(count) for i in stats_gather.children(p, count)]
    assert sorted(seen) == list(range(1, count))
    assert all(i in stats_gather.children(stats_gather.parent(i), count) for i in range(1, count))


@pytest.mark.parametrize("sent", ["!!not base64", "AAAA", ""], ids=["not-base64", "short", "none"])
def test_a_child_sending_bad_records_leaves_the_sharded_leaves_unknown_and_the_save_commits(sent):
    """Statistics are advisory: records lost or damaged on the way up make the sharded leaves
    unknown; the leaves that are not sharded keep theirs and the checkpoint commits."""
    runtime = LocalRuntime(3)
    real = runtime.set

    def damaged(key: str, value: str) -> None:
        real(key, sent if "/stats/0/2" in key else value)

    runtime.set = damaged  # type: ignore[method-assign]
    w = np.arange(48.0).reshape(12, 4)
    storage = treestore.Store(f"memory://stats/bad-child-{len(sent)}")._storage
    trees = [prepared({"w": w, "r": np.array([np.nan, 1.0])}, {"w": rows(12, 3, 4)}, i) for i in range(3)]
    results = run_job(storage, trees, "job", runtime=runtime, options=SMALL)
    assert not any(isinstance(r, BaseException) for r in results), results
    got = treestore.open(f"memory://stats/bad-child-{len(sent)}#job").stats()
    assert set(got) == {"r"} and got["r"].nan == 1
    assert treestore.open(f"memory://stats/bad-child-{len(sent)}#job")["w"][...].tolist() == w.tolist()


# --- hostile records ------------------------------------------------------------------------------
def tampered(change) -> tuple[Checkpoint, object]:
    """A manifest saved with statistics, its ``stats`` field changed by ``change`` (given the
    decoded record and the column), decoded as a reader decodes it."""
    store = treestore.Store("memory://stats/hostile")
    tree = {
        "w": np.array([1.0, -2.0, np.nan]),
        "i": np.arange(10, dtype=np.int8),
        "x": np.ones(4, np.float32),
        "z": np.array([complex(np.nan, np.nan), complex(np.nan, 1), 3 + 4j], np.complex64),
    }
    store.save(tree, "a", overwrite=True)
    rec = manifest_record(store, "a")
    table = np.frombuffer(rec["stats"], STATS_DTYPE).copy()
    rec["stats"] = change(rec, table)
    columns = decode_columns(msgpack.packb(rec, use_bin_type=True), "a")
    return Checkpoint(store._storage, columns), columns


@pytest.mark.parametrize(
    "stats",
    [b"", b"\x00" * 48, "text", 7, [1, 2], None],
    ids=["empty", "short", "str", "int", "list", "nil"],
)
def test_a_stats_field_of_the_wrong_size_or_type_is_ignored_and_the_rest_read(stats):
    ckpt, columns = tampered(lambda rec, table: stats)
    assert columns.stats is None and ckpt.stats().keys() == set()
    assert ckpt.healthy is None  # unknown, never healthy nor unhealthy because of it
    assert (columns.stats_note is None) == (stats is None)
    assert np.array_equal(np.asarray(ckpt["x"]), np.ones(4, np.float32))  # the rest is read


def _set(address: str, **fields):
    def change(rec, table):
        index = sorted(["w", "i", "x", "z"]).index(address)  # leaves in jax's order: sorted keys
        for key, value in fields.items():
            table[key][index] = value
        return table.tobytes()

    return change


@pytest.mark.parametrize(
    "address, fields",
    [
        ("w", {"sumsq": -1.0}),  # a negative norm
        ("w", {"sumsq": float("nan")}),
        ("w", {"nan": 4}),  # more NaNs than elements
        ("w", {"nan": 2**64 - 1, "posinf": 2}),  # counts that overflow when added
        ("w", {"min": np.float64(3.0).view(np.int64)}),  # min above max
        ("w", {"max": np.float64(np.inf).view(np.int64)}),  # an infinite "finite" maximum
        ("w", {"sumsq": 1e9}),  # more than every element at the maximum
        ("i", {"nan": 1}),  # an int8 leaf with NaNs
        ("i", {"max": 1000}),  # outside int8
        ("i", {"kind": 1}),  # a float record for an int8 leaf
        ("x", {"kind": 9}),  # no such kind
        ("z", {"nan": 7}),  # more NaN parts than a 3-element complex leaf has parts
        ("z", {"kind": 1}),  # a float record for a complex leaf
        ("w", {"kind": 4}),  # a complex record for a float leaf
    ],
)
def test_a_record_that_makes_no_sense_is_ignored_alone(address, fields):
    ckpt, columns = tampered(_set(address, **fields))
    stats = ckpt.stats()
    assert address not in stats and len(stats) == 3, stats
    assert "statistics of 1 leaves ignored" in columns.stats_note


def test_a_sound_record_still_reads_after_the_check():
    ckpt, columns = tampered(lambda rec, table: table.tobytes())
    assert columns.stats_note is None
    assert ckpt.nonfinite() == ["w", "z"] and as_tuple(ckpt.stats()["w"])[:5] == (1, 0, 0, -2.0, 1.0)
    z = ckpt.stats()["z"]  # 3 NaN parts of 6: more than its 3 elements, as parts may be
    assert as_tuple(z)[:5] == (3, 0, 0, 1.0, 4.0) and z.finite == 3 and z.l2 == math.sqrt(26)


def test_statistics_cost_no_pass_over_a_leaf_the_save_does_not_measure():
    """PRNG key data has no statistics (its record is unknown): a checkpoint of keys alone is
    healthy (key data cannot hold NaN); complex leaves are measured by their parts."""
    import jax

    tree = {"key": jax.random.key(0), "c": np.ones(4, np.complex64)}
    p = prepare(tree)
    store = treestore.Store("memory://stats/keys")
    from treestore._engine.write import write

    write(store._storage, p, "k")
    assert list(store.open("k").stats()) == ["c"] and store.open("k").healthy is True
    write(store._storage, prepare({"key": jax.random.key(0)}), "keys-only")
    assert store.open("keys-only").healthy is True  # key data cannot hold NaN


# --- readers: manifests only ----------------------------------------------------------------------
def run_cli(*args: str):
    from click.testing import CliRunner

    from treestore_cli.main import cli

    return CliRunner().invoke(cli, list(args))


def diverging_run(url: str) -> None:
    """Five checkpoints; ``opt/mu`` turns NaN at step-3, ``w`` inf at step-4, step-5 has none."""
    store = treestore.Store(url)
    for step in range(1, 6):
        mu = np.full(3000, float(step), np.float32)  # chunks of their own: reads would show
        w = np.ones(4000)
        if step >= 3:
            mu[7] = np.nan
        if step >= 4:
            w[0] = np.inf
        options = SaveOptions(stats=step != 5)
        store.save({"opt": {"mu": mu}, "w": w, "loss": float(step)}, f"step-{step}", options=options)


def test_stats_show_ls_and_health_read_no_chunk():
    import json
    import uuid

    from tests.support.counting import CountingFileSystem

    url = f"counting://stats/{uuid.uuid4().hex}"
    diverging_run(url)
    CountingFileSystem.reset()
    assert treestore.open(f"{url}#step-4").nonfinite() == ["opt/mu", "w"]
    assert treestore.open(f"{url}#step-3").stats("opt/*")["opt/mu"].nan == 1
    shown = run_cli("show", "--stats", f"{url}#step-3")
    assert shown.exit_code == 0 and "from the manifest alone (NaN/inf in opt/mu)" in shown.output
    assert (
        json.loads(run_cli("show", "--stats", "--json", f"{url}#step-3", "w").output)["leaves"][0]["nan"] == 0
    )
    health = run_cli("health", url)
    assert health.exit_code == 1, health.output
    data = json.loads(run_cli("health", "--json", url).output)
    assert data["first_nonfinite"] == {"opt/mu": "step-3", "w": "step-4"}
    assert [c["healthy"] for c in data["checkpoints"]] == [True, True, False, False, None]
    assert json.loads(run_cli("health", "--json", url, "w").output)["first_nonfinite"] == {"w": "step-4"}
    assert CountingFileSystem.bytes_read("chunks") == 0  # ls reads no chunk either, but lists them
    listed = run_cli("ls", url)
    assert "step-3 !" in listed.output and "NaN/inf: step-4: opt/mu, w" in listed.output
    rows = json.loads(run_cli("ls", "--json", url).output)["checkpoints"]
    assert [r["nonfinite"] for r in rows][2:] == [["opt/mu"], ["opt/mu", "w"], []]
    norms = run_cli("timeline", "--norms", url)
    assert norms.exit_code == 0 and "manifests only" in norms.output
    assert CountingFileSystem.bytes_read("chunks") == 0


def test_norms_over_a_run_equal_numpy_and_pool_groups():
    """Store.norms: each leaf's L2 norm of its finite elements at each checkpoint, from the
    manifests (equal to numpy's), NaN where absent or saved without statistics, NaN/inf
    counted apart; groups pool as the root of the sum of their leaves' squared norms."""
    url = "memory://stats/norms-run"
    diverging_run(url)
    t = treestore.Store(url).norms()
    assert t.checkpoints == tuple(f"step-{s}" for s in range(1, 6)) and t.addresses == ("opt/mu", "w")
    for j, step in enumerate(range(1, 5)):
        mu = np.full(3000, float(step), np.float64)
        if step >= 3:
            mu[7] = 0.0  # the NaN is left out of the norm
        w = np.ones(4000)
        if step >= 4:
            w[0] = 0.0
        assert t.values[0][j] == pytest.approx(np.linalg.norm(mu), rel=1e-12)
        assert t.values[1][j] == pytest.approx(np.linalg.norm(w), rel=1e-12)
    assert [math.isnan(row[4]) for row in t.values] == [True, True]  # step-5: saved without them
    assert t.nonfinite == ((0, 0, 1, 1, 0), (0, 0, 0, 1, 0))
    pooled = treestore.Store(url).norms(depth=1, select="**")
    assert pooled.addresses == ("opt", "w") and pooled.values[0][0] == t.values[0][0]
    rows = t.heatmap(ascii=True).splitlines()[1:]
    assert [r.split()[1] for r in rows] == ["-+!!x", "@@@!x"]  # ! NaN/inf, x no statistics
    assert t.to_json()["rows"][0]["values"][4] == "nan"


def test_health_of_a_store_without_statistics_is_unknown(tmp_path):
    treestore.save(str(tmp_path), {"w": np.array([np.nan])}, "a", options=SaveOptions(stats=False))
    out = run_cli("health", str(tmp_path))
    assert out.exit_code == 0 and "unknown" in out.output and "show NaN/inf" in out.output


def test_derive_keeps_the_base_statistics_and_measures_what_it_sets():
    """A derived checkpoint has statistics like any save: a kept leaf keeps the base's (moved
    with it when renamed), a set leaf is measured; from a base saved without statistics, only
    the set leaves have them."""
    store = treestore.Store("memory://stats/derive")
    w = np.array([3.0, np.nan, 4.0])
    store.save({"enc": {"w": w}, "head": np.ones(2), "step": 3}, "base")
    store.derive("base", "new", set={"head": np.full(3, 2.0)}, rename={"enc": "encoder"})
    got = store.open("new").stats()
    assert (got["encoder/w"].nan, got["encoder/w"].l2) == (1, 5.0)
    assert got["head"].l2 == pytest.approx(np.sqrt(12.0)) and got["step"].max == 3
    assert store.open("new").healthy is False
    store.save({"a": np.ones(4), "b": np.ones(1)}, "plain", options=SaveOptions(stats=False))
    store.derive("plain", "plain2", set={"b": np.full(4, 2.0)})
    assert set(store.open("plain2").stats()) == {"b"}


def test_small_leaves_sharing_packs_are_each_measured_exactly():
    """Small leaves are measured in the pack they share: runs of leaves of one dtype at once,
    NaN and inf among them, other dtypes between them, a leaf split by a pack boundary."""
    rng = np.random.default_rng(11)
    tree: dict[str, np.ndarray] = {}
    for i in range(400):
        x = rng.standard_normal(int(rng.integers(1, 3000))).astype(np.float32) * 10.0 ** int(
            rng.integers(-3, 4)
        )
        if i % 37 == 5:
            x[int(rng.integers(x.size))] = [np.nan, np.inf, -np.inf][i % 3]
        tree[f"f{i:03d}"] = x
        if i % 50 == 7:
            tree[f"i{i:03d}"] = rng.integers(-(2**15), 2**15, int(rng.integers(1, 500))).astype(np.int16)
        if i % 60 == 3:
            tree[f"b{i:03d}"] = rng.standard_normal(int(rng.integers(1, 900))).astype(ml_dtypes.bfloat16)
    store = treestore.Store("memory://stats/packs")
    store.save(tree, "a")
    got = store.open("a").stats()
    for address, x in tree.items():
        check(got[address], x)


def test_small_leaves_take_no_record_object_each(monkeypatch):
    """The statistics of leaves packed whole go from their packs' measurements into the manifest
    as columns: no record is made or combined per leaf (at 100k leaves those Python objects
    cost a quarter of the save), and each leaf still gets its own, a PRNG key's unknown."""
    import jax

    from treestore._format import stats as _stats

    made = {"combine": 0, "records": 0}
    for name in made:
        real = getattr(_stats, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            made[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(_stats, name, counted)
    tree = {f"w{i:04d}": np.full(3, i - 1000, np.float32) for i in range(2000)}
    tree["n"], tree["key"], tree["i"] = np.arange(5, dtype=np.int8), jax.random.key(1), 7
    store = treestore.Store("memory://stats/per-leaf")
    store.save(tree, "a")
    assert made == {"combine": 0, "records": 0}
    got = store.open("a").stats()
    for address in ("w0000", "w1999", "n"):
        check(got[address], tree[address])
    assert "key" not in got and got["i"].max == 7


@pytest.mark.parametrize(
    "dtype", ["float32", "float64", "float16", "bfloat16", "int8", "uint64", "bool", "int4"]
)
def test_measuring_segments_at_once_equals_measuring_each(dtype):
    from treestore._format.stats import measure, measure_segments, records

    rng = np.random.default_rng(3)
    np_dtype = np.dtype(getattr(ml_dtypes, dtype, dtype))
    if np_dtype.kind == "f" or dtype == "bfloat16":
        values = (rng.standard_normal(5000) * 100).astype(np_dtype)
    else:
        info = np.iinfo(np.int8 if dtype == "int4" else np_dtype) if dtype != "bool" else None
        lo, hi = (0, 2) if info is None else (-8, 8) if dtype == "int4" else (info.min, info.max)
        values = rng.integers(lo, hi, 5000, dtype=np.int64 if dtype != "uint64" else np.uint64).astype(
            np_dtype
        )
    starts = np.unique(np.concatenate([[0], rng.integers(1, 5000, 60)]))
    ends = [*starts[1:].tolist(), values.size]
    each = [measure(values[a:b]) for a, b in zip(starts.tolist(), ends, strict=True)]
    at_once = records(measure_segments(values, starts))
    assert [r[:6] for r in at_once] == [r[:6] for r in each]
    assert [r[6] for r in at_once] == pytest.approx([r[6] for r in each], rel=1e-12)
    if np_dtype.kind == "f" or dtype == "bfloat16":  # a NaN in one segment: each measured alone
        values[int(starts[3])] = np.nan
        assert records(measure_segments(values, starts))[3] == measure(values[starts[3] : starts[4]])


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "float8_e4m3fn", "int32"])
@pytest.mark.parametrize("bad", [None, "nan", "inf"])
def test_a_chunk_of_several_spans_is_measured_exactly(dtype, bad):
    """A chunk longer than the span measured at a time (whole rows, a rest shorter than a row,
    narrow floats converted span by span): equal to the reference, a NaN or inf in a later span
    included."""
    from treestore._format.stats import FLOAT, INT, ROW, SPAN, measure

    np_dtype = np.dtype(getattr(ml_dtypes, dtype, dtype))
    x = (np.random.default_rng(5).standard_normal(2 * SPAN + ROW + 3) * 50).astype(np_dtype)
    if bad is not None and np_dtype.kind != "i":
        x[SPAN + 7] = np.nan if bad == "nan" else np.inf
        x[-1] = -np.inf
    kind, nan, posinf, neginf, lo, hi, sumsq = measure(x)
    want = reference(x)
    assert kind == (INT if np_dtype.kind == "i" else FLOAT)
    assert (nan, posinf, neginf, lo, hi) == want[:5]
    assert math.sqrt(sumsq) == pytest.approx(want[5], rel=1e-12)


def test_health_names_a_damaged_manifest_and_reports_the_rest(tmp_path):
    """One manifest overwritten with garbage: ``treestore health`` still reports every other
    checkpoint, names the damaged one and exits 1 (it gave up with exit 2 and one line)."""
    import json

    from tests.support import hostile

    url = str(tmp_path / "run")
    diverging_run(url)
    hostile.damage_manifest(url, "step-2")
    out = run_cli("health", url)
    assert out.exit_code == 1, out.output
    assert "damaged: step-2:" in out.output and "first held NaN/inf" in out.output
    data = json.loads(run_cli("health", "--json", url).output)
    assert [c["healthy"] for c in data["checkpoints"]] == [True, None, False, False, None]
    assert "problem" in data["checkpoints"][1] and data["first_nonfinite"] == {
        "opt/mu": "step-3",
        "w": "step-4",
    }
    healthy = treestore.Store(url)
    healthy.delete("step-3")
    healthy.delete("step-4")
    assert run_cli("health", url).exit_code == 1  # a damaged checkpoint alone is reason enough


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("size", [1, 7, 8, 9, 17, 4099])
@pytest.mark.parametrize("case", ["normal", "zeros", "extremes", "nan", "inf", "all-nan"])
def test_the_compiled_and_the_numpy_statistics_are_the_same_record(monkeypatch, dtype, size, case):
    """Records do not depend on whether the compiled part was built: minima, maxima and counts are
    equal, sums of squares equal to float64 rounding, for every tail length of the eight-element
    steps, signed zeros, subnormals and the largest finite values, NaN and infinities anywhere."""
    from treestore._format import stats
    from treestore._kernels import float_pass

    if float_pass.COMPILED is None:
        pytest.skip("no compiled part in this install: only the numpy path exists")
    np_dtype = np.dtype(getattr(ml_dtypes, dtype, dtype))
    x = (np.random.default_rng(size).standard_normal(size) * 2).astype(np_dtype)
    if case == "zeros":
        x[:] = 0
        x[::2] = -0.0
    elif case == "extremes":
        info = ml_dtypes.finfo(np_dtype)
        x[0], x[-1] = info.max, -info.max
        x[size // 2] = info.smallest_subnormal
    elif case == "nan":
        x[size - 1] = np.nan
    elif case == "inf":
        x[0], x[size // 2] = np.inf, -np.inf
    elif case == "all-nan":
        x[:] = np.nan
    fast = stats.measure(x)
    monkeypatch.setattr(float_pass, "COMPILED", None)
    slow = stats.measure(x)
    assert fast[:6] == slow[:6]
    assert fast[6] == pytest.approx(slow[6], rel=1e-12, abs=1e-300)
    assert fast == (*reference_record(x)[:6], fast[6])


def reference_record(x):
    """(kind, nan, posinf, neginf, min, max) of float ``x`` by plain numpy in float64."""
    from treestore._format.stats import FLOAT

    w = x.astype(np.float64)
    finite = w[np.isfinite(w)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (math.inf, -math.inf)
    return (FLOAT, int(np.isnan(w).sum()), int((w == np.inf).sum()), int((w == -np.inf).sum()), lo, hi)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_save_measures_each_float_chunk_in_one_compiled_pass(monkeypatch, tmp_path, dtype):
    """A regression counter, not a timing: a save of a float32 or bfloat16 leaf of several chunks
    makes one compiled pass per chunk and none of numpy's (its float64 sums of squares), and the
    leaf's record is the numpy reference's."""
    from treestore._format import stats
    from treestore._kernels import float_pass

    fn = float_pass.COMPILED or pytest.skip("no compiled part in this install")
    passes, sums = [], []
    monkeypatch.setattr(float_pass, "COMPILED", lambda x, w: passes.append(x.nbytes) or fn(x, w))
    monkeypatch.setattr(stats, "_sumsq", lambda x: sums.append(x.size) or 0.0)
    np_dtype = getattr(ml_dtypes, dtype, dtype)
    x = (np.random.default_rng(3).standard_normal(5 * 2**16 + 3) * 0.5).astype(np_dtype)
    options = SaveOptions(chunk_size=2**17)
    treestore.save(str(tmp_path / "s"), {"w": x}, "c", options=options)
    assert len(passes) == -(-x.nbytes // 2**17) and sum(passes) == x.nbytes and not sums
    record = treestore.open(f"{tmp_path / 's'}#c").stats()["w"]
    w = x.astype(np.float64)
    assert (record.nan, record.min, record.max) == (0, w.min(), w.max())
    assert record.l2 == pytest.approx(math.sqrt(float(np.dot(w, w))), rel=1e-12)
