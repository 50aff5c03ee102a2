"""Every kind of leaf round-trips bit-exactly, as the same type; inputs are never modified."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import treestore
from tests import strategies
from tests.support.helpers import assert_tree_equal, same_bytes
from tests.support.templates import blank
from treestore._format.dtypes import DTYPES, ITEMSIZES, ML_ITEMSIZES, NUMPY_NAMES
from treestore._format.manifest.columns import DTYPE_NAMES

RNG = np.random.default_rng(0)


def random_array(dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Arbitrary bit patterns (NaNs and all) of any dtype, as valid values of that dtype."""
    if dtype.name in ("int2", "int4", "uint2", "uint4") or dtype == np.bool_:
        info = ml_dtypes.iinfo(dtype) if dtype != np.bool_ else None
        lo, hi = (0, 2) if info is None else (int(info.min), int(info.max) + 1)
        return RNG.integers(lo, hi, size=shape).astype(dtype)
    raw = RNG.integers(0, 256, size=(*shape, dtype.itemsize), dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def test_the_static_dtype_table_is_what_numpy_and_ml_dtypes_define():
    """Manifests are read without importing ml_dtypes, from a table of names and item sizes: each
    entry must be the dtype the installed ml_dtypes (or numpy) defines, with that item size."""
    assert set(ITEMSIZES) == set(DTYPES) == NUMPY_NAMES | set(ML_ITEMSIZES)
    for name in ML_ITEMSIZES:
        assert DTYPES[name] == np.dtype(getattr(ml_dtypes, name)), name
        assert DTYPES[name].name == name
    for name, size in ITEMSIZES.items():
        assert DTYPES[name].itemsize == size, name
    assert set(DTYPE_NAMES) == set(DTYPES)  # the format's code table names each of them


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 0, 2), (33, 65)])
def test_every_dtype_and_shape(store_url, name, shape):
    array = random_array(DTYPES[name], shape)
    treestore.save(store_url, {"x": array}, "c")
    out = treestore.load(store_url)["x"]
    assert isinstance(out, np.ndarray)
    assert same_bytes(out, array)


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float8_e4m3fn", "int4", "float16", "int32", "bool"])
def test_jax_arrays_come_back_as_jax_arrays(store_url, name):
    array = jnp.asarray(random_array(DTYPES[name], (5, 4)))
    treestore.save(store_url, [array], "c")
    (out,) = treestore.load(store_url)
    assert isinstance(out, jax.Array)
    assert same_bytes(out, array)


def test_large_leaves_span_many_chunks(store_url):
    big = RNG.standard_normal((600, 1000)).astype(np.float32)  # 2.4 MB
    options = treestore.SaveOptions(chunk_size=64 * 1024)
    treestore.Store(store_url).save({"big": big, "bf": big.astype(ml_dtypes.bfloat16)}, "c", options=options)
    manifest = treestore.Store(store_url).manifest("c")
    assert [len(leaf.chunks) for leaf in manifest.leaves] == [19, 37]  # bf (sorted first), big
    out = treestore.load(store_url)
    assert same_bytes(out["big"], big)
    assert same_bytes(out["bf"], big.astype(ml_dtypes.bfloat16))


def test_non_contiguous_and_fortran_arrays(store_url):
    base = np.arange(120, dtype=np.float64).reshape(10, 12)
    tree = {"strided": base[::2, ::3], "fortran": np.asfortranarray(base), "transposed": base.T}
    treestore.save(store_url, tree, "c")
    out = treestore.load(store_url)
    for k, v in tree.items():
        assert np.array_equal(out[k], v) and out[k].dtype == v.dtype


def test_big_endian_arrays_load_as_native_values(store_url):
    big_endian = np.arange(6, dtype=">i4")
    treestore.save(store_url, [big_endian], "c")
    (out,) = treestore.load(store_url)
    assert np.array_equal(out, big_endian) and out.dtype == np.int32


def test_python_and_numpy_scalars_keep_their_type(store_url):
    tree = [
        1,
        -(2**70),
        2.5,
        float("nan"),
        True,
        False,
        3 - 4j,
        "text ✓",
        b"\x00bytes",
        np.float32(1.5),
        np.int8(-3),
        np.bool_(True),
        np.complex64(1 + 2j),
        ml_dtypes.bfloat16(2.0),
    ]
    treestore.save(store_url, tree, "c")
    assert_tree_equal(treestore.load(store_url), tree)


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_typed_prng_keys(store_url, impl):
    key = jax.random.key(42, impl=impl)
    keys = jax.random.split(key, 3)
    treestore.save(store_url, {"key": key, "keys": keys}, "c")
    out = treestore.load(store_url)
    assert_tree_equal(out, {"key": key, "keys": keys})
    # The restored key draws the same numbers.
    assert np.array_equal(jax.random.normal(out["key"], (4,)), jax.random.normal(key, (4,)))
    like = {"key": jax.ShapeDtypeStruct((), key.dtype), "keys": blank(keys)}
    assert_tree_equal(treestore.load(store_url, like=like), {"key": key, "keys": keys})


def test_raw_uint32_keys_stay_arrays(store_url):
    old_style = jax.random.PRNGKey(0)
    treestore.save(store_url, {"k": old_style}, "c")
    out = treestore.load(store_url)["k"]
    assert out.dtype == jnp.uint32 and same_bytes(out, old_style)


def test_inputs_are_not_modified(store_url):
    tree = {"a": np.arange(100_000, dtype=np.float32), "d": {"x": [1, 2]}, "f": np.asfortranarray(np.eye(3))}
    before = {"a": tree["a"].copy(), "flags": tree["a"].flags.writeable}
    treestore.save(store_url, tree, "c")
    assert same_bytes(tree["a"], before["a"]) and tree["a"].flags.writeable == before["flags"]
    assert tree["d"] == {"x": [1, 2]} and tree["f"].flags.f_contiguous


def test_second_save_of_same_tree_writes_no_chunk(store_url):
    tree = {"w": RNG.standard_normal((512, 1024)).astype(np.float32), "small": [np.ones(3), 2]}
    store = treestore.Store(store_url)
    first = store.save(tree, "one")
    second = store.save(tree, "two")
    assert first.chunks_written > 0
    assert second.chunks_written == 0 and second.bytes_written == 0
    assert second.chunks_reused == first.chunks_written


def test_tied_and_frozen_weights_are_stored_once(store_url):
    shared = RNG.standard_normal((256, 1024)).astype(np.float32)  # 1 MiB
    store = treestore.Store(store_url)
    result = store.save({"embed": shared, "unembed": shared.copy()}, "tied")
    one = store.save({"only": shared}, "single")
    assert result.chunks_written == one.chunks_reused > 0


def test_unsupported_leaf_raises_before_writing(store_url):
    store = treestore.Store(store_url)
    with pytest.raises(
        treestore.errors.UnsupportedLeafError, match=r"b/1: cannot store a leaf of type .*object"
    ):
        store.save({"a": np.ones(10**6), "b": [1, object()]}, "c")
    assert store.list() == []
    assert store._storage.list("chunks") == []


def test_unsupported_dtype_names_the_address(store_url):
    with pytest.raises(treestore.errors.UnsupportedLeafError, match="x: cannot store arrays of dtype"):
        treestore.save(store_url, {"x": np.array(["a"], dtype=object)}, "c")
    with pytest.raises(treestore.errors.UnsupportedLeafError, match="x: cannot store arrays of dtype"):
        treestore.save(store_url, {"x": np.zeros(2, dtype="datetime64[s]")}, "c")


def test_containers_round_trip_exactly(store_url):
    point = collections.namedtuple("Point", "x y")
    tree = {
        "b": 1,
        "a": [(), [], {}, None, (None,)],
        "o": collections.OrderedDict(z=1, y=2),
        "p": point(1, 2),
        "i": {2: "two", 1: "one"},
        "t": {True: "yes", False: "no"},
    }
    treestore.save(store_url, tree, "c")
    out = treestore.load(store_url)
    assert list(out) == ["b", "a", "o", "p", "i", "t"]  # insertion order
    assert out["a"] == [(), [], {}, None, (None,)]
    assert type(out["o"]) is collections.OrderedDict and list(out["o"]) == ["z", "y"]
    assert out["p"] == {"x": 1, "y": 2}  # a namedtuple without template: a dict of its fields
    assert list(out["i"]) == [2, 1] and [type(k) for k in out["t"]] == [bool, bool]  # key types stay
    back = treestore.load(store_url, like=blank(tree))
    assert back["p"] == point(1, 2) and back == tree


def test_metadata_and_listing(store_url):
    store = treestore.Store(store_url)
    store.save({"w": np.ones(4)}, "a", metadata={"step": 1, "loss": 0.5})
    store.save({"w": np.ones(4)}, "b", metadata={"step": 2})
    infos = store.list()
    assert [(i.name, i.metadata) for i in infos] == [("a", {"step": 1, "loss": 0.5}), ("b", {"step": 2})]
    assert infos[0].leaves == 1 and infos[0].nbytes == 32
    assert store.latest() == "b"
    assert treestore.load(store_url)["w"].shape == (4,)
    with pytest.raises(treestore.InvalidInputError, match="metadata must be plain data"):
        store.save({"w": 1}, "c", metadata={"bad": object()})


def test_overwrite_needs_consent(store_url):
    store = treestore.Store(store_url)
    store.save({"v": 1}, "c")
    with pytest.raises(treestore.errors.CheckpointExistsError, match="'c' already exists"):
        store.save({"v": 2}, "c")
    assert store.load("c") == {"v": 1}
    store.save({"v": 2}, "c", overwrite=True)
    assert store.load("c") == {"v": 2}


@pytest.mark.parametrize("name", ["", "../x", "a/b", ".hidden", "x" * 201, "white space", None])
def test_bad_checkpoint_names(store_url, name):
    with pytest.raises(treestore.InvalidInputError, match="checkpoint name"):
        treestore.save(store_url, {"v": 1}, name)


def test_delete_keeps_other_checkpoints(store_url):
    store = treestore.Store(store_url)
    store.save({"v": np.arange(100_000)}, "a")
    store.save({"v": np.arange(100_000), "w": np.ones(3)}, "b")
    store.delete("a")
    assert [c.name for c in store.list()] == ["b"]
    with pytest.raises(treestore.errors.CheckpointNotFoundError):
        store.load("a")
    with pytest.raises(treestore.errors.CheckpointNotFoundError):
        store.delete("a")
    report = store.gc(grace=0)
    assert report.chunks_removed == 0  # every chunk of "a" is shared with "b"
    assert np.array_equal(store.load("b")["v"], np.arange(100_000))


def test_codec_choices_all_round_trip(store_url):
    weights = (RNG.standard_normal((300, 700)) * 0.02).astype(np.float32)
    store = treestore.Store(store_url)
    for i, codec in enumerate(
        [treestore.Codec("raw"), treestore.Codec(level=3), treestore.Codec(byte_planes=False)]
    ):
        store.save({"w": weights}, f"c{i}", codec=codec)
        assert same_bytes(store.load(f"c{i}")["w"], weights)


trees = strategies.trees(
    st.one_of(
        strategies.arrays(
            (np.float32, np.int8, np.uint16, np.float64, np.bool_, ml_dtypes.bfloat16), max_side=6
        ),
        strategies.scalars(max_size=5),
    ),
    max_size=4,
    max_leaves=12,
)


def _arrays(tree):
    """The numpy arrays of a tree of dicts, lists and tuples (whose dict keys may not sort)."""
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        for child in tree:
            yield from _arrays(child)
    elif isinstance(tree, np.ndarray):
        yield tree


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=trees)
def test_property_load_of_save_is_identity(tmp_path_factory, tree):
    import uuid

    url = f"memory://treestore-prop/{uuid.uuid4().hex}"
    store = treestore.Store(url)
    store.save(tree, "c")
    loaded = store.load("c")
    assert_tree_equal(loaded, tree)
    arrays = list(_arrays(loaded))
    for i, x in enumerate(arrays):  # no two leaves of a load share memory
        assert not any(np.shares_memory(x, y) for y in arrays[i + 1 :])
    again = store.save(tree, "d")
    assert again.chunks_written == 0


def test_weak_types_survive(store_url):
    """A weakly typed jax scalar (as jit gives from Python numbers) must promote the same way."""
    tree = {"lr": jnp.asarray(0.5), "step": jnp.asarray(3), "w": jnp.ones(2, jnp.bfloat16)}
    assert tree["lr"].weak_type
    treestore.save(store_url, tree, "c")
    out = treestore.load(store_url)
    assert out["lr"].weak_type and out["step"].weak_type and not out["w"].weak_type
    assert (out["lr"] * out["w"]).dtype == jnp.bfloat16  # a strong float32 would promote to float32
    like = treestore.load(store_url, like=blank(tree))
    assert_tree_equal(like, tree)
    assert like["lr"].weak_type
