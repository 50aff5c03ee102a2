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
    check_node_keys,
    format_address,
    format_key,
    join_address,
    key_from_record,
    key_to_record,
    key_value,
)
from treestore._format.limits import MAX_DEPTH
from treestore.errors import InvalidInputError, UnsupportedKeyError

# Types that are always leaves: no need to ask jax's registry about each one.
_LEAF_TYPES = frozenset({np.ndarray, int, float, bool, complex, str, bytes})


def _jax_order(keys: list[Any]) -> range | list[int]:
    """Positions of a dict's keys in jax's flattening order (sorted) when they sort, else
    insertion order."""
    try:
        return sorted(range(len(keys)), key=keys.__getitem__)
    except TypeError:
        return range(len(keys))


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


class _Close:
    """A task on :func:`flatten`'s stack: the subtree of ``container`` is done. It holds the
    container, so the id in the set of open containers cannot be reused meanwhile."""

    __slots__ = ("container",)

    def __init__(self, container: Any) -> None:
        self.container = container


def flatten(tree: Any, visit: Callable[[str, Any], int]) -> dict[str, Any]:
    """The node record of ``tree``; ``visit(address, leaf)`` is called for each leaf in jax's
    flattening order and returns the leaf's index.

    Raises before returning anything that readers would refuse: UnsupportedKeyError for a key
    that cannot become an address or keys of one node that would collide (naming the path), and
    InvalidInputError for a node deeper than MAX_DEPTH or a container that holds itself. The walk
    is iterative, so Python's recursion limit never decides what can be saved.
    """
    root: list[Any] = [None]
    # A task fills slot ``i`` of the list ``out`` with the record of ``x``, found at ``path``.
    stack: list[Any] = [(tree, (), "", 0, root, 0)]
    open_ids: set[int] = set()  # the containers on the path from the root to the current task
    while stack:
        task = stack.pop()
        if type(task) is _Close:
            open_ids.discard(id(task.container))
            continue
        x, path, address, depth, out, i = task
        where = address or "(root)"
        if depth > MAX_DEPTH:
            raise InvalidInputError(
                f"{where}: the tree is nested deeper than {MAX_DEPTH} containers, the most readers accept",
                address=address,
            )
        if x is None:
            out[i] = {"type": "none"}
            continue
        t = type(x)
        keys: list[Key]
        visits: range | list[int]  # the children's positions in jax's flattening order
        if t is dict or t is collections.OrderedDict:
            order = list(x)
            keys = [DictKey(k) for k in order]
            visits = range(len(order)) if t is collections.OrderedDict else _jax_order(order)
            children = [x[k] for k in order]
            record: dict[str, Any] = {
                "type": "dict" if t is dict else "ordereddict",
                "keys": [key_to_record(k) for k in keys],
            }
        elif t is list or t is tuple:
            keys = [SequenceKey(j) for j in range(len(x))]
            visits = range(len(x))
            children = list(x)
            record = {"type": t.__name__}
        else:
            pairs = None if t in _LEAF_TYPES else _children(x)
            if pairs is None:
                out[i] = {"type": "leaf", "leaf": visit(address, x)}
                continue
            keys = [k for k, _ in pairs]
            visits = range(len(pairs))
            children = [c for _, c in pairs]
            record = {
                "type": "namedtuple" if isinstance(x, tuple) and hasattr(x, "_fields") else "custom",
                "name": f"{t.__module__}.{t.__qualname__}",
                "keys": [key_to_record(k) for k in keys],
            }
        if t is list or t is tuple:
            segments = [str(j) for j in visits]
        else:
            segments = [format_key(k, path) for k in keys]
            if record["type"] in ("namedtuple", "custom"):  # a dict's keys are distinct already
                check_node_keys(keys, segments, address)
        if id(x) in open_ids:
            raise InvalidInputError(
                f"{where}: the tree contains itself here (a {t.__name__} that holds itself); "
                "treestore saves trees, not cyclic graphs",
                address=address,
            )
        record["children"] = slots = [None] * len(children)
        out[i] = record
        if not children:
            continue
        open_ids.add(id(x))
        stack.append(_Close(x))
        for j in reversed(visits):
            child_address = join_address(address, segments[j])
            stack.append((children[j], (*path, keys[j]), child_address, depth + 1, slots, j))
    return root[0]


def rebuild(
    node: dict[str, Any], leaf: Callable[[int], Any], keep: Callable[[str], bool] | None = None
) -> Any:
    """A tree of builtin containers from a (validated) node record; custom nodes become dicts.

    ``leaf(i)`` gives leaf i; subtrees whose leaves are all dropped by ``keep(address)`` are
    pruned (used by partial loads), so the result keeps the shape of what was selected. The walk
    is iterative, so a tree as deep as readers accept never meets Python's recursion limit.
    """
    missing = object()
    root: list[Any] = []
    # A task appends the value of node ``n`` at ``address`` to ``out``; a container's task comes
    # back with the list its children's values were appended to, and then builds the container.
    stack: list[Any] = [(node, "", root, None, ())]
    while stack:
        n, address, out, values, keys = stack.pop()
        kind = n["type"]
        if kind == "leaf":
            out.append(leaf(n["leaf"]) if keep is None or keep(address) else missing)
            continue
        if kind == "none":
            out.append(None if keep is None or keep(address) else missing)
            continue
        children = n["children"]
        if values is None:  # first visit: come back once every child is built
            if kind in ("list", "tuple"):
                segments = [str(j) for j in range(len(children))]
            else:
                keys = tuple(key_from_record(k) for k in n["keys"])
                segments = [format_key(k) for k in keys]
            values = []
            stack.append((n, address, out, values, keys))
            for segment, child in zip(reversed(segments), reversed(children), strict=True):
                stack.append((child, join_address(address, segment), values, None, ()))
            continue
        if kind in ("list", "tuple"):
            kept = [v for v in values if v is not missing]
            out.append(missing if not kept and children else kept if kind == "list" else tuple(kept))
            continue
        kept_pairs = [(key_value(k), v) for k, v in zip(keys, values, strict=True) if v is not missing]
        if not kept_pairs and children:
            out.append(missing)
        elif kind == "ordereddict":
            out.append(collections.OrderedDict(kept_pairs))
        else:
            out.append(dict(kept_pairs))
    return None if root[0] is missing else root[0]


def leaves_with_addresses(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    """``(address, leaf)`` pairs of a template tree in jax order, and its treedef."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [(format_address(path), leaf) for path, leaf in pairs], treedef
