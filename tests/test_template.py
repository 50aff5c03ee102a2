"""like=: exact types back, and one error listing every mismatch; no silent casts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import treestore

from .helpers import assert_tree_equal, same_bytes


@pytest.fixture
def saved(store_url):
    tree = {
        "params": {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.zeros(4, np.float32)},
        "step": 7,
        "count": np.int32(16777217),
    }
    treestore.save(store_url, tree, "c")
    return store_url, tree


def test_like_with_shape_dtype_structs_gives_jax_arrays(saved):
    url, tree = saved
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), tree)
    like["step"] = 0
    out = treestore.load(url, like=like)
    assert isinstance(out["params"]["w"], jax.Array)
    assert same_bytes(out["params"]["w"], tree["params"]["w"])
    assert out["step"] == 7 and type(out["step"]) is int


def test_like_with_numpy_template_gives_numpy(saved):
    url, tree = saved
    # Like every jax tree operation, rebuilding from a template orders dict keys as jax does.
    assert_tree_equal(treestore.load(url, like=tree), jax.tree.map(lambda x: x, tree))


def test_every_mismatch_is_listed_at_once(saved):
    url, _ = saved
    like = {
        "params": {
            "w": jax.ShapeDtypeStruct((3, 5), jnp.float32),  # shape differs
            "b": jax.ShapeDtypeStruct((4,), jnp.bfloat16),  # dtype differs
            "extra": jax.ShapeDtypeStruct((1,), jnp.float32),  # missing from checkpoint
        },
        "step": 1.0,  # kind differs: stored an int
        # "count" left out: unexpected in the checkpoint
    }
    with pytest.raises(treestore.StructureMismatchError) as info:
        treestore.load(url, like=like)
    problems = info.value.problems
    assert len(problems) == 5
    text = str(info.value)
    assert "params/w: expected shape (3, 5), found (3, 4)" in text
    assert "params/b: expected dtype bfloat16, found float32 (pass cast=True to convert)" in text
    assert "params/extra: missing" in text
    assert "step: expected Python float, found Python int" in text
    assert "count: unexpected: found array int32[]" in text
    assert "checkpoint 'c'" in text
    assert isinstance(info.value, ValueError)


def test_no_silent_cast_of_large_ints(saved):
    url, tree = saved
    like = dict(tree, count=np.float32(0))
    with pytest.raises(treestore.StructureMismatchError, match="count: expected dtype float32, found int32"):
        treestore.load(url, like=like)


def test_cast_only_when_asked(saved):
    url, tree = saved
    like = jax.tree.map(lambda x: x, tree)
    like["params"] = {"w": jax.ShapeDtypeStruct((3, 4), jnp.bfloat16), "b": np.zeros(4, np.float64)}
    out = treestore.load(url, like=like, cast=True)
    assert out["params"]["w"].dtype == jnp.bfloat16
    assert out["params"]["b"].dtype == np.float64
    assert np.array_equal(np.asarray(out["params"]["w"], np.float32), tree["params"]["w"])


def test_prefix_restores_a_subtree(saved):
    url, tree = saved
    out = treestore.load(url, like={"w": tree["params"]["w"], "b": tree["params"]["b"]}, prefix="params")
    assert_tree_equal(out, jax.tree.map(lambda x: x, tree["params"]))
    with pytest.raises(treestore.StructureMismatchError, match="params/b: unexpected"):
        treestore.load(url, like={"w": tree["params"]["w"]}, prefix="params")


def test_bf16_weights_stay_bf16(store_url):
    w = (np.random.default_rng(1).standard_normal((64, 64)) * 0.02).astype(ml_dtypes.bfloat16)
    treestore.save(store_url, {"w": jnp.asarray(w)}, "c")
    out = treestore.load(store_url, like={"w": jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)})
    assert out["w"].dtype == jnp.bfloat16 and same_bytes(out["w"], w)


def test_unsupported_template_leaf(saved):
    url, tree = saved
    like = dict(tree, step=object())
    with pytest.raises(treestore.StructureMismatchError, match="step: template leaf of type object"):
        treestore.load(url, like=like)
