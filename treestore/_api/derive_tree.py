"""The tree a derive edits: a base checkpoint's node records as mutable nodes, so that nodes
not touched keep their type, keys and type name (a flax module stays a ``custom`` node with
``.attr`` keys). :class:`EditTree` finds, drops, attaches and prunes subtrees by address;
:func:`emit` writes the edited tree back as node records, leaves in jax's flattening order.
Every walk is iterative: a tree as deep as the format allows (MAX_DEPTH) never meets Python's
recursion limit.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from treestore._format import select as _select
from treestore._format.address import (
    DictKey,
    Key,
    SequenceKey,
    check_node_keys,
    format_address,
    format_key,
    join_address,
    key_from_record,
    key_to_record,
    key_value,
    parse_address,
)
from treestore._format.limits import MAX_DEPTH
from treestore.errors import InvalidInputError, NoMatchError, TreestoreError


@dataclass(eq=False)
class Node:
    """A tree node being edited: a node record's fields, mutable. Leaves point at a base leaf
    entry (``leaf``) or at a new leaf (``new``)."""

    kind: str
    keys: list[Key] = field(default_factory=list)
    children: list[Node] = field(default_factory=list)
    name: str | None = None
    leaf: int | None = None
    new: int | None = None
    emptied: bool = False  # a child was removed here: pruned if it ends up empty

    @property
    def container(self) -> bool:
        return self.kind not in ("leaf", "none")

    def segments(self) -> list[str]:
        return [format_key(k) for k in self.keys]


def node_of(record: dict[str, Any], *, new_offset: int | None = None) -> Node:
    """A validated node record (a manifest's, or one :func:`prepare` made) as a :class:`Node`;
    leaf indices are base leaves, or new leaves numbered from ``new_offset``. Iterative, as are
    the other walks here: a tree as deep as readers accept (MAX_DEPTH) needs no deep stack."""
    root = _shell(record, new_offset)
    todo = [(root, record)]
    while todo:
        node, rec = todo.pop()
        if node.container:
            node.children = [_shell(c, new_offset) for c in rec["children"]]
            todo.extend(zip(node.children, rec["children"], strict=True))
    return root


def _shell(record: dict[str, Any], new_offset: int | None) -> Node:
    """The node of ``record`` without its children (see :func:`node_of`)."""
    kind = record["type"]
    if kind == "leaf":
        i = record["leaf"]
        return Node(kind, leaf=i) if new_offset is None else Node(kind, new=new_offset + i)
    if kind == "none":
        return Node(kind)
    if kind in ("list", "tuple"):
        keys: list[Key] = [SequenceKey(i) for i in range(len(record["children"]))]
    else:
        keys = [key_from_record(k) for k in record["keys"]]
    return Node(kind, keys, [], record.get("name"))


def _height(node: Node) -> int:
    """How many container levels ``node`` spans (0 for a leaf)."""
    height = 0
    todo = [(node, 1)]
    while todo:
        n, depth = todo.pop()
        if n.container:
            height = max(height, depth)
            todo.extend((c, depth + 1) for c in n.children)
    return height


def _jax_order(node: Node) -> Sequence[int]:
    """The order jax flattens the children in: a dict's by sorted key when its keys sort."""
    if node.kind != "dict":
        return range(len(node.children))
    values: list[Any] = [key_value(k) for k in node.keys]
    try:
        return sorted(range(len(values)), key=values.__getitem__)
    except TypeError:
        return range(len(values))


def emit(root: Node, address: str, leaves: list[tuple[str, Node]]) -> dict[str, Any]:
    """The node record of ``root``; its leaves are appended to ``leaves`` in jax's order (depth
    first, each node's children in :func:`_jax_order`)."""
    top: list[Any] = [None]
    todo = [(root, address, top, 0)]  # a node, its address, and the slot its record goes in
    while todo:
        node, at, slots, j = todo.pop()
        if node.kind == "leaf":
            leaves.append((at, node))
            slots[j] = {"type": "leaf", "leaf": len(leaves) - 1}
            continue
        if node.kind == "none":
            slots[j] = {"type": "none"}
            continue
        if node.kind in ("list", "tuple"):
            node.keys = [SequenceKey(i) for i in range(len(node.children))]  # renumbered after removals
        record: dict[str, Any] = {"type": node.kind}
        if node.name is not None:
            record["name"] = node.name
        if node.kind not in ("list", "tuple"):
            record["keys"] = [key_to_record(k) for k in node.keys]
        record["children"] = children = [None] * len(node.children)
        slots[j] = record
        segments = node.segments()
        todo.extend(
            (node.children[i], join_address(at, segments[i]), children, i) for i in reversed(_jax_order(node))
        )
    result: dict[str, Any] = top[0]
    return result


def _addresses(node: Node, address: str = "") -> list[tuple[str, Node, Node]]:
    """Every node below ``node`` with its address and its parent, parents first (depth first, in
    key order)."""
    out = []
    todo = _below(node, address)
    while todo:
        at, child, parent = todo.pop()
        out.append((at, child, parent))
        todo.extend(_below(child, at))
    return out


def _below(node: Node, address: str) -> list[tuple[str, Node, Node]]:
    """The children of ``node`` with their addresses and ``node``, last first (a stack's order)."""
    found = zip(node.segments(), node.children, strict=True)
    return [(join_address(address, s), c, node) for s, c in found][::-1]


def canonical(address: object, what: str) -> str:
    if not isinstance(address, str):
        raise InvalidInputError(f"{what}: an address is a str, got {type(address).__name__}")
    try:
        return format_address(parse_address(address))
    except TreestoreError as exc:
        raise InvalidInputError(f"{what}: {address!r} is not an address: {exc}") from None


def _index(node: Node, segment: str) -> int | None:
    """The position of the child at ``segment``; as in patterns, the quotes around a digit-only
    dict key may be left out (``h/11`` finds the child ``h/"11"`` of a dict)."""
    segments = node.segments() if node.container else []
    for s in (segment, f'"{segment}"' if segment.isdigit() and segment.isascii() else None):
        if s in segments:
            return segments.index(s)
    return None


def loose(address: str) -> str:
    return "/".join(
        s[1:-1] if len(s) > 2 and s[0] == s[-1] == '"' and s[1:-1].isdigit() else s
        for s in address.split("/")
    )


def under(a: str, b: str) -> bool:
    """Whether address ``a`` lies strictly under address ``b``."""
    return loose(a).startswith(loose(b) + "/")


def overlap(a: str, b: str) -> bool:
    """Whether one of two addresses is the other or lies under it."""
    a, b = loose(a), loose(b)
    return a == b or not a or not b or b.startswith(a + "/") or a.startswith(b + "/")


class EditTree:
    """The tree being derived, with the operations :func:`derive` applies to it."""

    def __init__(self, root: Node, base: str) -> None:
        self.root = root
        self.base = base

    def find(self, address: str) -> tuple[Node, ...] | None:
        """The nodes from the root to the node at ``address``, or None when there is none."""
        path = [self.root]
        for segment in address.split("/") if address else []:
            j = _index(path[-1], segment)
            if j is None:
                return None
            path.append(path[-1].children[j])
        return tuple(path)

    def missing(self, address: str, what: str) -> NoMatchError:
        known = [a for a, _, _ in _addresses(self.root)]
        near = difflib.get_close_matches(address, known, n=5, cutoff=0.3) or known[:5]
        hint = f"; nearest addresses: {', '.join(repr(a) for a in near)}" if near else ""
        return NoMatchError(
            f"{what}: no leaf or subtree {address!r} in checkpoint {self.base!r}{hint}",
            checkpoint=self.base,
            address=address,
        )

    def drop(self, patterns: _select.Patterns) -> list[str]:
        """Remove every node whose address matches a pattern; NoMatchError for a pattern that
        matches no address of a leaf or subtree. Returns the addresses removed."""
        nodes = _addresses(self.root)
        chosen = set(
            _select.select(
                [a for a, _, _ in nodes], patterns, where=f"checkpoint {self.base!r}", checkpoint=self.base
            )
        )
        removed: list[str] = []
        gone: set[int] = set()  # ids of the nodes removed, with everything under them
        for address, node, parent in nodes:
            if id(parent) in gone:
                gone.add(id(node))
            elif address in chosen:
                removed.append(address)
                gone.add(id(node))
                self.detach(node, parent)
        return removed

    @staticmethod
    def detach(target: Node, parent: Node) -> int:
        """Remove ``target`` from ``parent``; returns the position it had there."""
        j = next(j for j, child in enumerate(parent.children) if child is target)
        del parent.children[j], parent.keys[j]
        parent.emptied = True
        return j

    def attach(self, address: str, node: Node, what: str, place: tuple[Node, int] | None = None) -> None:
        """Put ``node`` at ``address``: in place of what is there, or under a new key of a dict
        (custom) node, creating missing dicts on the way; the result must stay within the depth
        readers accept."""
        keys = parse_address(address)
        if not keys:
            self.root = node
            return
        parent = self.root
        at = ""
        for depth, key in enumerate(keys):
            segment = format_key(key)
            last = depth == len(keys) - 1
            if not parent.container:
                raise InvalidInputError(
                    f"{what}: {at or '(root)'!r} is a leaf in checkpoint {self.base!r}, not a subtree "
                    f"that {address!r} could lie in",
                    checkpoint=self.base,
                    address=address,
                )
            j = _index(parent, segment)
            if j is not None:
                at = join_address(at, parent.segments()[j])
                if last:
                    parent.children[j] = node
                else:
                    parent = parent.children[j]
                continue
            if isinstance(key, SequenceKey) and parent.kind in ("dict", "ordereddict"):
                key = DictKey(segment)  # a bare index under a dict names a digit-only str key
                segment = format_key(key)
            child = node if last else Node("dict")
            index = place[1] if place is not None and place[0] is parent else len(parent.children)
            self._add_key(parent, at, key, child, what, address, index)
            parent = child
            at = join_address(at, segment)
        if len(keys) + _height(node) > MAX_DEPTH:
            raise InvalidInputError(
                f"{what}: {address!r} would put the tree's deepest node below depth {MAX_DEPTH}, "
                "the most readers accept",
                checkpoint=self.base,
                address=address,
            )

    def _add_key(
        self, parent: Node, at: str, key: Key, child: Node, what: str, address: str, index: int
    ) -> None:
        if parent.kind in ("list", "tuple"):
            ok = isinstance(key, SequenceKey) and key.idx == len(parent.children)
            rule = f"a {parent.kind} grows only at its end (index {len(parent.children)})"
        elif parent.kind in ("dict", "ordereddict"):
            ok = isinstance(key, DictKey)
            rule = "a dict takes only dict keys (no '.attr', '#i' or index segments)"
        else:
            ok = not isinstance(key, SequenceKey)
            rule = f"a {parent.kind} node takes no index keys"
        if not ok:
            raise InvalidInputError(
                f"{what}: cannot add {address!r} to checkpoint {self.base!r}: {rule} "
                f"({at or '(root)'} is a {parent.kind})",
                checkpoint=self.base,
                address=address,
            )
        keys = [*parent.keys, key]
        try:
            check_node_keys(keys, [format_key(k) for k in keys], at)
        except TreestoreError as exc:
            raise InvalidInputError(f"{what}: {exc}", checkpoint=self.base, address=address) from None
        parent.keys.insert(index, key)
        parent.children.insert(index, child)

    def prune(self) -> None:
        """Remove the containers this derive emptied (as a partial load leaves them out); a
        container left empty by that is removed in turn."""
        order = [self.root]
        for node in order:  # breadth first: every node after its parent
            order.extend(node.children)
        for node in reversed(order):  # children before their parents
            kept = [
                (key, child)
                for key, child in zip(node.keys, node.children, strict=True)
                if not (child.container and child.emptied and not child.children)
            ]
            if len(kept) < len(node.children):
                node.emptied = True
            node.keys = [k for k, _ in kept]
            node.children = [c for _, c in kept]


__all__ = ["EditTree", "Node", "canonical", "emit", "loose", "node_of", "overlap", "under"]
