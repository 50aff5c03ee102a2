"""The one reading of a checkpoint argument: ``URL`` (its store's newest checkpoint),
``URL#NAME``, or a ``(URL, NAME)`` pair; and of a store's URL, which names no checkpoint. No
other module splits text at ``#`` (``tests/package/test_layering.py``)."""

from __future__ import annotations

import os
from typing import Union

from treestore._format.manifest.rules import check_name
from treestore.errors import InvalidInputError

Spec = Union[str, "os.PathLike[str]", tuple[Union[str, "os.PathLike[str]"], str]]


def parse_spec(spec: Spec, name: str | None = None) -> tuple[str, str | None]:
    """(store URL, checkpoint name or None) of a checkpoint argument; ``name`` is the separate
    name argument of functions that have one, which must agree with a name in ``spec``."""
    found: str | None
    if isinstance(spec, tuple):
        if len(spec) != 2 or not isinstance(spec[0], (str, os.PathLike)) or not isinstance(spec[1], str):
            raise InvalidInputError(f"a checkpoint is URL, URL#NAME or (URL, NAME), got {spec!r}")
        url, found = os.fspath(spec[0]), spec[1]
    elif isinstance(spec, (str, os.PathLike)):
        text = os.fspath(spec)
        head, sep, tail = text.rpartition("#")
        url, found = (head, tail or None) if sep else (text, None)
    else:
        raise InvalidInputError(f"a checkpoint is URL, URL#NAME or (URL, NAME), got {type(spec).__name__}")
    if name is not None and found is not None and name != found:
        raise InvalidInputError(f"checkpoint named twice: {found!r} in {os.fspath(url)}#... and {name!r}")
    return url, found if found is not None else name


def split_spec(spec: Spec) -> tuple[str, str | None]:
    """:func:`parse_spec` of ``spec``, its checkpoint name (if any) checked as a name."""
    url, name = parse_spec(spec)
    if name is not None:
        check_name(name)
    return url, name


def store_url(url: object) -> str:
    """``url`` as the URL of a store: a str or path that names no checkpoint (no ``#NAME``)."""
    if not isinstance(url, (str, os.PathLike)):
        raise InvalidInputError(f"a store URL is a str or path, got {type(url).__name__}")
    base, name = parse_spec(url)
    if name is not None:
        raise InvalidInputError(
            f"{os.fspath(url)!r} names a checkpoint; a store is its URL without #NAME "
            f"(Store({base!r}).load({name!r}), or treestore.load({os.fspath(url)!r}))"
        )
    return os.fspath(url)
