"""Human output: sizes, times, aligned tables, inline bars and compact tree views."""

from __future__ import annotations

import datetime as dt
import json
import sys
from collections.abc import Sequence
from typing import Any

from .context import plain

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def size(n: int | float) -> str:
    """Bytes in binary units.

    >>> size(512), size(1536), size(90856960)
    ('512 B', '1.5 KiB', '86.6 MiB')
    """
    if n < 1024:
        return f"{int(n)} B"
    value = float(n)
    for unit in _UNITS:
        value /= 1024
        if value < 1024 or unit == _UNITS[-1]:
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def when(seconds: float) -> str:
    """A time as local ISO 8601, to the second; one no date can show (a record may hold any
    float or integer: NaN, inf, 1e300) as its raw number of seconds, so listing never fails.

    >>> when(float("nan")), when(1e300), when(-2**63)
    ('nan s', '1e+300 s', '-9.223372036854776e+18 s')
    """
    try:
        return dt.datetime.fromtimestamp(seconds).astimezone().isoformat(timespec="seconds")
    except (OverflowError, OSError, ValueError):  # out of the platform's range, or NaN
        return f"{float(seconds)!r} s"


def compact(value: Any, width: int = 60) -> str:
    """Plain data as one line of JSON, cut to ``width`` characters (bytes, also as map keys,
    and non-finite numbers as text).

    >>> print(compact({"k": [b"\\xff", float("nan")], b"b": 1}))
    {"k": ["ff", "nan"], "b'b'": 1}
    """
    text = json.dumps(plain(value), separators=(", ", ": "), default=str, ensure_ascii=False)
    return text if len(text) <= width else text[: width - 1] + "…"


def fancy() -> bool:
    """Whether standard output can show block characters (a bar, an ellipsis)."""
    encoding = getattr(sys.stdout, "encoding", None)
    if not encoding:  # a text buffer (tests, doctests): any character goes
        return True
    try:
        "█▏…".encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return False
    return True


def table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> list[str]:
    """Aligned columns separated by two spaces; columns in ``right`` are right-aligned.

    >>> print("\\n".join(table(["name", "size"], [["a", "1 B"], ["bb", "10 B"]], right=[1])))
    name  size
    a      1 B
    bb    10 B
    """
    cells = [list(header), *[list(r) for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for r in cells:
        parts = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("  ".join(parts).rstrip())
    return lines


def tree_labels(addresses: Sequence[str]) -> list[tuple[str, int | None]]:
    """A compact tree view of addresses: one line per node and leaf, indented by depth, with
    chains of single-child nodes joined. Yields (label, index of the leaf or None for a node).

    >>> for label, i in tree_labels(["a/b/w", "a/b/v", "a/c/d/w", "step"]):
    ...     print(label if i is None else f"{label} {i}")
    a/
      b/
        w 0
        v 1
      c/d/w 2
    step 3
    """
    trie: dict[str, Any] = {}
    for i, address in enumerate(addresses):
        node = trie
        parts = address.split("/") if address else [""]
        for part in parts[:-1]:
            node = node.setdefault(part + "/", {})
        node[parts[-1]] = i
    out: list[tuple[str, int | None]] = []

    def walk(node: dict[str, Any], depth: int) -> None:
        for key, child in node.items():
            label = key
            while isinstance(child, dict) and len(child) == 1:
                ((k, c),) = child.items()
                label, child = label + k, c
            if isinstance(child, dict):
                out.append(("  " * depth + label, None))
                walk(child, depth + 1)
            else:
                out.append(("  " * depth + (label or "(root)"), child))

    walk(trie, 0)
    return out
