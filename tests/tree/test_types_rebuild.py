"""``load(..., types=[...])`` with classes that cannot rebuild what is stored: a constructor that
raises, a class that flattens to other keys than those stored, and two classes of one name. Each
is refused naming the address and why; nothing is guessed."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any, NamedTuple

import jax
import numpy as np
import pytest

import treestore
from treestore.errors import StructureMismatchError


class Pair(NamedTuple):
    a: Any
    b: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    w: Any
    b: Any


def _impostor(cls: type, body: dict[str, Any], bases: tuple[type, ...]) -> type:
    """A class of the same qualified name as ``cls`` (what a checkpoint records), another body."""
    other = type(
        cls.__name__, bases, {"__module__": cls.__module__, "__qualname__": cls.__qualname__, **body}
    )
    return other


@pytest.fixture(scope="module")
def url() -> str:
    u = f"memory://treestore-tests/{uuid.uuid4().hex}"
    treestore.save(u, {"p": Pair(np.ones(3), np.zeros(1)), "l": Layer(np.ones(2), np.zeros(2))}, "c")
    return u


def test_the_classes_themselves_rebuild_it(url):
    out = treestore.load(url, "c", types=[Pair, Layer])
    assert type(out["p"]) is Pair and type(out["l"]) is Layer
    assert np.array_equal(out["p"].a, np.ones(3)) and np.array_equal(out["l"].b, np.zeros(2))


def test_a_namedtuple_whose_constructor_raises_is_named(url):
    def refuse(cls, a, b):
        raise ValueError("a must be positive")

    strict = _impostor(Pair, {"__new__": refuse}, (Pair,))
    with pytest.raises(StructureMismatchError) as caught:
        treestore.load(url, "c", types=[strict, Layer])
    assert "p: Pair(...) raised ValueError: a must be positive" in str(caught.value), str(caught.value)


def test_a_dataclass_whose_constructor_raises_is_named(url):
    def check(self):
        raise TypeError("w must be a jax array")

    strict = dataclasses.dataclass(
        _impostor(Layer, {"__annotations__": {"w": Any, "b": Any}, "__post_init__": check}, ())
    )
    jax.tree_util.register_dataclass(strict, data_fields=["w", "b"], meta_fields=[])
    with pytest.raises(StructureMismatchError) as caught:
        treestore.load(url, "c", types=[Pair, strict])
    assert "l: Layer(...) raised TypeError: w must be a jax array" in str(caught.value), str(caught.value)


def test_a_dataclass_that_flattens_to_other_keys_is_not_this_node(url):
    """A class of the stored name whose pytree keeps ``b`` out of its children: rebuilt from the
    stored fields it flattens to ``.w`` alone, so it is not the class that was saved."""
    other = dataclasses.dataclass(_impostor(Layer, {"__annotations__": {"w": Any, "b": Any}}, ()))
    jax.tree_util.register_dataclass(other, data_fields=["w"], meta_fields=["b"])
    with pytest.raises(StructureMismatchError) as caught:
        treestore.load(url, "c", types=[Pair, other])
    assert "l: Layer rebuilt from fields ['w', 'b'] flattens to keys ['.w'], not those stored" in str(
        caught.value
    )


def test_two_classes_of_one_name_are_refused(url):
    twin = _impostor(Pair, {}, (Pair,))
    with pytest.raises(
        treestore.InvalidInputError, match=r"types= names two different classes called '.*Pair'$"
    ):
        treestore.load(url, "c", types=[Pair, twin])
