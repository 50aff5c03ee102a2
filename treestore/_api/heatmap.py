"""Text heatmaps of a run: one line per address, one character per checkpoint or step, the
value's level up to the row's (or the whole map's) largest; shared by :class:`Timeline` and
:class:`Norms`."""

from __future__ import annotations

import math
from collections.abc import Sequence

from treestore.errors import InvalidInputError

BLOCKS = " ▁▂▃▄▅▆▇█"  # none, then eighths of the row's (or the whole map's) largest value
ASCII_BLOCKS = " .:-=+*#@"
ABSENT, ASCII_ABSENT = "·", "x"  # the leaf is absent (or unknown) there
NONFINITE = "!"  # the leaf holds NaN or ±inf there (or changed to or from them)


def top(values: Sequence[Sequence[float]], scale: str) -> list[float]:
    """What each row's levels are scaled to: its largest finite value, or the map's."""
    if scale not in ("row", "global"):
        raise InvalidInputError(f"scale must be 'row' or 'global', got {scale!r}")
    tops = [max((v for v in row if math.isfinite(v)), default=0.0) for row in values]
    if scale == "global":
        return [max(tops, default=0.0)] * len(tops)
    return tops


def level(value: float, top: float) -> int:
    """0 for zero, 1..8 for a value up to ``top`` (any nonzero one shows as at least 1), 8 for
    inf; -1 for NaN."""
    if math.isnan(value):
        return -1
    if value == 0:
        return 0
    if math.isinf(value) or top <= 0:
        return 8
    return max(1, min(8, math.ceil(value / top * 8)))


def num(x: float) -> str:
    """A value as the heatmap prints it: three significant digits, or inf."""
    return "inf" if math.isinf(x) else f"{x:.3g}"


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
    tops = top(values, scale)
    levels, absent = (ASCII_BLOCKS, ASCII_ABSENT) if ascii else (BLOCKS, ABSENT)
    width = max((len(a or "(root)") for a in addresses), default=0)
    out = []
    for i, (address, row) in enumerate(zip(addresses, values, strict=True)):
        cells = "".join(
            NONFINITE if m else (absent if (n := level(v, tops[i])) < 0 else levels[n])
            for v, m in zip(row, marked[i], strict=True)
        )
        finite = [v for v in row if not math.isnan(v)]
        peak = num(max(finite)) if finite else "-"
        odd = note.format(sum(marked[i])) if note and any(marked[i]) else ""
        out.append(f"{(address or '(root)').ljust(width)}  {cells}  max {peak}{odd}")
    return out


__all__ = ["ABSENT", "ASCII_ABSENT", "ASCII_BLOCKS", "BLOCKS", "NONFINITE", "level", "num", "rows", "top"]
