"""Key paths <-> addresses.

An address is the text form of a leaf's key path: one segment per key, joined by ``/``.

=======================  ==================  ===========================================
key                      segment             example
=======================  ==================  ===========================================
``SequenceKey(3)``       ``3``               ``layers/3/w``
``DictKey("w")``         ``w``               bare when it matches ``[A-Za-z_][A-Za-z0-9_.-]*``
``DictKey("0")``         ``"0"``             quoted otherwise; ``%``-escapes inside quotes
``DictKey(0)``           ``{0}``             int dict keys in braces
``DictKey(True)``        ``{true}``          bool dict keys in braces
``GetAttrKey("w")``      ``.w``              attributes of namedtuples, dataclasses, modules
``FlattenedIndexKey(2)`` ``#2``              custom nodes without named keys
=======================  ==================  ===========================================

The root leaf (a tree that is a single array) has the empty address ``""``.
Addresses never name files: chunks are named by digest, so no key can escape the store.

The four key entries are this module's own classes, with the names, fields and reprs of
``jax.tree_util``'s, so that reading manifests never imports jax. Wherever a key entry is taken,
jax's own are accepted too (see :func:`as_key`); the tree layer (:mod:`treestore._tree.keys`)
turns them back into jax's for the public :func:`treestore.parse_address`.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TypeAlias, Union, cast

from treestore._format.limits import INT_END, INT_START, MAX_INDEX
from treestore.errors import InvalidInputError, UnsupportedKeyError


class _KeyEntry:
    """What the four key entries share: equality and hashing by kind and value. A key entry also
    equals jax's key entry of its kind and value (so a parsed path equals the jax key path it was
    formatted from); jax's own ``__eq__`` does not return the favour."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        theirs = as_key(other)
        return type(theirs) is type(self) and key_value(theirs) == key_value(self)

    def __hash__(self) -> int:
        return hash((type(self).__name__, key_value(cast("Key", self))))


@dataclass(frozen=True, eq=False, slots=True)
class SequenceKey(_KeyEntry):
    """The index of a list's or tuple's child."""

    idx: int


@dataclass(frozen=True, eq=False, slots=True)
class DictKey(_KeyEntry):
    """The key of a dict's child (``DictKey(True) == DictKey(1)``, as in Python)."""

    key: Hashable


@dataclass(frozen=True, eq=False, slots=True)
class GetAttrKey(_KeyEntry):
    """The attribute name of a child of a namedtuple, dataclass or module."""

    name: str


@dataclass(frozen=True, eq=False, slots=True)
class FlattenedIndexKey(_KeyEntry):
    """The position of a child of a custom node without named keys."""

    key: int


Key: TypeAlias = Union[SequenceKey, DictKey, GetAttrKey, FlattenedIndexKey]  # noqa: UP007
KeyPath: TypeAlias = tuple[Key, ...]
_FIELDS: dict[type[Key], str] = {
    SequenceKey: "idx",
    DictKey: "key",
    GetAttrKey: "name",
    FlattenedIndexKey: "key",
}
_KEY_TYPES = tuple(_FIELDS)


def as_key(key: object) -> Key | None:
    """``key`` as one of this module's key entries: itself, or jax's key entry of the same class
    name (``jax.tree_util.DictKey`` ...) converted; None for anything else.

    jax is never imported here: a jax key entry exists only once jax is, so its classes are looked
    up in ``sys.modules``.
    """
    if isinstance(key, _KEY_TYPES):
        return key
    match = _JAX_TYPES.get(type(key)) or _jax_match(type(key))
    if match is None:
        return None
    ours, field = match
    return ours(getattr(key, field))


# The jax key classes (or subclasses) met so far: the class each becomes, and the field it keeps.
_JAX_TYPES: dict[type, tuple[type[Key], str]] = {}


def _jax_match(cls: type) -> tuple[type[Key], str] | None:
    tree_util = sys.modules.get("jax.tree_util")
    if tree_util is None:
        return None
    for ours, field in _FIELDS.items():
        theirs = getattr(tree_util, ours.__name__, None)
        if isinstance(theirs, type) and issubclass(cls, theirs):
            _JAX_TYPES[cls] = ours, field
            return ours, field
    return None


_BARE = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*\Z")
_INT = re.compile(r"-?(0|[1-9][0-9]*)\Z")
_NAT = re.compile(r"(0|[1-9][0-9]*)\Z")
_ATTR = re.compile(r"[^\W\d]\w*\Z")  # a Python identifier
_ESCAPED = frozenset('%"/')


def _quote(text: str) -> str:
    out = []
    for ch in text:
        code = ord(ch)
        if ch in _ESCAPED or not ch.isprintable():
            if code < 0x100:
                out.append(f"%{code:02X}")
            elif code < 0x10000:
                out.append(f"%u{code:04X}")
            else:
                out.append(f"%U{code:06X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _unquote(body: str, segment: str) -> str:
    out = []
    i = 0
    while i < len(body):
        ch = body[i]
        if ch == "%":
            if body.startswith("%u", i):
                width, start = 4, i + 2
            elif body.startswith("%U", i):
                width, start = 6, i + 2
            else:
                width, start = 2, i + 1
            digits = body[start : start + width]
            if len(digits) != width or not all(c in "0123456789ABCDEF" for c in digits):
                raise InvalidInputError(f"bad escape in address segment {segment!r}")
            code = int(digits, 16)
            if code > 0x10FFFF:
                raise InvalidInputError(f"bad escape in address segment {segment!r}")
            out.append(chr(code))
            i = start + width
        elif ch in _ESCAPED:
            raise InvalidInputError(f"unescaped {ch!r} in address segment {segment!r}")
        else:
            out.append(ch)
            i += 1
    return "".join(out)


_SEGMENTS: dict[tuple[type, type, object], str] = {}


_VALUE_FIELD = {ours.__name__: field for ours, field in _FIELDS.items()}  # jax's classes share the names


def format_key(key: object, path: Sequence[object] = ()) -> str:
    """One key entry as an address segment; raises UnsupportedKeyError for unknown keys."""
    # Memoised by the key's class and plain value (hashed and compared in C, unlike key entries);
    # DictKey(True) == DictKey(1): the type of the value is part of the memo key.
    cls = type(key)
    field = _VALUE_FIELD.get(cls.__name__)
    value = getattr(key, field, key) if field is not None else key
    memo = (cls, type(value), value)
    try:
        return _SEGMENTS[memo]
    except (KeyError, TypeError):
        pass
    segment = _format_key(key, path)
    if len(_SEGMENTS) > 200_000:
        _SEGMENTS.clear()
    _SEGMENTS[memo] = segment
    return segment


def dict_key_segment(key: object, path: Sequence[object] = ()) -> str:
    """``format_key(DictKey(key), path)``, without making the key entry once the segment of
    ``key`` is known (a model's dicts repeat a few keys thousands of times)."""
    try:
        return _SEGMENTS[(DictKey, type(key), key)]
    except (KeyError, TypeError):
        return format_key(DictKey(key), path)


def _format_key(entry: object, path: Sequence[object]) -> str:
    key = as_key(entry)
    if isinstance(key, SequenceKey) and type(key.idx) is int and 0 <= key.idx < MAX_INDEX:
        return str(key.idx)
    if isinstance(key, DictKey):
        k = key.key
        if type(k) is bool:
            return "{true}" if k else "{false}"
        if type(k) is int:
            if not INT_START <= k < INT_END:
                where = format_address(tuple(path)) if path else "the root"
                raise UnsupportedKeyError(
                    f"{where}: int dict key {k} is outside the 64-bit range treestore stores",
                    address=where,
                )
            return "{" + str(k) + "}"
        if type(k) is str:
            if not encodable(k):
                where = format_address(tuple(path)) if path else "the root"
                raise UnsupportedKeyError(
                    f"{where}: dict key {k!r} is not valid Unicode text (lone surrogate)", address=where
                )
            return k if _BARE.match(k) else _quote(k)
        where = format_address(tuple(path)) if path else "the root"
        raise UnsupportedKeyError(
            f"{where}: dict key {k!r} has type {type(k).__name__}; "
            "treestore supports dict keys of type str, int and bool",
            address=where,
        )
    if isinstance(key, GetAttrKey) and isinstance(key.name, str) and _ATTR.match(key.name):
        return "." + key.name
    if isinstance(key, FlattenedIndexKey) and type(key.key) is int and 0 <= key.key < MAX_INDEX:
        return "#" + str(key.key)
    where = format_address(tuple(path)) if path else "the root"
    index = getattr(key, "idx" if isinstance(key, SequenceKey) else "key", None)
    if isinstance(key, (SequenceKey, FlattenedIndexKey)) and type(index) is int:
        raise UnsupportedKeyError(
            f"{where}: key entry {entry!r} is outside [0, 2**31), the indices treestore stores",
            address=where,
        )
    raise UnsupportedKeyError(
        f"{where}: key entry {entry!r} of type {type(entry).__name__} cannot become an address; "
        "register custom nodes with SequenceKey, DictKey, GetAttrKey or FlattenedIndexKey keys",
        address=where,
    )


def encodable(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (no lone surrogates), as msgpack needs."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def format_address(path: Sequence[object]) -> str:
    """The address of a key path: a stable, unambiguous name for one leaf.

    Args:
        path: A key path of jax key entries (``DictKey``, ``SequenceKey``, ``GetAttrKey``, ...),
            as ``jax.tree_util.tree_flatten_with_path`` gives.

    Returns:
        str: The address, such as ``params/layers/0/w``; :func:`parse_address` gives the path back.

    Raises:
        UnsupportedKeyError: A key entry no address can name: a dict key that is not a str,
            int or bool (or an int outside 64 bits, a str that is not valid Unicode), an index
            outside [0, 2**31), an attribute name that is not an identifier, or another type
            of key entry.

    Examples:
        >>> from jax.tree_util import DictKey, SequenceKey, GetAttrKey
        >>> format_address((DictKey("params"), SequenceKey(0), GetAttrKey("w")))
        'params/0/.w'
        >>> [format_address((k,)) for k in (SequenceKey(0), DictKey(0), DictKey("0"))]
        ['0', '{0}', '"0"']
    """
    return "/".join(format_key(k, path[:i]) for i, k in enumerate(path))


@functools.lru_cache(maxsize=100_000)
def parse_segment(segment: str) -> Key:
    """The key entry an address segment stands for."""
    if _NAT.match(segment) and int(segment) < MAX_INDEX:
        return SequenceKey(int(segment))
    if segment.startswith("{") and segment.endswith("}"):
        inner = segment[1:-1]
        if inner == "true":
            return DictKey(True)
        if inner == "false":
            return DictKey(False)
        if _INT.match(inner) and inner != "-0" and INT_START <= int(inner) < INT_END:
            return DictKey(int(inner))
    elif segment.startswith('"') and segment.endswith('"') and len(segment) >= 2:
        text = _unquote(segment[1:-1], segment)
        if encodable(text):
            return DictKey(text)
    elif segment.startswith(".") and _ATTR.match(segment[1:]):
        return GetAttrKey(segment[1:])
    elif segment.startswith("#") and _NAT.match(segment[1:]) and int(segment[1:]) < MAX_INDEX:
        return FlattenedIndexKey(int(segment[1:]))
    elif _BARE.match(segment):
        return DictKey(segment)
    raise InvalidInputError(f"not an address segment: {segment!r}")


@functools.lru_cache(maxsize=100_000)
def canonical_segment(segment: str) -> Key:
    """Like :func:`parse_segment`, but only for segments in the form :func:`format_key` writes."""
    key = parse_segment(segment)
    if format_key(key) != segment:
        raise InvalidInputError(f"address segment {segment!r} is not in canonical form")
    return key


def parse_address(address: str) -> KeyPath:
    """The typed key path of an address; the inverse of :func:`format_address`.

    >>> parse_address('params/0/.w')
    (DictKey(key='params'), SequenceKey(idx=0), GetAttrKey(name='w'))
    """
    if not isinstance(address, str):
        raise InvalidInputError(f"an address is a str, got {type(address).__name__}")
    if address == "":
        return ()
    return tuple(parse_segment(s) for s in address.split("/"))


def key_to_record(key: Key) -> list[object]:
    """A key entry as a msgpack-able pair ``[kind, value]`` for the manifest."""
    if isinstance(key, SequenceKey):
        return ["seq", key.idx]
    if isinstance(key, DictKey):
        return ["dict", key.key]
    if isinstance(key, GetAttrKey):
        return ["attr", key.name]
    return ["flat", key.key]


def key_from_record(record: object) -> Key:
    """The inverse of :func:`key_to_record`; raises InvalidInputError on anything else."""
    if isinstance(record, (list, tuple)) and len(record) == 2:
        kind, value = record
        if kind == "seq" and type(value) is int and 0 <= value < MAX_INDEX:
            return SequenceKey(value)
        if kind == "dict" and type(value) in (str, int, bool):
            return DictKey(value)
        if kind == "attr" and isinstance(value, str) and _ATTR.match(value):
            return GetAttrKey(value)
        if kind == "flat" and type(value) is int and 0 <= value < MAX_INDEX:
            return FlattenedIndexKey(value)
    raise InvalidInputError(f"not a key record: {record!r}")


def join_address(address: str, segment: str) -> str:
    """The address of a child of the node at ``address`` (the root's is ``""``; no segment is)."""
    return f"{address}/{segment}" if address else segment


def join_addresses(address: str, segments: list[str]) -> list[str]:
    """:func:`join_address` of each of ``segments``, in one call (a node of a thousand leaves
    paid a call per child)."""
    return [f"{address}/{s}" for s in segments] if address else list(segments)


def check_node_keys(keys: Sequence[Key], segments: Sequence[str], address: str) -> None:
    """The keys of one tree node (``segments`` their address segments) must be distinct as
    segments and as the dict keys a load without a template makes of them: ``GetAttrKey("a")``
    and ``DictKey("a")``, or ``SequenceKey(1)``, ``DictKey(1)`` and ``DictKey(True)`` (1 == True),
    would become one dict key and one leaf would be lost. Raises UnsupportedKeyError naming the
    node and both keys; writers and readers both call this."""
    by_segment: dict[str, int] = {}
    by_value: dict[Hashable, int] = {}
    where = address or "the root"
    for i, (key, segment) in enumerate(zip(keys, segments, strict=True)):
        j = by_segment.setdefault(segment, i)
        if j != i:
            child = join_address(address, segment)
            raise UnsupportedKeyError(
                f"{child}: two children of the node at {where} have this address (a custom "
                "node gives two children the same key entry)",
                address=child,
            )
        j = by_value.setdefault(key_value(key), i)
        if j != i:
            raise UnsupportedKeyError(
                f"{where}: the children {segments[j]!r} and {segment!r} of this node would both be "
                f"the dict key {key_value(key)!r} when loaded without a template; give the node's "
                "children keys whose values differ",
                address=address,
            )


def key_value(key: Key) -> Hashable:
    """The plain Python value a key entry carries (index, dict key or attribute name)."""
    if isinstance(key, SequenceKey):
        return key.idx
    if isinstance(key, DictKey):
        return key.key
    if isinstance(key, GetAttrKey):
        return key.name
    return key.key
