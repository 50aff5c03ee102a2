"""Text heatmaps of a run: one line per address, one character per checkpoint or step, the
value's level up to the row's (or the whole map's) largest; shared by :class:`Timeline` and
:class:`Norms`."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from treestore.errors import InvalidInputError

BLOCKS = " ▁▂▃▄▅▆▇█"  # none, then eighths of the row's (or the whole map's) largest value
ASCII_BLOCKS = " .:-=+*#@"
ABSENT, ASCII_ABSENT = "·", "x"  # the leaf is absent (or unknown) there
NONFINITE = "!"  # the leaf holds NaN or ±inf there (or changed to or from them)


def top(values: Sequence[Sequence[float]], scale: str) -> list[float]:
    """What each row's levels are scaled to: its largest finite value, or the map's."""
    return _tops(_table(values), scale).tolist()


def _tops(table: np.ndarray, scale: str) -> np.ndarray:
    """:func:`top` of a table made by :func:`_table`."""
    if scale not in ("row", "global"):
        raise InvalidInputError(f"scale must be 'row' or 'global', got {scale!r}")
    finite = np.where(np.isfinite(table), table, -np.inf)
    peaks = finite.max(axis=1, initial=-np.inf)
    tops = np.where(np.isfinite(peaks), peaks, 0.0)  # 0 for a row of no finite value
    if scale == "global" and len(tops):
        tops[:] = tops.max()
    return tops


def _table(values: Sequence[Sequence[float]]) -> np.ndarray:
    """``values`` as a 2-D float64 array, one row per address (rows of no values included)."""
    return np.array(values, np.float64).reshape(len(values), -1) if len(values) else np.zeros((0, 0))


def levels(values: np.ndarray, tops: np.ndarray) -> np.ndarray:
    """Each value's level (2-D ``values``, one top per row): 0 for zero, 1..8 for a value up to
    its row's top (any nonzero one shows as at least 1), 8 for inf or where the top is not
    positive; -1 for NaN."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        scaled = np.ceil(values / tops[:, None] * 8)
    out = np.clip(np.nan_to_num(scaled, nan=8.0, posinf=8.0, neginf=1.0), 1, 8).astype(np.int8)
    out[np.isinf(values) | (tops[:, None] <= 0)] = 8
    out[values == 0] = 0
    out[np.isnan(values)] = -1
    return out


def level(value: float, top: float) -> int:
    """:func:`levels` of one value."""
    return int(levels(np.array([[value]]), np.array([top]))[0, 0])


def num(x: float) -> str:
    """A value as the heatmap prints it: three significant digits, or inf."""
    return "inf" if math.isinf(x) else f"{x:.3g}"


def ruler(columns: int, indent: int) -> list[str]:
    """The line above a heatmap's cells that numbers its columns from 0 (``indent`` spaces
    first): every column's last digit up to 10 columns, else every tenth column's index.

    >>> ruler(3, 2)
    ['  012']
    >>> ruler(23, 0)
    ['0         10        20']
    """
    if columns <= 10:
        return [" " * indent + "".join(str(j) for j in range(columns))]
    line = ""
    for j in range(0, columns, 10):
        line = line.ljust(j) + str(j)
    return [" " * indent + line]


def rows(
    addresses: Sequence[str],
    values: Sequence[Sequence[float]],
    marked: Sequence[Sequence[bool]],
    scale: str,
    ascii: bool,
    note: str = "",
) -> list[str]:
    """One line per address: its cells (``!`` where ``marked``), then ``max`` and the row's
    largest value; ``note`` (with ``{}`` for the number of marked cells) after a row with any.
    InvalidInputError when ``scale`` is neither ``"row"`` nor ``"global"``."""
    table = _table(values)
    tops = _tops(table, scale)
    shown, absent = (ASCII_BLOCKS, ASCII_ABSENT) if ascii else (BLOCKS, ABSENT)
    chars = np.array([*shown, absent])  # level -1: the last, absent
    cells = chars[levels(table, tops)]
    flags = np.array(marked, bool).reshape(table.shape)
    cells[flags] = NONFINITE
    width = max((len(a or "(root)") for a in addresses), default=0)
    out = []
    for i, address in enumerate(addresses):
        row = table[i][~np.isnan(table[i])]
        peak = num(float(row.max())) if row.size else "-"
        count = int(flags[i].sum())
        odd = note.format(count) if note and count else ""
        out.append(f"{(address or '(root)').ljust(width)}  {''.join(cells[i].tolist())}  max {peak}{odd}")
    return out


__all__ = [
    "ABSENT",
    "ASCII_ABSENT",
    "ASCII_BLOCKS",
    "BLOCKS",
    "NONFINITE",
    "level",
    "levels",
    "num",
    "rows",
    "ruler",
    "top",
]
