"""Key entries of real pytrees: jax's key classes <-> the format's own.

The format layer (:mod:`treestore._format.address`) has key entries of its own, so that reading
manifests never imports jax. Trees are flattened by jax, whose key entries become the format's
here (:func:`from_jax`), and the public :func:`parse_address` gives jax's back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from treestore._format import address as _address
from treestore._format.address import DictKey, GetAttrKey, Key, SequenceKey, as_key
from treestore._tree.jax_import import jax

if TYPE_CHECKING:
    from jax.tree_util import KeyPath


def from_jax(entry: object) -> Key:
    """A key entry jax flattening gave, as the format's; any other object is returned as it is,
    for :func:`treestore._format.address.format_key` to refuse with its own message."""
    key = as_key(entry)
    return key if key is not None else entry  # type: ignore[return-value]


def to_jax(key: Key) -> Any:
    """The format's key entry as jax's (imports jax)."""
    tree_util = jax.tree_util
    if isinstance(key, SequenceKey):
        return tree_util.SequenceKey(key.idx)
    if isinstance(key, DictKey):
        return tree_util.DictKey(key.key)
    if isinstance(key, GetAttrKey):
        return tree_util.GetAttrKey(key.name)
    return tree_util.FlattenedIndexKey(key.key)


def parse_address(address: str) -> KeyPath:
    """The typed key path of an address; the inverse of :func:`format_address`.

    Args:
        address: An address, such as ``params/0/.w``.

    Returns:
        The key path as a tuple of jax key entries.

    Raises:
        InvalidInputError: ``address`` is not a valid address.

    Examples:
        >>> parse_address('params/0/.w')
        (DictKey(key='params'), SequenceKey(idx=0), GetAttrKey(name='w'))
    """
    return tuple(to_jax(key) for key in _address.parse_address(address))
