"""Every kind of tree structure round-trips.

Without a template, builtin containers (dict, list, tuple, None, OrderedDict) come back exactly and
every other node comes back as a plain dict keyed by its key entries. With ``like=`` the original
tree's exact structure comes back, with bit-identical leaves.
"""

from __future__ import annotations

import collections
import dataclasses
import uuid
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import linen, nnx
from flax.core import freeze
from hypothesis import given, settings
from hypothesis import strategies as st

import treestore
from tests import strategies
from tests.support.helpers import assert_leaf_equal, assert_tree_equal, is_key
from tests.support.templates import blank
from treestore._format.manifest.tree import nodes_from_tree
from treestore._tree.prepare import prepare

# --------------------------------------------------------------------------------------------------
# helpers


def assert_like_round_trip(out: Any, tree: Any) -> None:
    """``out`` has exactly ``tree``'s structure (types, keys, aux data) and bit-identical leaves."""
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
    for (p, x), y in zip(jax.tree_util.tree_flatten_with_path(tree)[0], jax.tree.leaves(out), strict=True):
        assert_leaf_equal(x, y, jax.tree_util.keystr(p))


def fresh_url() -> str:
    return f"memory://treestore-structures/{uuid.uuid4().hex}"


def arange(n: int, dtype: Any = np.float32) -> np.ndarray:
    return np.arange(n, dtype=np.float32).astype(dtype)


# --------------------------------------------------------------------------------------------------
# custom node kinds


class Point(NamedTuple):
    x: Any
    y: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    step: Any
    params: Any
    rng: Any
    name: str = dataclasses.field(default="run", metadata=dict(static=True))


class KeyedPair:
    """Registered with keys: its children are named by DictKey entries."""

    def __init__(self, left: Any, right: Any, tag: str = "tag") -> None:
        self.left, self.right, self.tag = left, right, tag


jax.tree_util.register_pytree_with_keys(
    KeyedPair,
    lambda n: (((jax.tree_util.DictKey("left"), n.left), (jax.tree_util.DictKey("right"), n.right)), n.tag),
    lambda tag, children: KeyedPair(*children, tag=tag),
)


@jax.tree_util.register_pytree_node_class
class Box:
    """Registered without keys: its children are named by FlattenedIndexKey entries."""

    def __init__(self, a: Any, b: Any) -> None:
        self.a, self.b = a, b

    def tree_flatten(self) -> tuple[tuple[Any, Any], None]:
        return (self.a, self.b), None

    @classmethod
    def tree_unflatten(cls, aux: None, children: Any) -> Box:
        return cls(*children)


def _builtin_cases() -> dict[str, Any]:
    return {
        "dict-str-keys": {"b": arange(3), "a": 2, "c": {"z": 1.5, "y": "text"}},
        "dict-int-keys": {3: arange(2), 1: "one", 2: {10: b"bytes", -4: None}},
        "list": [arange(4, np.int32), [1, 2.5, True], [], [[]]],
        "tuple": (arange(2, ml_dtypes.bfloat16), (), (1 + 2j, (None,))),
        "none": None,
        "ordereddict": collections.OrderedDict([("z", arange(1)), ("a", collections.OrderedDict(k=1))]),
    }


def _nnx_sequential() -> nnx.Sequential:
    return nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(3, 1, rngs=nnx.Rngs(1)))


def _custom_cases() -> dict[str, Any]:
    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    adam_params = {"dense": {"kernel": jnp.full((3, 4), 0.5), "bias": jnp.zeros(4)}}
    adam = optax.adam(1e-3)
    adam_state = adam.init(adam_params)
    grads = jax.tree.map(jnp.ones_like, adam_params)
    _, adam_state = adam.update(grads, adam_state, adam_params)  # count becomes 1
    linen_params = linen.Dense(4).init(jax.random.key(0), jnp.ones((1, 3)))
    _, nnx_state = nnx.split(nnx.Linear(3, 4, rngs=nnx.Rngs(0)))
    _, _, nnx_rng_state = nnx.split(nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=3)), nnx.Param, ...)
    mlp = eqx.nn.MLP(2, 2, 8, 2, key=jax.random.key(0))
    return {
        "namedtuple": [Point(arange(2), 3), Point(x="a", y=None)],
        "dataclass": TrainState(step=7, params=params, rng=jax.random.key(3)),
        "register_pytree_with_keys": KeyedPair(arange(3), {"inner": np.int8(5)}),
        "register_pytree_node_class": Box(arange(2, np.float16), [1, 2]),
        "optax-adam": adam_state,
        "flax-linen-params": linen_params,
        "flax-linen-frozendict": freeze(linen_params),
        "flax-nnx-state": nnx_state,
        "flax-nnx-sequential-state": nnx.split(_nnx_sequential())[1],
        "flax-nnx-rng-state": nnx_rng_state,
        "defaultdict": collections.defaultdict(list, {"b": arange(2), "a": [1]}),
        "equinox-filtered": eqx.filter(mlp, eqx.is_array),
        "equinox-partitioned": eqx.partition(mlp, eqx.is_array)[0],
    }


CASES = {**_builtin_cases(), **_custom_cases()}


def to_builtin(tree: Any) -> Any:
    """What a load without a template should give: builtin containers kept, other nodes as dicts
    keyed by the plain value of each key entry (attribute name, dict key, index)."""
    if tree is None or type(tree) in (dict, collections.OrderedDict, list, tuple):
        if isinstance(tree, dict):
            return type(tree)((k, to_builtin(v)) for k, v in tree.items())
        if isinstance(tree, (list, tuple)):
            return type(tree)(to_builtin(v) for v in tree)
        return None
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda y: y is not tree)
    if jax.tree_util.treedef_is_leaf(treedef) and len(pairs) == 1 and pairs[0][0] == ():
        return tree

    def plain(key: Any) -> Any:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                return getattr(key, attr)
        raise AssertionError(key)

    return {plain(p[0]): to_builtin(child) for p, child in pairs}


@pytest.mark.parametrize("case", list(CASES))
def test_every_structure_round_trips(tmp_path, case):
    tree = CASES[case]
    url = tmp_path / "store"
    treestore.save(url, tree, "c")
    manifest = treestore.Store(url).manifest("c")
    expected = [treestore.format_address(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    assert [leaf.address for leaf in manifest.leaves] == expected

    # (a) without a template: builtin containers, custom nodes as dicts
    plain = treestore.load(url, "c")
    assert_tree_equal(plain, to_builtin(tree))
    if case in _builtin_cases():
        assert_tree_equal(plain, tree)

    # (b) with a template of the original's structure and types (zeros, then ShapeDtypeStructs):
    # the exact structure, bit-identical leaves
    if tree is not None:
        for shapes in (False, True):
            like = treestore.load(url, "c", like=blank(tree, shapes=shapes))
            assert_like_round_trip(like, tree)


def test_none_round_trips_with_a_template(tmp_path):
    # like=None means "no template", so a tree that is None loads as None either way
    treestore.save(tmp_path, None, "c")
    assert treestore.load(tmp_path, "c") is None
    treestore.save(tmp_path, {"a": None, "b": [None, 1]}, "d")
    out = treestore.load(tmp_path, "d", like=blank({"a": None, "b": [None, 1]}))
    assert out == {"a": None, "b": [None, 1]}


def test_dict_key_order_is_kept_without_a_template():
    url = fresh_url()
    treestore.save(url, {"b": 1, "a": 2}, "c")
    out = treestore.load(url, "c")
    assert list(out) == ["b", "a"] and out == {"b": 1, "a": 2}
    treestore.save(url, {3: "x", 1: "y", 2: "z"}, "ints")
    assert list(treestore.load(url, "ints")) == [3, 1, 2]
    # leaves are still stored in jax's (sorted) order
    assert [e.address for e in treestore.Store(url).manifest("c").leaves] == ["a", "b"]
    assert [e.address for e in treestore.Store(url).manifest("ints").leaves] == ["{1}", "{2}", "{3}"]


def test_namedtuple_and_dataclass_come_back_as_dicts_of_their_fields(tmp_path):
    treestore.save(tmp_path, CASES["namedtuple"], "nt")
    out = treestore.load(tmp_path, "nt")
    assert type(out) is list and all(type(p) is dict for p in out)
    assert [list(p) for p in out] == [["x", "y"], ["x", "y"]]
    assert out[1] == {"x": "a", "y": None}

    state = CASES["dataclass"]
    treestore.save(tmp_path, state, "dc")
    out = treestore.load(tmp_path, "dc")
    assert type(out) is dict and list(out) == ["step", "params", "rng"]  # static "name" is not a child
    assert out["step"] == 7 and type(out["step"]) is int
    assert list(out["params"]) == ["w", "b"]  # a builtin dict inside a custom node keeps its order
    assert is_key(out["rng"])
    back = treestore.load(tmp_path, "dc", like=blank(state))
    assert type(back) is TrainState and back.name == "run" and type(back.step) is int
    assert_like_round_trip(back, state)

    treestore.save(tmp_path, CASES["register_pytree_with_keys"], "keyed")
    assert list(treestore.load(tmp_path, "keyed")) == ["left", "right"]
    treestore.save(tmp_path, CASES["register_pytree_node_class"], "box")
    out = treestore.load(tmp_path, "box")
    assert list(out) == [0, 1] and out[1] == [1, 2]
    assert [e.address for e in treestore.Store(tmp_path).manifest("box").leaves] == ["#0", "#1/0", "#1/1"]


def test_optax_adam_state_keeps_its_count(tmp_path):
    state = CASES["optax-adam"]
    treestore.save(tmp_path, state, "opt")
    out = treestore.load(tmp_path, "opt")
    assert type(out) is tuple and len(out) == 2
    assert list(out[0]) == ["count", "mu", "nu"] and out[1] == {}
    assert isinstance(out[0]["count"], jax.Array) and out[0]["count"].dtype == jnp.int32
    assert int(out[0]["count"]) == 1
    back = treestore.load(tmp_path, "opt", like=blank(state))
    assert type(back[0]) is type(state[0]) and int(back[0].count) == 1
    # the restored state drives the next update exactly like the original
    params = {"dense": {"kernel": jnp.full((3, 4), 0.5), "bias": jnp.zeros(4)}}
    grads = jax.tree.map(jnp.ones_like, params)
    adam = optax.adam(1e-3)
    assert_like_round_trip(adam.update(grads, back, params), adam.update(grads, state, params))


def test_flax_frozendict_comes_back_as_frozendict_with_a_template(tmp_path):
    frozen = CASES["flax-linen-frozendict"]
    treestore.save(tmp_path, frozen, "c")
    assert type(treestore.load(tmp_path, "c")) is dict
    back = treestore.load(tmp_path, "c", like=blank(frozen))
    assert type(back) is type(frozen)
    assert_like_round_trip(back, frozen)


def test_flax_nnx_state_merges_back_into_a_working_model(tmp_path):
    model = _nnx_sequential()
    graphdef, state = nnx.split(model)
    treestore.save(tmp_path, state, "c")
    plain = treestore.load(tmp_path, "c")
    assert list(plain["layers"]) == [0, 2]  # int keys of the nnx state stay ints
    assert treestore.Store(tmp_path).manifest("c").leaves[0].address == "layers/{0}/bias/.value"
    loaded = treestore.load(tmp_path, "c", like=blank(state))
    assert_like_round_trip(loaded, state)
    back = nnx.merge(graphdef, loaded)
    x = jnp.array([[1.0, -1.0]])  # jnp.ones gives 0 for this model, as a model of zeros would
    assert np.asarray(model(x)).any()
    assert np.array_equal(np.asarray(back(x)), np.asarray(model(x)))


def test_equinox_module_comes_back_as_the_module(tmp_path):
    model = eqx.nn.MLP(2, 2, 8, 2, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    treestore.save(tmp_path, params, "c")
    back = eqx.combine(treestore.load(tmp_path, "c", like=blank(params)), static)
    x = jnp.array([0.5, -1.0])
    assert np.array_equal(np.asarray(back(x)), np.asarray(model(x)))


# --------------------------------------------------------------------------------------------------
# dict keys


@pytest.mark.parametrize("bad_key", [(1, 2), 1.5, None, b"bytes", frozenset()])
def test_unsupported_dict_keys_are_refused_naming_the_path(tmp_path, bad_key):
    tree = {"outer": [arange(1), {"ok": 1, bad_key: arange(2)}]}
    with pytest.raises(treestore.errors.UnsupportedKeyError) as info:
        treestore.save(tmp_path, tree, "c")
    assert info.value.address == "outer/1"
    assert str(info.value).startswith("outer/1:")
    assert repr(bad_key) in str(info.value) and type(bad_key).__name__ in str(info.value)
    assert treestore.Store(tmp_path).list() == []


def test_unsupported_key_at_the_root(tmp_path):
    with pytest.raises(treestore.errors.UnsupportedKeyError) as info:
        treestore.save(tmp_path, {(1, 2): 0}, "c")
    assert "the root" in str(info.value)


class Twins:
    """A custom node whose two children are registered under the same key entry."""

    def __init__(self, first: Any, second: Any) -> None:
        self.first, self.second = first, second


jax.tree_util.register_pytree_with_keys(
    Twins,
    lambda n: (((jax.tree_util.GetAttrKey("w"), n.first), (jax.tree_util.GetAttrKey("w"), n.second)), None),
    lambda _, children: Twins(*children),
)


def test_duplicate_key_entries_are_refused_before_writing(tmp_path):
    # jax accepts this node, but its two leaves would share the address "net/.w"
    tree = {"net": Twins(np.zeros(2, np.float32), np.ones(3, np.float32))}
    assert [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]] == [
        "['net'].w",
        "['net'].w",
    ]
    with pytest.raises(treestore.errors.UnsupportedKeyError) as info:
        treestore.save(tmp_path, tree, "c")
    assert "net/.w" in str(info.value)
    assert treestore.Store(tmp_path).list() == []


@pytest.mark.parametrize("key", [2**64 - 1, -(2**63), 0])
def test_int_keys_at_the_ends_of_the_range_round_trip(tmp_path, key):
    # SPEC section 7: int dict keys in [-2**63, 2**64) are stored, as {i}
    tree = {key: arange(3)}
    treestore.save(tmp_path, tree, "c")
    out = treestore.load(tmp_path, "c")
    assert_tree_equal(out, tree)
    assert type(next(iter(out))) is int
    assert [e.address for e in treestore.Store(tmp_path).manifest("c").leaves] == ["{" + str(key) + "}"]


@pytest.mark.parametrize(
    "key", [2**64, -(2**63) - 1, 2**100, "\ud800"], ids=["2**64", "-2**63-1", "2**100", "lone-surrogate"]
)
def test_keys_spec_forbids_are_refused_before_writing(tmp_path, key):
    # ints outside [-2**63, 2**64) and str keys that are not valid Unicode are valid Python dict
    # keys that SPEC section 7 gives no address: a save raises UnsupportedKeyError naming the
    # node before it writes anything
    tree = {"ok": arange(2), "node": {key: arange(3)}}
    with pytest.raises(treestore.errors.UnsupportedKeyError) as info:
        treestore.save(tmp_path, tree, "c")
    assert info.value.address == "node" and str(info.value).startswith("node:")
    assert treestore.Store(tmp_path).list() == []
    assert not [p for p in tmp_path.rglob("*") if p.is_file()], "a refused save wrote files"


def test_int_and_bool_keys_keep_their_types():
    url = fresh_url()
    tree = {0: arange(1), 5: {-3: "neg", 2**40: "big"}, "7": "str seven"}
    treestore.save(url, tree, "c")
    out = treestore.load(url, "c")
    assert_tree_equal(out, tree)
    assert list(out) == [0, 5, "7"] and [type(k) for k in out] == [int, int, str]
    assert [type(k) for k in out[5]] == [int, int]

    bools = {True: 1, False: arange(2)}
    treestore.save(url, bools, "b")
    out = treestore.load(url, "b")
    assert list(out) == [True, False] and all(type(k) is bool for k in out)
    assert_tree_equal(out, bools)
    assert_like_round_trip(treestore.load(url, "b", like=blank(bools)), bools)
    assert [e.address for e in treestore.Store(url).manifest("b").leaves] == ["{false}", "{true}"]


def test_mixed_int_and_str_keys_in_one_dict(tmp_path):
    tree = {"b": arange(2), 1: "one", "a": [1, 2], 0: {"x": None}}
    treestore.save(tmp_path, tree, "c")
    out = treestore.load(tmp_path, "c")
    assert_tree_equal(out, tree)
    assert list(out) == ["b", 1, "a", 0]


def test_keys_that_look_like_other_keys_stay_distinct(tmp_path):
    tree = {"0": 1, 0: 2, "{0}": 3, "a/b": 4, "": 5, ".x": 6, "#1": 7, 'q"uote': 8, "%": 9, True: 10}
    treestore.save(tmp_path, tree, "c")
    addresses = [e.address for e in treestore.Store(tmp_path).manifest("c").leaves]
    assert len(set(addresses)) == len(tree)
    assert_tree_equal(treestore.load(tmp_path, "c"), tree)


# --------------------------------------------------------------------------------------------------
# property: load(save(t)) == t for random builtin trees

_ARRAY_DTYPES = [np.float32, np.int8, np.uint16, np.bool_, np.complex64, ml_dtypes.bfloat16]
_arrays = strategies.arrays(_ARRAY_DTYPES, max_side=3)
_trees = strategies.trees(
    st.one_of(
        strategies.scalars(),
        st.builds(np.float32, st.floats(width=32)),
        st.builds(np.int64, st.integers(-(2**63), 2**63 - 1)),
        _arrays,
        _arrays.map(jnp.asarray),
    ),
    keys=strategies.KEYS | st.integers(-1000, 1000) | st.booleans(),
    containers=("list", "tuple", "dict", "OrderedDict"),
    max_size=4,
    max_leaves=12,
)


@settings(max_examples=50, deadline=None)
@given(tree=_trees)
def test_property_load_of_save_is_the_same_tree(tree):
    url = fresh_url()
    treestore.save(url, tree, "c")
    assert_tree_equal(treestore.load(url, "c"), tree)


@settings(max_examples=50, deadline=None)
@given(tree=_trees)
def test_property_the_node_table_a_save_builds_is_the_one_readers_build(tree):
    """A save builds its node table while it walks the tree (each node's children numbered when
    the node is reached); reading its version-1 record back gives the same tree, and leaves are
    in jax's flattening order."""
    prepared = prepare(tree)
    again = nodes_from_tree(prepared.tree, len(prepared.leaves))
    addresses = [a for a, _ in prepared.leaves]
    assert prepared.nodes.addresses() == again.addresses() == addresses
    assert again.tree_record() == prepared.tree
    try:
        paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    except ValueError:  # dict keys that do not sort (1 and "a"): jax cannot flatten the tree
        return
    assert addresses == [treestore.format_address(p) for p, _ in paths]


def test_a_node_of_leaves_only_takes_no_task_per_leaf(monkeypatch: pytest.MonkeyPatch) -> None:
    """At 100k small leaves each walk step per leaf shows in a save's time: a node whose children
    are all arrays or Python values visits them as it reaches them, without a task on the walk's
    stack for each (or a close task for itself), in the same order and with the same node table."""
    from treestore._tree import structure

    closed: list[Any] = []

    class Counted(structure._Close):
        __slots__ = ()

        def __init__(self, container: Any) -> None:
            closed.append(container)
            super().__init__(container)

    monkeypatch.setattr(structure, "_Close", Counted)
    tree = {f"g{i}": {f"w{j}": np.full(2, i * 10 + j) for j in (3, 1, 2)} | {"n": i} for i in range(10)}
    tree["mixed"] = {"a": np.ones(1), "b": {"c": 1}}
    visited: list[tuple[str, Any]] = []
    nodes = structure.flatten(tree, visited)
    assert [id(c) for c in closed] == [id(tree), id(tree["mixed"])]  # not one per group of leaves
    assert [id(v) for _, v in visited] == [id(x) for x in jax.tree.leaves(tree)]  # jax's order
    assert [a for a, _ in visited[:4]] == ["g0/n", "g0/w1", "g0/w2", "g0/w3"]
    assert nodes.addresses() == [a for a, _ in visited]  # each leaf's node names its address
    assert len(nodes.leaves) == len(visited) == 10 * 4 + 2
