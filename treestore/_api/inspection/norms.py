"""The L2 norm of each leaf over a store's checkpoints, from the statistics its saves recorded
(SPEC.md, section 6.8): manifests alone are read, no chunk."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from treestore._api.inspection import heatmap as _heatmap
from treestore._api.inspection.timeline import chosen_leaves
from treestore._format import select as _select
from treestore._format import stats as _stats
from treestore._format.manifest.columns import Columns
from treestore._storage.base import Storage


@dataclass(frozen=True)
class Norms:
    """The L2 norm of each array leaf (or group of leaves) at each checkpoint of a store, from
    the statistics its saves recorded: only manifests are read, no chunk.

    ``values[i][j]`` is the norm of the finite elements of ``addresses[i]`` at
    ``checkpoints[j]``; NaN where the leaf is absent there or has no statistics (saved without
    them). ``nonfinite[i][j]`` counts its NaN and ±inf elements there. With ``depth`` set, each
    address is a group, the first ``depth`` segments of its leaves' addresses, and its norm is
    √(Σ‖wᵢ‖²) over the leaves with statistics. ``damaged`` is as in :class:`Timeline`.

    Attributes:
        url: The store's URL.
        checkpoints: The names of the checkpoints read, oldest first.
        addresses: The leaves (or groups), one row each.
        values: The norms, ``values[i][j]`` for ``addresses[i]`` at ``checkpoints[j]``.
        nonfinite: NaN and ±inf elements, like ``values``.
        depth: The number of address segments the rows are grouped by (None: one row a leaf).
        damaged: ``(name, problem)`` of each checkpoint left out.

    Examples:
        >>> import numpy as np, treestore
        >>> store = treestore.Store("memory://doc/norms")
        >>> for step in range(3):
        ...     _ = store.save({"w": np.full(4, 2.0**step)}, f"step-{step}")
        >>> store.norms().values
        ((2.0, 4.0, 8.0),)
    """

    url: str
    checkpoints: tuple[str, ...]
    addresses: tuple[str, ...]
    values: tuple[tuple[float, ...], ...]
    nonfinite: tuple[tuple[int, ...], ...]
    depth: int | None = None
    damaged: tuple[tuple[str, str], ...] = ()

    def heatmap(self, *, scale: str = "row", ascii: bool = False) -> str:
        """One line per address, one character per checkpoint: `` ▁▂▃▄▅▆▇█`` up to the row's
        largest norm (``scale="row"``) or the map's (``scale="global"``), ``·`` where absent or
        unknown, ``!`` where the leaf holds NaN or ±inf; then the row's largest norm.

        Args:
            scale: ``"row"`` or ``"global"``: what the levels are relative to.
            ascii: Draw with ASCII characters only (levels `` .:-=+*#@``, ``x`` where absent).

        Returns:
            The heatmap, its lines joined by newlines, after a heading line; a line for each
            damaged checkpoint follows.

        Raises:
            InvalidInputError: ``scale`` is neither ``"row"`` nor ``"global"``.
        """
        marked = [[n > 0 for n in row] for row in self.nonfinite]
        body = _heatmap.rows(self.addresses, self.values, marked, scale, ascii)
        span = f"{self.checkpoints[0]} -> {self.checkpoints[-1]}" if self.checkpoints else "no checkpoints"
        rows = f"groups of depth {self.depth}" if self.depth else "leaves"
        scaled = "per row" if scale == "row" else "to the largest norm of all"
        lines = [
            f"{len(self.checkpoints)} checkpoints: {span}; L2 norm of {rows}, scaled {scaled}, "
            "from the statistics recorded at save (manifests only)",
            *body,
        ]
        lines += [f"damaged, left out: {name}: {problem}" for name, problem in self.damaged]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """The norms as plain data, ready for :func:`json.dumps`.

        Returns:
            dict[str, Any]: ``{"url", "checkpoints", "depth", "measure", "rows", "damaged"}``: one row per
            address with its values and non-finite counts; non-finite values as the strings
            "nan" and "inf".
        """
        return {
            "url": self.url,
            "checkpoints": list(self.checkpoints),
            "depth": self.depth,
            "measure": "l2",
            "rows": [
                {
                    "address": a,
                    "values": [v if math.isfinite(v) else str(v) for v in row],
                    "nonfinite": list(n),
                }
                for a, row, n in zip(self.addresses, self.values, self.nonfinite, strict=True)
            ],
            "damaged": [{"name": name, "problem": problem} for name, problem in self.damaged],
        }


def norms(storage: Storage, *, select: _select.Patterns = None, depth: int | None = None) -> Norms:
    """The :class:`Norms` of every checkpoint of a store, oldest first, from manifests alone
    (see :meth:`treestore.Store.norms`)."""
    views, damaged, leaves, chosen = chosen_leaves(storage, select, depth)
    groups: dict[str, int] = {}
    row_of = {
        a: groups.setdefault(a if depth is None else "/".join(a.split("/")[:depth]), len(groups))
        for a in chosen
    }
    values = np.full((len(groups), len(views)), math.nan)
    nonfinite = np.zeros((len(groups), len(views)), np.int64)
    for j, (view, which) in enumerate(zip(views, leaves, strict=True)):
        index, rows = [], []
        for a, i in which.items():
            row = row_of.get(a)
            if row is not None:
                index.append(i)
                rows.append(row)
        sumsq, bad = _leaf_sums(view._columns, np.array(index, np.int64))
        known = ~np.isnan(sumsq)
        at = np.array(rows, np.int64)
        counted = np.bincount(at[known], minlength=len(groups)) > 0
        values[counted, j] = np.sqrt(np.bincount(at[known], sumsq[known], len(groups))[counted])
        nonfinite[:, j] = np.bincount(at, bad, len(groups)).astype(np.int64)
    return Norms(
        storage.url,
        tuple(v.name for v in views),
        tuple(groups),
        tuple(map(tuple, values.tolist())),
        tuple(map(tuple, nonfinite.tolist())),
        depth,
        damaged,
    )


def _leaf_sums(columns: Columns, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For array leaves ``index`` of a checkpoint: the sum of the squares of each one's finite
    elements (NaN where unknown) and its count of NaN and ±inf elements, from the stats column
    (checked when the manifest was decoded)."""
    sumsq = np.full(len(index), math.nan)
    bad = np.zeros(len(index))
    table = columns.stats
    if table is not None:
        rows = table[index]
        known = rows["kind"] != _stats.UNKNOWN
        sumsq[known] = rows["sumsq"][known]
        bad[known] = (rows["nan"] + rows["posinf"] + rows["neginf"])[known]
    return sumsq, bad


# The doctests of the methods: the class reports itself as treestore.types.Norms, which hides its
# methods from doctest's search of this module.
__test__ = {
    f"Norms.{name}": value
    for name, value in vars(Norms).items()
    if not name.startswith("__") and ">>>" in (getattr(value, "__doc__", None) or "")
}
