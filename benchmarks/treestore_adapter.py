"""treestore in the side-by-side benchmark, with default settings."""

from __future__ import annotations

import numpy as np

import treestore

from .peers import Adapter, Tree, register


@register
class TreestoreAdapter(Adapter):
    name = "treestore"

    def save(self, tree: Tree, path: str) -> None:
        treestore.save(path, tree, "ckpt")

    def load(self, path: str, like: Tree) -> Tree:
        return treestore.load(path, "ckpt")  # type: ignore[no-any-return]

    def load_one(self, path: str, key: str, like: Tree) -> np.ndarray:
        return np.asarray(treestore.open(path, "ckpt")[key.replace(".", "/")])
