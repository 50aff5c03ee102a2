"""like=: exact types back, and one error listing every mismatch; no silent casts.

Templates hold none of the saved data (tests/support/templates.py): a load that handed back the
template's leaves instead of reading the store would fail every test here."""

from __future__ import annotations

import uuid

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import treestore
from tests.support.counting import CountingFileSystem
from tests.support.helpers import assert_tree_equal, same_bytes
from tests.support.templates import blank


@pytest.fixture
def saved(store_url):
    tree = {
        "params": {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.full(4, 0.5, np.float32)},
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
    assert_tree_equal(treestore.load(url, like=blank(tree)), jax.tree.map(lambda x: x, tree))


def test_like_with_a_jax_template_reads_the_store(store_url):
    """jax arrays, a typed PRNG key and a weakly typed scalar, from templates of zeros and of
    ShapeDtypeStructs: the stored values come back, with the template's types."""
    tree = {"key": jax.random.key(7), "lr": jnp.asarray(0.5), "n": 9, "w": jnp.arange(6.0).reshape(2, 3)}
    treestore.save(store_url, tree, "c")
    for shapes in (False, True):
        out = treestore.load(store_url, like=blank(tree, shapes=shapes))
        assert_tree_equal(out, tree)
        assert out["lr"].weak_type


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
    like = dict(blank(tree), count=np.float32(0))
    with pytest.raises(treestore.StructureMismatchError, match="count: expected dtype float32, found int32"):
        treestore.load(url, like=like)


def test_cast_only_when_asked(saved):
    url, tree = saved
    like = blank(tree)
    like["params"] = {"w": jax.ShapeDtypeStruct((3, 4), jnp.bfloat16), "b": np.zeros(4, np.float64)}
    out = treestore.load(url, like=like, cast=True)
    assert out["params"]["w"].dtype == jnp.bfloat16
    assert out["params"]["b"].dtype == np.float64
    assert np.array_equal(np.asarray(out["params"]["w"], np.float32), tree["params"]["w"])
    assert np.array_equal(out["params"]["b"], tree["params"]["b"].astype(np.float64))
    assert (out["step"], out["count"]) == (7, np.int32(16777217))


def test_prefix_restores_a_subtree(saved):
    url, tree = saved
    like = blank(tree["params"])
    out = treestore.load(url, like={"w": like["w"], "b": like["b"]}, prefix="params")
    assert_tree_equal(out, jax.tree.map(lambda x: x, tree["params"]))
    with pytest.raises(treestore.StructureMismatchError, match="params/b: unexpected"):
        treestore.load(url, like={"w": like["w"]}, prefix="params")


def test_bf16_weights_stay_bf16(store_url):
    w = (np.random.default_rng(1).standard_normal((64, 64)) * 0.02).astype(ml_dtypes.bfloat16)
    treestore.save(store_url, {"w": jnp.asarray(w)}, "c")
    out = treestore.load(store_url, like={"w": jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)})
    assert out["w"].dtype == jnp.bfloat16 and same_bytes(out["w"], w)


def test_unsupported_template_leaf(saved):
    url, tree = saved
    like = dict(blank(tree), step=object())
    with pytest.raises(treestore.StructureMismatchError, match="step: template leaf of type object"):
        treestore.load(url, like=like)


# --- Python scalars and 0-d arrays (a flax TrainState's step) ------------------------------------
def test_scalars_and_0d_arrays_convert_under_cast(store_url):
    tree = {
        "step": jnp.asarray(5, jnp.int32),
        "n": 3,
        "lr": np.float32(0.5),
        "flag": np.bool_(True),
        "f": 2.5,
        "u": np.uint8(200),
    }
    treestore.save(store_url, tree, "c")
    like = {
        "step": 0,
        "n": jax.ShapeDtypeStruct((), jnp.int32, weak_type=True),
        "lr": 0.0,
        "flag": False,
        "f": np.float64(0),
        "u": 0,
    }
    with pytest.raises(treestore.StructureMismatchError) as info:
        treestore.load(store_url, like=like)
    assert len(info.value.problems) == 6
    assert all(p.endswith("(pass cast=True to convert)") for p in info.value.problems)
    assert "step: expected Python int, found array int32[] (pass cast=True" in str(info.value)
    assert "n: expected array int32[], found Python int (pass cast=True" in str(info.value)
    out = treestore.load(store_url, like=like, cast=True)
    assert out == {"step": 5, "n": 3, "lr": 0.5, "flag": True, "f": 2.5, "u": 200}
    assert [type(out[k]) for k in ("step", "lr", "flag", "u")] == [int, float, bool, int]
    assert isinstance(out["n"], jax.Array) and out["n"].dtype == jnp.int32 and out["n"].weak_type
    assert type(out["f"]) is np.float64


def test_scalars_convert_only_within_their_kind(store_url):
    treestore.save(store_url, {"x": np.float32(1.5), "big": 2**40, "v": 1.0}, "c")
    like = {"x": 0, "big": np.int32(0), "v": jax.ShapeDtypeStruct((1,), jnp.float32)}
    with pytest.raises(treestore.StructureMismatchError) as info:
        treestore.load(store_url, like=like, cast=True)
    text = str(info.value)
    assert "x: expected Python int, found array float32[]" in text  # never a silent truncation
    assert "big: expected array int32[], found Python int 1099511627776, outside int32" in text
    assert "v: expected array float32[1], found Python float" in text
    assert "cast=True" not in text


def test_a_wrong_shape_and_dtype_are_both_shown(saved):
    url, tree = saved
    like = dict(
        blank(tree), params={"w": jax.ShapeDtypeStruct((4, 3), jnp.bfloat16), "b": tree["params"]["b"]}
    )
    with pytest.raises(treestore.StructureMismatchError) as info:
        treestore.load(url, like=like)
    assert info.value.problems == (
        "params/w: expected shape (4, 3), found (3, 4); expected dtype bfloat16, found float32 "
        "(pass cast=True to convert)",
    )
    with pytest.raises(
        treestore.StructureMismatchError, match=r"params/w: expected shape \(4, 3\), found \(3, 4\)\Z"
    ):
        treestore.load(url, like=like, cast=True)


# --- leaves kept from the template (equinox modules' functions and statics) ----------------------
def test_callables_come_from_the_template(store_url):
    treestore.save(store_url, {"w": np.arange(3.0), "act": None}, "c")
    like = {"w": np.zeros(3), "act": jnp.tanh, "final": abs, "cls": np.float32}
    out = treestore.load(store_url, like=like)
    assert same_bytes(out["w"], np.arange(3.0))
    assert out["act"] is jnp.tanh and out["final"] is abs and out["cls"] is np.float32
    with pytest.raises(treestore.StructureMismatchError, match=r"w: expected function \(a callable"):
        treestore.load(store_url, like={"w": lambda x: x})
    with pytest.raises(treestore.StructureMismatchError, match="other: missing: expected Python object"):
        treestore.load(store_url, like={"w": np.zeros(3), "other": object()})


def test_scalars_are_kept_only_where_the_checkpoint_holds_none(store_url):
    treestore.save(store_url, {"w": np.arange(3.0), "p": None, "b": None}, "c")
    out = treestore.load(store_url, like={"w": np.zeros(3), "p": 0.25, "b": True})
    assert out["p"] == 0.25 and out["b"] is True and same_bytes(out["w"], np.arange(3.0))
    with pytest.raises(treestore.StructureMismatchError) as info:
        treestore.load(store_url, like={"w": np.zeros(3), "p": np.zeros(2), "q": 0.5})
    assert info.value.problems == (
        "p: missing: expected array float64[2], not in the checkpoint (it holds None there)",
        "q: missing: expected Python float, not in the checkpoint",
    )


# --- partial=True: the template is a subset --------------------------------------------------------
def test_partial_loads_a_subset_of_the_checkpoint(saved):
    url, tree = saved
    like = {"params": {"w": blank(tree["params"]["w"])}}
    with pytest.raises(
        treestore.StructureMismatchError, match=r"(?s)params/b: unexpected: .*hint: .*pass partial=True"
    ):
        treestore.load(url, like=like)
    out = treestore.load(url, like=like, partial=True)
    assert_tree_equal(out, {"params": {"w": tree["params"]["w"]}})
    assert_tree_equal(
        treestore.load(url, like={"w": like["params"]["w"]}, prefix="params", partial=True), out["params"]
    )
    with pytest.raises(treestore.StructureMismatchError, match="params/x: missing"):
        treestore.load(url, like={"params": {"x": np.zeros(1)}}, partial=True)
    with pytest.raises(treestore.InvalidInputError, match="partial= only applies with like="):
        treestore.load(url, partial=True)


def test_partial_reads_only_the_templates_chunks():
    url = f"counting://{uuid.uuid4().hex}"
    big = np.arange(2**18, dtype=np.float32)  # 1 MiB: chunks of its own
    treestore.save(url, {"params": {"w": np.ones(4, np.float32)}, "opt": {"mu": big, "nu": big + 1}}, "c")
    CountingFileSystem.reset()
    out = treestore.load(url, like={"params": {"w": np.zeros(4, np.float32)}}, partial=True)
    assert same_bytes(out["params"]["w"], np.ones(4, np.float32))
    assert CountingFileSystem.bytes_read("/chunks/") < 64 * 1024


def test_a_subset_template_names_the_real_problem_above_one_hint():
    """A template of one leaf against a checkpoint of 104, that leaf's dtype wrong: the message
    shows the real problem first, at most ten of the 103 unexpected leaves with a count of the
    rest, and the partial=True hint once (it was 104 lines, the hint repeated 103 times)."""
    url = f"memory://template-subset/{uuid.uuid4().hex}"
    tree = {f"layer{k:03d}": np.zeros(4, np.float32) for k in range(104)}
    treestore.save(url, tree, "c")
    with pytest.raises(treestore.StructureMismatchError) as info:
        treestore.load(url, like={"layer000": np.zeros(4, np.int32)})
    lines = str(info.value).splitlines()
    assert lines[0] == "104 structure mismatch(es) in checkpoint 'c':"
    assert lines[1].strip() == "layer000: expected dtype int32, found float32 (pass cast=True to convert)"
    assert lines[12].strip() == "... and 93 more unexpected" and len(lines) == 14
    assert lines[13].strip() == (
        "hint: 103 leaves of the checkpoint are not in the template: pass partial=True to load only "
        "the template's leaves"
    )
    assert len(info.value.problems) == 104 and str(info.value).count("partial=True") == 1


def test_a_list_template_against_digit_string_keys_says_so():
    """A flax-style list of layers against a tree imported from Hugging Face (keys "0", "1"):
    the message says the template has list indices where the checkpoint has digit-string keys,
    and does not suggest partial=True for those leaves."""
    url = f"memory://template-digits/{uuid.uuid4().hex}"
    treestore.save(url, {"layer": {"0": {"w": np.zeros(2)}, "1": {"w": np.zeros(2)}}}, "hf")
    with pytest.raises(treestore.StructureMismatchError) as info:
        treestore.load(url, like={"layer": [{"w": np.zeros(2)}, {"w": np.zeros(2)}]})
    (hint,) = info.value.hints
    assert hint.startswith("2 template leaves are missing only because the template has list indices")
    assert 'layer/0/w in the template, layer/"0"/w in the checkpoint' in hint
    assert "partial=True" not in str(info.value)
