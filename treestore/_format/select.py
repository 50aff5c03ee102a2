"""The one pattern dialect for choosing leaves by address, used by load, open, diff, the manager
and the command line alike.

A pattern is a glob over addresses (``*``, ``?``, ``[...]``, as :mod:`fnmatch`, case-sensitive);
the quotes around digit-only dict keys may be left out (``layer/0/w`` matches the address
``layer/"0"/w``), since imported models are full of them.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Sequence

from treestore.errors import InvalidInputError, NoMatchError

Patterns = str | Sequence[str] | None

_QUOTED_DIGITS = re.compile(r'(?<![^/])"([0-9]+)"(?![^/])')


def patterns(select: Patterns) -> tuple[str, ...] | None:
    """``select`` as a tuple of patterns (None: everything), or InvalidInputError."""
    if select is None:
        return None
    pats = (select,) if isinstance(select, str) else tuple(select)
    if not pats or not all(isinstance(p, str) for p in pats):
        raise InvalidInputError(f"select must be a pattern or a list of patterns, got {select!r}")
    return pats


def _loose(address: str) -> str:
    return _QUOTED_DIGITS.sub(r"\1", address)


def matches(address: str, pats: Sequence[str]) -> bool:
    """Whether ``address`` matches any of the patterns."""
    loose = _loose(address)
    return any(fnmatch.fnmatchcase(address, p) or fnmatch.fnmatchcase(loose, p) for p in pats)


def select(
    addresses: Sequence[str], select: Patterns, *, where: str, checkpoint: str | None = None
) -> list[str]:
    """The addresses, in order, that match any pattern of ``select`` (all of them for None).

    Every pattern must match some address, else NoMatchError names the nearest addresses;
    ``where`` says what was searched ("checkpoint 'step-1'").
    """
    pats = patterns(select)
    if pats is None:
        return list(addresses)
    for p in pats:
        if not any(matches(a, (p,)) for a in addresses):
            near = difflib.get_close_matches(p, list(addresses), n=5, cutoff=0.3) or list(addresses[:5])
            hint = f"; nearest addresses: {', '.join(repr(a) for a in near)}" if near else ""
            raise NoMatchError(f"pattern {p!r} matches no leaf of {where}{hint}", checkpoint=checkpoint)
    return [a for a in addresses if matches(a, pats)]
