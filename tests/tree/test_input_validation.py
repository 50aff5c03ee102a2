"""A save refuses, before writing anything, every input a reader would refuse, and whatever a
save commits every reader accepts (issues 12.4 and 12.10 of the attack report).

Every refusal must be a TreestoreError (InvalidInputError, UnsupportedLeafError or
UnsupportedKeyError) raised before a single object is written: the store's files are compared
before and after, an earlier checkpoint must still load, and the whole store must still list,
verify, gc and open in a CheckpointManager. Whatever a save does commit, every reader must accept.

Only the public API is used.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from jax.tree_util import GetAttrKey

import treestore
from tests import strategies
from tests.support.helpers import assert_tree_equal
from tests.support.nodes import Node
from tests.support.refusal import (
    BASE,
    INPUT_ERRORS,
    assert_base_intact,
    assert_refused,
    assert_store_healthy,
    store_files,
    with_base,
)


# --- 12.4: saves that commit what readers refuse -------------------------------------------------
def nested(depth: int, kind: str = "list", leaf: Any = None) -> Any:
    """A leaf (``np.float32(7.0)`` unless given) under ``depth`` containers: its node sits at
    depth ``depth``."""
    tree: Any = np.float32(7.0) if leaf is None else leaf
    for _ in range(depth):
        tree = {"k": tree} if kind == "dict" else (tree,) if kind == "tuple" else [tree]
    return tree


def unnest(tree: Any, depth: int, kind: str = "list") -> Any:
    for _ in range(depth):
        want = {"dict": dict, "tuple": tuple, "list": list}[kind]
        assert type(tree) is want, f"found {type(tree).__name__}, expected {kind}"
        assert len(tree) == 1
        tree = tree["k"] if kind == "dict" else tree[0]
    return tree


def deep_address(depth: int, kind: str = "list") -> str:
    return "/".join(["k" if kind == "dict" else "0"] * depth)


@pytest.mark.parametrize("kind", ["list", "tuple", "dict"])
@pytest.mark.parametrize("depth", [480, 500])
def test_deep_tree_within_limit_saves_and_loads(tmp_path, depth, kind):
    """Depth 500 is the deepest valid tree (SPEC section 6.3): it saves, loads and opens."""
    url = with_base(tmp_path)
    tree = nested(depth, kind)
    treestore.save(url, tree, "deep")
    leaf = unnest(treestore.load(url, "deep"), depth, kind)
    assert leaf == np.float32(7.0) and type(leaf) is np.float32
    ckpt = treestore.open(url, "deep")
    assert list(ckpt.leaves) == [deep_address(depth, kind)]
    assert unnest(ckpt.tree, depth, kind).read() == np.float32(7.0)
    assert_base_intact(url)
    assert_store_healthy(url)


@pytest.mark.parametrize("kind", ["list", "dict"])
@pytest.mark.parametrize("depth", [501, 505, 700, 3000])
def test_deep_tree_over_limit_is_refused_before_writing(tmp_path, depth, kind):
    """Readers refuse a leaf more than 500 containers deep; saves must too, before writing a chunk
    (the tree holds an array leaf, then the deep leaf at exactly ``depth``; 505 used to
    commit and then break every read and gc of the store; 700 failed in msgpack after its chunks
    were written; 3000 overflowed Python's stack)."""
    url = with_base(tmp_path)
    w = np.arange(5.0)
    tree = {"w": w, "k": nested(depth - 1, kind)} if kind == "dict" else [w, nested(depth - 1, kind)]
    assert_refused(url, tree)


@pytest.mark.parametrize("leaf", [np.arange(3.0), 5, "s"], ids=["array", "int", "str"])
def test_a_container_of_leaves_only_at_the_limit_saves_and_one_level_deeper_is_refused(tmp_path, leaf):
    """The same boundary where a node's children are all arrays or Python values (the case the
    walk visits without a task per leaf)."""
    url = with_base(tmp_path)
    treestore.save(url, nested(500, "list", leaf), "deep")
    assert list(treestore.open(url, "deep").leaves) == [deep_address(500)]
    exc = assert_refused(url, {"w": np.arange(5.0), "k": nested(500, "list", leaf)})
    assert "nested deeper than 500" in str(exc) and exc.address == "k/" + deep_address(500)


@pytest.mark.parametrize("kind", ["list", "dict"])
def test_self_containing_tree_is_refused(tmp_path, kind):
    url = with_base(tmp_path)
    if kind == "list":
        loop: Any = [np.ones(2)]
        loop.append(loop)
    else:
        loop = {"a": np.ones(2)}
        loop["b"] = loop
    assert_refused(url, {"w": np.arange(5.0), "loop": loop})


# The reader's bound: an int outside the 64-bit range is stored as decimal text of at most 4300
# characters, sign included (Python's own int/str conversion limit is 4300 digits).
INT_TEXT_LIMIT = 4300


@pytest.mark.parametrize(
    "value",
    [10**INT_TEXT_LIMIT - 1, -(10 ** (INT_TEXT_LIMIT - 1) - 1), 2**64, -(2**63) - 1],
    ids=["largest", "most-negative", "2**64", "-2**63-1"],
)
def test_big_int_within_reader_limit_round_trips(tmp_path, value):
    url = with_base(tmp_path)
    assert len(str(value)) <= INT_TEXT_LIMIT
    treestore.save(url, {"n": value}, "c")
    out = treestore.load(url, "c")["n"]
    assert type(out) is int and out == value
    assert treestore.open(url, "c")["n"] == value
    assert_store_healthy(url)


@pytest.mark.parametrize(
    "value",
    [-(10 ** (INT_TEXT_LIMIT - 1)), 10**INT_TEXT_LIMIT, -(10**INT_TEXT_LIMIT), 10**5000],
    ids=["-10**4299", "10**4300", "-10**4300", "10**5000"],
)
def test_big_int_over_reader_limit_is_refused(tmp_path, value):
    """-(10**4299) used to save (4301 characters, which readers refuse); 10**4300 and up raised a
    bare ValueError from Python's int/str conversion."""
    url = with_base(tmp_path)
    assert_refused(url, {"w": np.arange(5.0), "big_int": value}, address="big_int")


MANIFEST_LIMIT = 256 * 2**20  # SPEC section 10: a manifest is at most 256 MiB


def test_bytes_leaf_over_manifest_limit_is_refused(tmp_path):
    """Python bytes and str leaves live in the manifest; one that cannot fit in the 256 MiB a
    reader accepts used to commit, after which list, gc and CheckpointManager failed for the
    whole store. The smallest such leaf is just over the limit."""
    url = with_base(tmp_path)
    blob = bytes(MANIFEST_LIMIT + 2**20)
    assert_refused(url, {"a_weights": np.arange(5.0), "blob": blob})


@pytest.mark.parametrize("shape", [(0, 2**49), (2**48 + 1, 0), (0, 2**60)])
@pytest.mark.parametrize("make", ["numpy", "jax"])
def test_empty_array_with_huge_dimension_is_refused(tmp_path, shape, make):
    url = with_base(tmp_path)
    array = np.empty(shape, np.float32)
    if make == "jax":
        array = jnp.asarray(array)
    assert_refused(url, {"w": np.arange(5.0), "huge_empty": array}, address="huge_empty")


@pytest.mark.parametrize("shape", [(0, 2**48), (2**48, 0, 2**10)])
def test_empty_array_at_dimension_limit_round_trips(tmp_path, shape):
    url = with_base(tmp_path)
    array = np.empty(shape, np.float32)
    treestore.save(url, {"empty": array}, "c")
    out = treestore.load(url, "c")["empty"]
    assert out.shape == shape and out.dtype == np.float32
    assert_store_healthy(url)


# --- 12.10: bare exceptions from leaves treestore cannot store ----------------------------------
def _deleted_jax_array() -> jax.Array:
    x = jnp.ones(3)
    x.delete()
    return x


def _matrix(rows: list[list[float]]) -> np.ndarray:
    with warnings.catch_warnings():  # numpy warns about np.matrix itself, not about its storing
        warnings.simplefilter("ignore", PendingDeprecationWarning)
        return np.matrix(rows)


BAD_LEAVES = {
    "matrix": lambda: _matrix([[1.0, 2.0], [3.0, 4.0]]),
    "matrix-row": lambda: _matrix([[1.0, 2.0]]),
    "masked": lambda: np.ma.MaskedArray(np.ones((4, 4)), mask=np.eye(4)),
    "masked-unmasked": lambda: np.ma.MaskedArray(np.arange(3.0)),
    "deleted-jax": _deleted_jax_array,
}


@pytest.mark.parametrize("make", list(BAD_LEAVES.values()), ids=list(BAD_LEAVES))
def test_unstorable_array_leaf_is_refused_with_unsupported_leaf_error(tmp_path, make):
    """np.matrix and np.ma.MaskedArray cannot be restored as what they were, and a deleted
    (donated) jax array has no data: each is an UnsupportedLeafError naming its address,
    raised before anything is written (they used to raise bare ValueError or RuntimeError, or to
    commit as a plain ndarray)."""
    url = with_base(tmp_path)
    tree = {"a_bad": make(), "z": np.zeros(3), "zz": np.arange(20000.0)}
    exc = assert_refused(url, tree, address="a_bad")
    assert isinstance(exc, treestore.errors.UnsupportedLeafError), type(exc)


def test_unstorable_leaf_in_a_dict_whose_keys_do_not_sort_is_refused_with_unsupported_leaf_error(tmp_path):
    """A dict may hold keys that do not sort (1 and "a"); a leaf refused inside it is an
    UnsupportedLeafError naming its address (looking for equinox modules to name in the message
    used to let jax's ValueError from sorting the keys escape instead)."""
    url = with_base(tmp_path)
    for tree in ({"a": None, 0: lambda x: x}, {"": None, 0: np.empty((0, 2**48 + 1), np.float32)}):
        exc = assert_refused(url, tree, address="0")
        assert isinstance(exc, treestore.errors.UnsupportedLeafError), type(exc)


def test_other_ndarray_subclasses_save_as_plain_arrays(tmp_path):
    """Only subclasses that would not load back as what they were are refused: an np.memmap is
    stored (and restored) as the plain ndarray it views."""
    url = with_base(tmp_path)
    mapped = np.memmap(tmp_path / "m.bin", np.float32, "w+", shape=(3, 4))
    mapped[:] = np.arange(12, dtype=np.float32).reshape(3, 4)
    treestore.save(url, {"m": mapped}, "c")
    out = treestore.load(url, "c")["m"]
    assert type(out) is np.ndarray and out.tolist() == np.asarray(mapped).tolist()


# --- 12.4: user metadata, nodes without leaves, the manifest's own size ------------------------
def test_metadata_holding_nan_loads(tmp_path):
    """The commit record's metadata is compared with the manifest's as encoded bytes: NaN != NaN
    used to make every checkpoint saved with a NaN in its metadata unloadable."""
    url = with_base(tmp_path)
    meta = {"loss": float("nan"), "history": [1.0, float("nan")], "step": 3}
    treestore.save(url, {"w": np.arange(3.0)}, "c", metadata=meta)
    assert treestore.load(url, "c")["w"].tolist() == [0.0, 1.0, 2.0]
    got = treestore.open(url, "c").metadata
    assert np.isnan(got["loss"]) and got["step"] == 3
    assert_store_healthy(url)


def test_custom_node_repeating_a_key_without_leaves_is_refused(tmp_path):
    """Two children under one key entry used to be caught only when both held leaves (their
    addresses clashed); with None children the node was committed and readers refused it."""
    url = with_base(tmp_path)
    tree = {"w": np.arange(5.0), "n": Node([GetAttrKey("x"), GetAttrKey("x")], [None, None])}
    exc = assert_refused(url, tree, address="n/.x")
    assert isinstance(exc, treestore.errors.UnsupportedKeyError)


# --- 12.4: the property: what a save commits, every reader accepts --------------------------------
HOSTILE_INTS = [
    2**63 - 1,
    2**64,
    -(2**63) - 1,
    10**INT_TEXT_LIMIT - 1,
    -(10 ** (INT_TEXT_LIMIT - 1) - 1),
    -(10 ** (INT_TEXT_LIMIT - 1)),
    10**INT_TEXT_LIMIT,
    10**5000,
]


def hostile_int(i: int) -> int:
    """HOSTILE_INTS[i]: drawn by index, since hypothesis repr()s its strategies and repr(10**5000)
    exceeds Python's int/str conversion limit (sampled_from(HOSTILE_INTS) fails to validate)."""
    return HOSTILE_INTS[i]


DTYPE_NAMES = ["bool", "int8", "uint16", "int32", "int64", "float16", "float32", "float64", "complex64"]

arrays = st.one_of(
    strategies.arrays(DTYPE_NAMES, max_side=4),
    st.tuples(
        st.sampled_from(["float32", "uint8"]),
        st.sampled_from([(0, 2**48), (0, 2**48 + 1), (2**49, 0), (0, 3, 2**58)]),
    ).map(lambda t: np.empty(t[1], np.dtype(t[0]))),
)
ints = st.one_of(
    strategies.INTS,
    st.integers(0, len(HOSTILE_INTS) - 1).map(hostile_int),
    st.integers(0, 5000).map(lambda n: 10**n),
    st.integers(0, 5000).map(lambda n: -(10**n)),
)
scalars = strategies.scalars(ints=ints, max_size=5) | st.sampled_from(["\ud800", "a\udfffb"])
keys = strategies.KEYS | st.sampled_from([2**64, -(2**63) - 1, True])
trees = strategies.trees(arrays | scalars, keys=keys)


@settings(
    max_examples=50,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(tree=trees)
@example(tree={"n": -(10 ** (INT_TEXT_LIMIT - 1))})
@example(tree={"n": 10**5000})
@example(tree={"e": np.empty((0, 2**49), np.float32)})
def test_property_readers_accept_whatever_a_save_commits(tree):
    with tempfile.TemporaryDirectory() as tmp:
        url = os.path.join(tmp, "store")
        treestore.save(url, BASE, "base")
        before = store_files(url)
        try:
            treestore.save(url, tree, "c")
        except treestore.TreestoreError as exc:
            assert isinstance(exc, INPUT_ERRORS), f"refused with {type(exc).__name__}: {exc}"
            assert store_files(url) == before, "the refused save wrote objects"
            assert not treestore.Store(url).exists("c")
            assert_base_intact(url)
            return
        assert_tree_equal(treestore.load(url, "c"), tree)
        assert_base_intact(url)
        assert [i.name for i in treestore.Store(url).list()] == ["base", "c"]
        assert_store_healthy(url)


def test_manager_refuses_a_self_containing_tree_with_a_clear_error(tmp_path):
    """The manager's async path looks at the leaves before validating: it must not let jax's
    SystemError/RecursionError escape for a tree that contains itself (issue 12.4), also when jax
    is imported and the save may copy arrays on their devices."""
    import jax.numpy as jnp

    tree: dict[str, object] = {"w": np.ones(2), "j": jnp.ones(2)}
    tree["me"] = tree
    with treestore.CheckpointManager(str(tmp_path / "s")) as mgr:
        with pytest.raises(treestore.InvalidInputError, match="contains itself"):
            mgr.save(1, tree)
        assert mgr.save(2, {"w": np.ones(2)})
