"""A custom pytree node that carries any key entries, for trees whose keys collide or clash."""

from __future__ import annotations

from typing import Any

import jax


class Node:
    """A custom pytree node whose children carry the key entries it is built with."""

    def __init__(self, keys: list[Any], children: list[Any]) -> None:
        self.keys = list(keys)
        self.children = list(children)


jax.tree_util.register_pytree_with_keys(
    Node,
    lambda n: (list(zip(n.keys, n.children, strict=True)), tuple(n.keys)),
    lambda keys, children: Node(list(keys), list(children)),
    lambda n: (list(n.children), tuple(n.keys)),
)
