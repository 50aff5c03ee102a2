"""The one pattern dialect for choosing leaves by address, used by load, open, diff, derive, the
manager and the command line alike (no other module matches with ``fnmatch``:
``tests/package/test_layering.py``).

A pattern is an address with wildcards, matched segment by segment (case-sensitive):

- ``*`` matches within one segment (``encoder/layer/*/output/dense/bias`` does not reach into
  ``.../attention/output/dense/bias``), ``?`` one character of a segment, ``[...]`` one of a set;
- a ``**`` segment matches any number of segments, none included (``opt/**``, ``**/bias``);
- a segment of digits also matches the digit key spelled as an int key ``{3}``, a digit string
  key ``"3"`` or a flattened index ``#3`` — imported models are full of ``"3"`` keys — but only
  when the pattern matches nothing spelled exactly, and only when that reading is unambiguous.

Canonical addresses never change; only what a pattern may leave out.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import re
from collections.abc import Collection, Iterable, Sequence

from treestore.errors import InvalidInputError, NoMatchError

Patterns = str | Sequence[str] | None

_DIGITS = re.compile(r"-?[0-9]+")
_SPELLED = re.compile(r'(?<=/)(?:\{(-?[0-9]+)\}|"([0-9]+)"|#([0-9]+))(?=/|$)')


def patterns(select: Patterns) -> tuple[str, ...] | None:
    """``select`` as a tuple of patterns (None: everything), or InvalidInputError."""
    if select is None:
        return None
    pats = (select,) if isinstance(select, str) else tuple(select)
    if not pats or not all(isinstance(p, str) for p in pats):
        raise InvalidInputError(f"select must be a pattern or a list of patterns, got {select!r}")
    return pats


def _segment(seg: str) -> str:
    """The regex of one pattern segment (``*``, ``?`` and ``[...]`` stay within the segment)."""
    out, i = [], 0
    while i < len(seg):
        ch = seg[i]
        if ch == "*":
            out.append("[^/]*")
        elif ch == "?":
            out.append("[^/]")
        elif ch == "[":
            j = i + 1 + (seg[i + 1 : i + 2] == "!")
            j += seg[j : j + 1] == "]"  # a "]" first in the set is one of its characters
            end = seg.find("]", j)
            if end < 0:
                out.append(re.escape(ch))
            else:  # a set, as fnmatch reads it (ranges, "!"), never matching the separator
                out.append("(?!/)" + fnmatch.translate(seg[i : end + 1])[len("(?s:") : -len(")\\Z")])
                i = end
        else:
            out.append(re.escape(ch))
        i += 1
    return "".join(out)


@functools.lru_cache(maxsize=1024)
def _compile(pattern: str) -> re.Pattern[str]:
    """A pattern as a regex over ``"/" + address`` (every segment, the first too, after a slash)."""
    parts = ["(?:/[^/]*)*" if seg == "**" else "/" + _segment(seg) for seg in pattern.split("/")]
    return re.compile("".join(parts) + r"\Z")


def _loose(address: str) -> str:
    """``/``-prefixed address with digit keys spelled as bare digits: ``{3}``, ``"3"``, ``#3`` -> 3."""
    return _SPELLED.sub(lambda m: next(g for g in m.groups() if g is not None), "/" + address)


def loose_segment(segment: str) -> str:
    """One address segment with a digit key spelled as bare digits (``"3"``, ``{3}``, ``#3`` -> 3)."""
    return _loose(segment)[1:]


def _exact(pattern: str, addresses: Sequence[str]) -> list[str]:
    rx = _compile(pattern)
    return [a for a in addresses if rx.match("/" + a)]


def _loosely(pattern: str, addresses: Iterable[str]) -> list[str]:
    """What ``pattern`` matches when digit keys may be spelled as bare digits; InvalidInputError
    when two different spellings of one key would both match (``{3}`` and ``"3"`` siblings)."""
    rx = _compile(pattern)
    found = [a for a in addresses if rx.match(_loose(a))]
    seen: dict[str, str] = {}
    for a in found:
        other = seen.setdefault(_loose(a), a)
        if other != a:
            raise InvalidInputError(
                f"pattern {pattern!r} is ambiguous: it matches both {other!r} and {a!r}; "
                "spell the key as the address does"
            )
    return found


def matching(pattern: str, addresses: Sequence[str]) -> list[str]:
    """The addresses, in order, that ``pattern`` matches: spelled exactly, or else with digit
    keys read loosely (see the module's docstring)."""
    return _exact(pattern, addresses) or _loosely(pattern, addresses)


def matches(address: str, pats: Sequence[str]) -> bool:
    """Whether ``address`` matches any of the patterns as spelled (no loose digit keys: use
    :func:`select` to resolve patterns against a whole checkpoint)."""
    return any(_compile(p).match("/" + address) for p in pats)


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
    chosen: set[str] = set()
    for p in pats:
        found = matching(p, addresses)
        if not found:
            near = difflib.get_close_matches(p, list(addresses), n=5, cutoff=0.3) or list(addresses[:5])
            hint = f"; nearest addresses: {', '.join(repr(a) for a in near)}" if near else ""
            raise NoMatchError(f"pattern {p!r} matches no leaf of {where}{hint}", checkpoint=checkpoint)
        chosen.update(found)
    return [a for a in addresses if a in chosen]


def lookup(address: str, addresses: Collection[str]) -> str | None:
    """The one address that ``address`` names — itself, or with its digit segments read loosely
    (``h/3/w`` for ``h/"3"/w``) — or None. Wildcards are taken literally here."""
    if address in addresses:
        return address
    if not any(_DIGITS.fullmatch(seg) for seg in address.split("/")):
        return None
    escaped = "/".join(re.sub(r"([*?\[])", r"[\1]", seg) for seg in address.split("/"))
    found = _loosely(escaped, addresses)
    return found[0] if len(found) == 1 else None
