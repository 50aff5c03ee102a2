"""Exact types back without a template, for the types a caller names (``load(..., types=[...])``).

A namedtuple comes back as its class when the stored fields are its ``_fields``; a dataclass (flax
struct dataclasses such as ``TrainState``, ``jax.tree_util.register_dataclass`` classes) when the
stored keys are its fields and the class flattens back to them; static fields are not stored and
come back as their default or None. A named class whose fields do not match is a
StructureMismatchError naming the address; a stored name the caller did not pass stays a dict, and
nothing is ever imported.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import treestore
from tests.support import hostile
from tests.support.helpers import assert_tree_equal
from treestore.errors import StructureMismatchError


class Pair(NamedTuple):
    a: Any
    b: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    w: Any
    b: Any
    name: str = dataclasses.field(default="dense", metadata={"static": True})


class Plain:  # neither a namedtuple nor a dataclass
    pass


def url(tmp_path) -> str:
    return str(tmp_path / "store")


def test_namedtuple_comes_back_as_its_class(tmp_path):
    tree = {"p": Pair(np.arange(3.0), 2), "q": [Pair(1, None)]}
    treestore.save(url(tmp_path), tree, "c")
    assert treestore.load(url(tmp_path))["p"] == {"a": pytest.approx(np.arange(3.0)), "b": 2}
    out = treestore.load(url(tmp_path), types=[Pair])
    assert type(out["p"]) is Pair and type(out["q"][0]) is Pair
    assert_tree_equal(out, tree)
    assert treestore.Store(url(tmp_path)).load("c", types=(Pair,))["q"] == [Pair(1, None)]


def test_dataclass_comes_back_with_static_field_default(tmp_path):
    tree = {"l0": Layer(np.ones(2), np.zeros(2), name="enc")}
    treestore.save(url(tmp_path), tree, "c")
    out = treestore.load(url(tmp_path), types=[Layer])["l0"]
    assert type(out) is Layer
    np.testing.assert_array_equal(out.w, np.ones(2))
    assert out.name == "dense"  # static: never stored; the class's default comes back


def test_flax_train_state_round_trips_with_its_optimizer_state(tmp_path):
    tx = optax.adam(1e-3)
    params = {"dense": {"kernel": jnp.ones((2, 3)), "bias": jnp.zeros(3)}}
    state = train_state.TrainState.create(apply_fn=lambda p, x: x, params=params, tx=tx)
    state = state.apply_gradients(grads=jax.tree_util.tree_map(jnp.ones_like, params))
    treestore.save(url(tmp_path), state, "c")
    types = [train_state.TrainState, optax.ScaleByAdamState, optax.EmptyState]
    out = treestore.load(url(tmp_path), types=types)
    assert type(out) is train_state.TrainState
    assert type(out.opt_state[0]) is optax.ScaleByAdamState
    assert type(out.opt_state[1]) is optax.EmptyState
    # apply_fn and tx are static fields: a checkpoint cannot hold them; they come back None.
    assert out.apply_fn is None and out.tx is None
    out = out.replace(apply_fn=state.apply_fn, tx=tx)
    assert_tree_equal(out.params, state.params)
    assert_tree_equal(out.opt_state, state.opt_state)
    again = out.apply_gradients(grads=jax.tree_util.tree_map(jnp.ones_like, params))  # it trains on
    assert int(again.step) == 2
    # Without naming the adam state, the TrainState still comes back; its optimizer state as dicts.
    partly = treestore.load(url(tmp_path), types=[train_state.TrainState])
    assert type(partly) is train_state.TrainState and isinstance(partly.opt_state[0], dict)


def test_manager_restore_passes_types(tmp_path):
    with treestore.CheckpointManager(url(tmp_path), async_save=False) as m:
        m.save(1, {"p": Pair(np.ones(2), 3)})
        assert type(m.restore(types=[Pair])["p"]) is Pair


def test_types_must_be_namedtuples_or_dataclasses(tmp_path):
    treestore.save(url(tmp_path), {"p": Pair(1, 2)}, "c")
    for bad in ([Plain], [dict], Pair, ["tests.tree.test_types.Pair"]):
        with pytest.raises(treestore.InvalidInputError, match="types="):
            treestore.load(url(tmp_path), types=bad)
    with pytest.raises(treestore.InvalidInputError, match="like="):
        treestore.load(url(tmp_path), like={"p": Pair(1, 2)}, types=[Pair])


def test_select_pruning_a_typed_node_gives_a_dict(tmp_path):
    treestore.save(url(tmp_path), {"p": Pair(np.ones(2), np.zeros(2))}, "c")
    out = treestore.load(url(tmp_path), types=[Pair], select="p/.a")
    assert list(out["p"]) == ["a"] and isinstance(out["p"], dict)


def _rename_node(tmp_path, name: str, keys: list[Any] | None = None, kind: str | None = None) -> None:
    def change(m: dict[str, Any]) -> None:
        node = m["tree"]["children"][0]  # the node under "p"
        node["name"] = name
        if keys is not None:
            node["keys"] = keys
        if kind is not None:
            node["type"] = kind

    hostile.mutate_manifest(url(tmp_path), "c", change)


def test_hostile_name_with_wrong_fields_is_a_mismatch_naming_the_address(tmp_path):
    treestore.save(url(tmp_path), {"p": Pair(1, 2), "z": 0}, "c")
    # A node claiming to be a Layer (a dataclass the caller trusts) with the fields a, b.
    _rename_node(tmp_path, "tests.tree.test_types.Layer", kind="custom")
    with pytest.raises(StructureMismatchError) as e:
        treestore.load(url(tmp_path), types=[Layer, Pair])
    assert "p: tests.tree.test_types.Layer" in str(e.value) and "'c'" in str(e.value)
    assert "fields ['a', 'b']" in str(e.value) and "['w', 'b']" in str(e.value)
    # A namedtuple node named Pair whose keys are not Pair's fields.
    keys = [["attr", "x"], ["attr", "y"]]
    _rename_node(tmp_path, "tests.tree.test_types.Pair", keys=keys, kind="namedtuple")
    hostile.mutate_manifest(url(tmp_path), "c", hostile.set_leaf("p/.a", address="p/.x"))
    hostile.mutate_manifest(url(tmp_path), "c", hostile.set_leaf("p/.b", address="p/.y"))
    wrong = r"p: tests\.tree\.test_types\.Pair .* fields \['x', 'y'\]"
    with pytest.raises(StructureMismatchError, match=wrong):
        treestore.load(url(tmp_path), types=[Pair])
    # Without types= the same checkpoint loads as dicts, as always.
    assert treestore.load(url(tmp_path)) == {"p": {"x": 1, "y": 2}, "z": 0}


def test_dataclass_node_lacking_a_field_is_a_mismatch(tmp_path):
    treestore.save(url(tmp_path), {"p": Layer(1, 2)}, "c")

    def drop_b(m: dict[str, Any]) -> None:
        node = m["tree"]["children"][0]
        node["keys"], node["children"] = node["keys"][:1], node["children"][:1]
        m["leaves"] = m["leaves"][:1]

    hostile.mutate_manifest(url(tmp_path), "c", drop_b)
    with pytest.raises(StructureMismatchError, match=r"also needs \['b'\]"):
        treestore.load(url(tmp_path), types=[Layer])


def test_stored_names_never_import_or_construct_anything(tmp_path, monkeypatch):
    # A module that records being imported, on sys.path: a store naming it must never import it.
    marker = tmp_path / "imported"
    (tmp_path / "ts_hostile_probe.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nclass Boom:\n    def __init__(self, *a, **k):\n"
        f"        open({str(marker)!r}, 'w').close()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    treestore.save(url(tmp_path), {"p": Pair(1, 2), "q": Pair(3, 4)}, "c")

    def change(m: dict[str, Any]) -> None:
        m["tree"]["children"][0]["name"] = "os.system"
        m["tree"]["children"][1]["name"] = "ts_hostile_probe.Boom"

    hostile.mutate_manifest(url(tmp_path), "c", change)
    out = treestore.load(url(tmp_path), types=[Pair])
    assert out == {"p": {"a": 1, "b": 2}, "q": {"a": 3, "b": 4}}
    assert not marker.exists() and "ts_hostile_probe" not in sys.modules


def test_types_on_an_s3_store(s3_backend):
    url = s3_backend.url("types")
    opts = s3_backend.storage_options
    tree = {"p": Pair(np.arange(3.0), np.ones(2)), "n": 1}
    treestore.save(url, tree, "a", storage_options=opts)
    back = treestore.load(f"{url}#a", types=[Pair], storage_options=opts)
    assert type(back["p"]) is Pair
    assert_tree_equal(back, tree)
    assert isinstance(treestore.load(f"{url}#a", storage_options=opts)["p"], dict)
