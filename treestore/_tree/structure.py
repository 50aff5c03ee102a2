"""Trees <-> node records and leaves; rebuilding trees with or without a template.

Node records (msgpack maps) keep what is needed to rebuild builtin containers exactly: dict key
order, list vs tuple, None, OrderedDict. Other nodes (namedtuples, dataclasses, flax and equinox
modules, optax states) keep their type's name for display and their key entries; without a template
they come back as plain dicts keyed by those entries. Types are never imported from a store.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.tree_util import DictKey, SequenceKey

from treestore._format.address import (
    Key,
    KeyPath,
    format_address,
    format_key,
    key_from_record,
    key_to_record,
    key_value,
)
from treestore.errors import UnsupportedKeyError

# Types that are always leaves: no need to ask jax's registry about each one.
_LEAF_TYPES = frozenset({np.ndarray, int, float, bool, complex, str, bytes})


def _sorted_keys(d: dict[Any, Any]) -> list[Any]:
    """Dict keys in jax's flattening order (sorted) when they sort, else insertion order."""
    try:
        return sorted(d)
    except TypeError:
        return list(d)


def _children(node: Any) -> list[tuple[Key, Any]] | None:
    """One level of a jax pytree node: (key entry, child) pairs, or None for a leaf."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda y: y is not node)
    if jax.tree_util.treedef_is_leaf(treedef) and len(pairs) == 1 and pairs[0][0] == ():
        return None
    out = []
    for path, child in pairs:
        if len(path) != 1:  # pragma: no cover - jax always yields one key per child here
            raise UnsupportedKeyError(f"node {type(node).__name__} yielded key path {path!r}")
        out.append((path[0], child))
    return out


def flatten(tree: Any, visit: Callable[[str, Any], int]) -> dict[str, Any]:
    """The node record of ``tree``; ``visit(address, leaf)`` is called for each leaf in order and
    returns the leaf's index. Unsupported keys raise UnsupportedKeyError naming their path."""

    def join(address: str, path: KeyPath, key: Key) -> str:
        segment = format_key(key, path)
        return f"{address}/{segment}" if path else segment

    def walk(x: Any, path: KeyPath, address: str) -> dict[str, Any]:
        if x is None:
            return {"type": "none"}
        t = type(x)
        if t is dict or t is collections.OrderedDict:
            order = list(x)
            keys = order if t is collections.OrderedDict else _sorted_keys(x)
            entries = {}
            for k in keys:
                key = DictKey(k)
                entries[k] = walk(x[k], (*path, key), join(address, path, key))
            return {
                "type": "dict" if t is dict else "ordereddict",
                "keys": [key_to_record(DictKey(k)) for k in order],
                "children": [entries[k] for k in order],
            }
        if t is list or t is tuple:
            children = []
            for i, c in enumerate(x):
                key = SequenceKey(i)
                children.append(walk(c, (*path, key), join(address, path, key)))
            return {"type": t.__name__, "children": children}
        pairs = None if t in _LEAF_TYPES else _children(x)
        if pairs is None:
            return {"type": "leaf", "leaf": visit(address, x)}
        kind = "namedtuple" if isinstance(x, tuple) and hasattr(x, "_fields") else "custom"
        return {
            "type": kind,
            "name": f"{t.__module__}.{t.__qualname__}",
            "keys": [key_to_record(k) for k, _ in pairs],
            "children": [walk(c, (*path, k), join(address, path, k)) for k, c in pairs],
        }

    return walk(tree, (), "")


def rebuild(
    node: dict[str, Any], leaf: Callable[[int], Any], keep: Callable[[str], bool] | None = None
) -> Any:
    """A tree of builtin containers from a node record; custom nodes become dicts.

    ``leaf(i)`` gives leaf i; subtrees whose leaves are all dropped by ``keep(address)`` are
    pruned (used by partial loads), so the result keeps the shape of what was selected.
    """
    missing = object()

    def wanted(path: KeyPath) -> bool:
        return keep is None or keep(format_address(path))

    def walk(n: dict[str, Any], path: KeyPath) -> Any:
        kind = n["type"]
        if kind == "leaf":
            return leaf(n["leaf"]) if wanted(path) else missing
        if kind == "none":
            return None if wanted(path) else missing
        children = n["children"]
        if kind in ("list", "tuple"):
            items = [walk(c, (*path, SequenceKey(i))) for i, c in enumerate(children)]
            kept = [x for x in items if x is not missing]
            if not kept and children:
                return missing
            return kept if kind == "list" else tuple(kept)
        keys = [key_from_record(k) for k in n["keys"]]
        pairs = [(key_value(k), walk(c, (*path, k))) for k, c in zip(keys, children, strict=True)]
        kept_pairs = [(k, v) for k, v in pairs if v is not missing]
        if not kept_pairs and children:
            return missing
        if kind == "ordereddict":
            return collections.OrderedDict(kept_pairs)
        return dict(kept_pairs)

    out = walk(node, ())
    return None if out is missing else out


def leaves_with_addresses(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    """``(address, leaf)`` pairs of a template tree in jax order, and its treedef."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [(format_address(path), leaf) for path, leaf in pairs], treedef
