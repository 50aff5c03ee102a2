"""Trees <-> node records and leaves; rebuilding trees with or without a template.

Node records (msgpack maps) keep what is needed to rebuild builtin containers exactly: dict key
order, list vs tuple, None, OrderedDict. Other nodes (namedtuples, dataclasses, flax and equinox
modules, optax states) keep their type's name and their key entries; without a template they come
back as plain dicts keyed by those entries, unless the caller names the type (``types=``, see
:func:`trusted_types`). Types are never imported from a store: a stored name is only looked up among
the classes the caller passed.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from treestore._format.address import (
    DictKey,
    GetAttrKey,
    Key,
    SequenceKey,
    check_node_keys,
    dict_key_segment,
    format_address,
    format_key,
    join_address,
    join_addresses,
    key_from_record,
    key_value,
)
from treestore._format.encoding import Bad
from treestore._format.limits import MAX_ADDRESS_CHARS, MAX_DEPTH
from treestore._format.manifest.tree import (
    CUSTOM,
    DICT,
    LEAF,
    LIST,
    NAMEDTUPLE,
    NODE_DTYPE,
    NONE,
    ORDEREDDICT,
    TUPLE,
    Nodes,
    check_nodes,
)
from treestore._tree.jax_import import jax
from treestore._tree.keys import from_jax
from treestore.errors import (
    InvalidInputError,
    StructureMismatchError,
    UnsupportedFormatError,
    UnsupportedKeyError,
)

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
    """One level of a jax pytree node: (key entry, child) pairs, or None for a leaf; the key
    entries are the format's (:func:`treestore._tree.keys.from_jax`)."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda y: y is not node)
    if jax.tree_util.treedef_is_leaf(treedef) and len(pairs) == 1 and pairs[0][0] == ():
        return None
    out = []
    for path, child in pairs:
        if len(path) != 1:  # pragma: no cover - jax always yields one key per child here
            raise UnsupportedKeyError(f"node {type(node).__name__} yielded key path {path!r}")
        out.append((from_jax(path[0]), child))
    return out


class _Close:
    """A task on :func:`flatten`'s stack: the subtree of ``container`` is done. It holds the
    container, so the id in the set of open containers cannot be reused meanwhile."""

    __slots__ = ("container",)

    def __init__(self, container: Any) -> None:
        self.container = container


def flatten(tree: Any, found: list[tuple[str, Any]]) -> Nodes:
    """The node table of ``tree``; each leaf is appended to ``found`` (given empty) as
    ``(address, leaf)``, in jax's flattening order: its leaf index is its position there.

    A node's children get consecutive node numbers, in the node's own order (a dict's insertion
    order), when the node is reached: every parent comes before its children, as the format
    requires, while the walk itself follows jax's order. Raises before returning anything that
    readers would refuse: UnsupportedKeyError for a key that cannot become an address or keys of
    one node that would collide (naming the path), and InvalidInputError for a node deeper than
    MAX_DEPTH or a container that holds itself. The walk is iterative, so Python's recursion
    limit never decides what can be saved.
    """
    kinds: list[int] = [NONE]  # filled in as each node is reached
    parents: list[int] = [0]
    keys: list[int] = [0]
    where: dict[str, int] = {}  # distinct segments, numbered in order of first use
    names: list[tuple[int, str]] = []  # (node, type name) of namedtuple and custom nodes
    leaf_nodes: list[int] = []  # each leaf's node, by leaf index
    # A task: the subtree ``x`` found at ``path`` (address ``address``) is node ``me``.
    stack: list[Any] = [(tree, (), "", 0, 0)]
    open_ids: set[int] = set()  # the containers on the path from the root to the current task
    while stack:
        task = stack.pop()
        if type(task) is _Close:
            open_ids.discard(id(task.container))
            continue
        x, path, address, depth, me = task
        where_ = address or "(root)"
        if depth > MAX_DEPTH:
            raise InvalidInputError(
                f"{where_}: the tree is nested deeper than {MAX_DEPTH} containers, the most readers accept",
                address=address,
            )
        if x is None:
            continue  # kinds[me] is NONE already
        t = type(x)
        node_keys: list[Any]  # key entries; a dict's own keys for a dict
        visits: range | list[int]  # the children's positions in jax's flattening order
        if t is dict or t is collections.OrderedDict:
            order = list(x)
            node_keys = order  # the dict's own keys: key entries made only for paths below
            visits = range(len(order)) if t is collections.OrderedDict else _jax_order(order)
            children = [x[k] for k in order]
            kind = DICT if t is dict else ORDEREDDICT
        elif t is list or t is tuple:
            node_keys = [SequenceKey(j) for j in range(len(x))]
            visits = range(len(x))
            children = list(x)
            kind = LIST if t is list else TUPLE
        else:
            pairs = None if t in _LEAF_TYPES else _children(x)
            if pairs is None:
                kinds[me] = LEAF
                leaf_nodes.append(me)
                found.append((address, x))
                continue
            node_keys = [k for k, _ in pairs]
            visits = range(len(pairs))
            children = [c for _, c in pairs]
            kind = NAMEDTUPLE if isinstance(x, tuple) and hasattr(x, "_fields") else CUSTOM
            names.append((me, type_name(t)))
        if kind in (LIST, TUPLE):
            segments = [str(j) for j in visits]
        elif kind in (DICT, ORDEREDDICT):
            segments = [dict_key_segment(k, path) for k in node_keys]
        else:
            segments = [format_key(k, path) for k in node_keys]
            if kind >= NAMEDTUPLE:  # a dict's keys are distinct already
                check_node_keys(node_keys, segments, address)
        if id(x) in open_ids:
            raise InvalidInputError(
                f"{where_}: the tree contains itself here (a {t.__name__} that holds itself); "
                "treestore saves trees, not cyclic graphs",
                address=address,
            )
        kinds[me] = kind
        if not children:
            continue
        first = len(kinds)
        kinds.extend([NONE] * len(children))
        parents.extend([me] * len(children))
        keys.extend([where.setdefault(s, len(where)) for s in segments])
        addresses = join_addresses(address, segments)
        if max(map(len, addresses)) > MAX_ADDRESS_CHARS:
            _too_long(
                next(a for a in map(addresses.__getitem__, reversed(visits)) if len(a) > MAX_ADDRESS_CHARS)
            )
        if depth < MAX_DEPTH and all(type(c) in _LEAF_TYPES for c in children):
            # Leaves only (a layer's arrays): visited now, in the order the stack would give them.
            kinds[first:] = [LEAF] * len(children)
            if type(visits) is range:
                leaf_nodes.extend(range(first, first + len(children)))
                found.extend(zip(addresses, children, strict=True))
            else:
                leaf_nodes.extend([first + j for j in visits])
                found.extend([(addresses[j], children[j]) for j in visits])
            continue
        open_ids.add(id(x))
        stack.append(_Close(x))
        for j in reversed(visits):
            key = DictKey(node_keys[j]) if kind in (DICT, ORDEREDDICT) else node_keys[j]
            stack.append((children[j], (*path, key), addresses[j], depth + 1, first + j))
    table = np.zeros(len(kinds), NODE_DTYPE)
    table["kind"], table["parent"], table["key"] = kinds, parents, keys
    names.sort()
    leaves = np.argsort(np.array(leaf_nodes, np.int64), kind="stable").astype("<u4")  # by node
    try:
        return check_nodes(tuple(where), table, tuple(n for _, n in names), leaves, len(leaf_nodes))
    except (Bad, UnsupportedFormatError) as exc:  # never for a tree this walk accepted
        raise InvalidInputError(f"the tree's structure would not be readable: {exc}") from None


def _too_long(address: str) -> None:
    raise InvalidInputError(
        f"{address[:80]}...: an address of {len(address)} characters, over the limit of "
        f"{MAX_ADDRESS_CHARS} readers accept (shorter keys, or less nesting)",
        address=address[:80],
    )


def any_node(tree: Any, test: Callable[[Any], bool]) -> bool:
    """Whether ``test`` holds for ``tree`` or any node or leaf in it (a tree :func:`flatten`
    accepted: no cycles, bounded depth). Dicts are walked in insertion order: jax's own walk sorts
    their keys and raises ValueError for keys that do not sort (1 and "a"), which a save accepts."""
    stack = [tree]
    while stack:
        x = stack.pop()
        if test(x):
            return True
        if type(x) is dict or type(x) is collections.OrderedDict:
            stack.extend(x.values())
        elif type(x) is list or type(x) is tuple:
            stack.extend(x)
        elif x is not None and type(x) not in _LEAF_TYPES:
            stack.extend(child for _, child in _children(x) or ())
    return False


def type_name(cls: type) -> str:
    """The name a node record stores for a node of type ``cls``: ``module.qualname``."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple)


def trusted_types(types: Iterable[type] | None) -> dict[str, type]:
    """The classes a caller lets a load construct (``types=``), by the name a node record stores.

    Only namedtuple classes and dataclasses (flax struct dataclasses, dataclasses registered with
    ``jax.tree_util.register_dataclass``, equinox modules) can be rebuilt from their stored fields;
    anything else, or two classes of one name, is an InvalidInputError.
    """
    if types is None:
        return {}
    if isinstance(types, (type, str, bytes)) or not isinstance(types, Iterable):
        raise InvalidInputError(f"types= is a list of classes, got {types!r}")
    out: dict[str, type] = {}
    for cls in types:
        if not isinstance(cls, type) or not (_is_namedtuple(cls) or dataclasses.is_dataclass(cls)):
            raise InvalidInputError(
                f"types= takes namedtuple classes and dataclasses, got {cls!r}; "
                "load other custom nodes with like= (a template of the tree)"
            )
        name = type_name(cls)
        if out.get(name, cls) is not cls:
            raise InvalidInputError(f"types= names two different classes called {name!r}")
        out[name] = cls
    return out


def _static(f: dataclasses.Field[Any]) -> bool:
    """A dataclass field that a pytree keeps out of its children (flax ``pytree_node=False``,
    jax ``metadata={"static": True}``), so a checkpoint never holds it."""
    return f.metadata.get("pytree_node", True) is False or f.metadata.get("static", False) is True


def _fields_differ(where: str, n: Mapping[str, Any], found: list[Any], cls: type, expected: list[Any]) -> str:
    return (
        f"{where}: {n['name']} is stored as a {n['type']} node with fields {found}; "
        f"{cls.__name__} ({'a namedtuple' if _is_namedtuple(cls) else 'a dataclass'}) has fields {expected}"
    )


def _construct(
    cls: type, n: Mapping[str, Any], keys: tuple[Key, ...], values: list[Any], where: str
) -> tuple[Any, str | None]:
    """``cls`` rebuilt from a node's keys and children, or (None, the reason it cannot be)."""
    name = n["name"]
    found = [key_value(k) if isinstance(k, GetAttrKey) else format_key(k) for k in keys]
    if _is_namedtuple(cls):
        expected: list[Any] = list(cls._fields)  # type: ignore[attr-defined]
        if n["type"] != "namedtuple" or not all(isinstance(k, GetAttrKey) for k in keys) or found != expected:
            return None, _fields_differ(where, n, found, cls, expected)
        try:
            return cls(*values), None
        except Exception as exc:
            return None, f"{where}: {cls.__name__}(...) raised {type(exc).__name__}: {exc}"
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    data = [f for f, v in fields.items() if not _static(v)]
    if (
        n["type"] != "custom"
        or not all(isinstance(k, GetAttrKey) for k in keys)
        or not set(found) <= set(fields)
    ):
        return None, _fields_differ(where, n, found, cls, data)
    lacking = [
        f
        for f, v in fields.items()
        if f not in found
        and not _static(v)
        and v.default is dataclasses.MISSING
        and v.default_factory is dataclasses.MISSING
    ]
    if lacking:
        return None, f"{where}: {name} stored with fields {found}; {cls.__name__} also needs {lacking}"
    # Static fields are not in a checkpoint: their default, else None (the caller sets them back).
    unset = {
        f: None
        for f, v in fields.items()
        if f not in found and v.default is dataclasses.MISSING and v.default_factory is dataclasses.MISSING
    }
    try:
        obj = cls(**dict(zip(map(str, found), values, strict=True)), **unset)
        again = _children(obj)
    except Exception as exc:
        return None, f"{where}: {cls.__name__}(...) raised {type(exc).__name__}: {exc}"
    # The class's own pytree flattening must give back the stored keys, else it is not this node.
    if again is None or [k for k, _ in again] != list(keys):
        shown = None if again is None else [format_key(k) for k, _ in again]
        return (
            None,
            f"{where}: {cls.__name__} rebuilt from fields {found} flattens to keys {shown}, not those stored",
        )
    return obj, None


def rebuild(
    node: dict[str, Any],
    leaf: Callable[[int], Any],
    keep: Callable[[str], bool] | None = None,
    types: Mapping[str, type] | None = None,
    checkpoint: str | None = None,
) -> Any:
    """A tree of builtin containers from a (validated) node record; custom nodes become dicts.

    ``leaf(i)`` gives leaf i; subtrees whose leaves are all dropped by ``keep(address)`` are
    pruned (used by partial loads), so the result keeps the shape of what was selected. The walk
    is iterative, so a tree as deep as readers accept never meets Python's recursion limit.

    ``types`` (from :func:`trusted_types`) names the classes to rebuild: a namedtuple or custom
    node whose stored name is one of them, none of whose children was pruned, becomes that class
    when its keys are the class's fields (see :func:`_construct`); a name not among them stays a
    dict. A named class whose fields do not match raises one StructureMismatchError listing every
    such node (of checkpoint ``checkpoint``).
    """
    problems: list[str] = []
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
        cls = types.get(n.get("name", "")) if types and kind in ("namedtuple", "custom") else None
        if not kept_pairs and children:
            out.append(missing)
        elif cls is not None and len(kept_pairs) == len(values):
            obj, problem = _construct(cls, n, keys, values, address or "(root)")
            if problem is not None:
                problems.append(problem)
            out.append(dict(kept_pairs) if problem is not None else obj)
        elif kind == "ordereddict":
            out.append(collections.OrderedDict(kept_pairs))
        else:
            out.append(dict(kept_pairs))
    if problems:
        raise StructureMismatchError(problems, checkpoint=checkpoint)
    return None if root[0] is missing else root[0]


def leaves_with_addresses(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    """``(address, leaf)`` pairs of a template tree in jax order, and its treedef."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [(format_address(path), leaf) for path, leaf in pairs], treedef
