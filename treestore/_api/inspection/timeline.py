"""A training run at a glance: the relative change ‖Δ‖/‖w‖ of each leaf from one checkpoint to the
next, over every checkpoint of a store in commit order.

The numbers come from the exact diff of values (``treestore.diff(..., values=True)``), pair by pair: leaves
whose digests are equal cost nothing, and of the others only the chunks that differ are compared
(plus a's, for the norm). Groups (``depth``) pool their leaves' changes.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from treestore._api.checkpoint import Checkpoint
from treestore._api.inspection import diff as _diff
from treestore._api.inspection import heatmap as _heatmap
from treestore._api.inspection import timeline_html as _html
from treestore._engine.progress import Progress
from treestore._engine.reading import committed as _committed
from treestore._format import paths as _paths
from treestore._format import select as _select
from treestore._format.manifest.columns import Columns
from treestore._storage.base import Storage
from treestore.errors import (
    CheckpointNotFoundError,
    DamagedError,
    InvalidInputError,
    TreestoreError,
    UnsupportedFormatError,
)

_log = logging.getLogger("treestore")


@dataclass(frozen=True)
class Timeline:
    """The relative L2 change ‖b − a‖/‖a‖ of each array leaf (or group of leaves) between
    consecutive checkpoints of a store.

    ``values[i][j]`` is the change of ``addresses[i]`` from ``checkpoints[j]`` to
    ``checkpoints[j + 1]``: 0.0 where the leaf is unchanged, NaN where it is missing from either
    checkpoint or changed shape or dtype, inf where ‖a‖ is 0 and b differs. The change is measured
    over the elements finite in both checkpoints (as ``diff``'s ``rel_l2``): ``nonfinite[i][j]``
    counts the others that changed (to, from or between NaN and ±inf), so a change the finite
    measure cannot show is still seen (``nonfinite`` is empty when there are none). ``sizes[i]`` is the
    number of elements of the leaf (of all the group's leaves). With ``depth`` set, each address
    is a group: the first ``depth`` segments of its leaves' addresses, and its value pools its
    leaves' changes weighted by size, √(Σ nᵢ·vᵢ² / Σ nᵢ) over the leaves present at that step
    (equal to ‖Δ‖/‖w‖ of the group when its leaves have equal root-mean-square values).
    ``damaged`` names each checkpoint left out because its commit record or manifest cannot be
    read, with the problem: one damaged checkpoint does not hide the others.

    Attributes:
        url: The store's URL.
        checkpoints: The names of the checkpoints compared, oldest first.
        addresses: The leaves (or groups) compared, one row each.
        values: The relative changes, ``values[i][j]`` for ``addresses[i]`` at step ``j``.
        sizes: The number of elements of each row's leaf (or group).
        depth: The number of address segments the rows are grouped by (None: one row a leaf).
        nonfinite: Elements changed to, from or between NaN and ±inf, like ``values``; empty
            when there are none.
        damaged: ``(name, problem)`` of each checkpoint left out.
    """

    url: str
    checkpoints: tuple[str, ...]
    addresses: tuple[str, ...]
    values: tuple[tuple[float, ...], ...]
    sizes: tuple[int, ...]
    depth: int | None = None
    nonfinite: tuple[tuple[int, ...], ...] = ()
    damaged: tuple[tuple[str, str], ...] = ()

    @property
    def steps(self) -> tuple[tuple[str, str], ...]:
        """The (from, to) checkpoint names of each column."""
        return tuple(itertools.pairwise(self.checkpoints))

    def nonfinite_at(self, i: int, j: int) -> int:
        """How many elements of a row changed to, from or between non-finite values at a step.

        Args:
            i: The row: an index into ``addresses``.
            j: The step: an index into ``steps``.

        Returns:
            The count (0 when ``nonfinite`` is empty).
        """
        return self.nonfinite[i][j] if self.nonfinite else 0

    def to_numpy(self) -> np.ndarray[Any, Any]:
        """The relative changes as an array.

        Returns:
            ``values`` as a float64 array of shape ``(len(addresses), len(steps))``.
        """
        return np.array(self.values, np.float64).reshape(len(self.addresses), len(self.steps))

    def grouped(self, depth: int) -> Timeline:
        """The same changes pooled by the first ``depth`` segments of each address.

        Args:
            depth: How many leading address segments name a group (at least 1).

        Returns:
            Timeline: A :class:`Timeline` with one row per group, whose values pool its leaves'
            changes weighted by size (see the class).

        Raises:
            InvalidInputError: ``depth`` is not an int of at least 1.
        """
        if type(depth) is not int or depth < 1:
            raise InvalidInputError(f"depth must be an int of at least 1, got {depth!r}")
        groups: dict[str, list[int]] = {}
        for i, address in enumerate(self.addresses):
            groups.setdefault("/".join(address.split("/")[:depth]), []).append(i)
        values = []
        for rows in groups.values():
            values.append(
                tuple(
                    _pool([(self.sizes[i], self.values[i][j]) for i in rows]) for j in range(len(self.steps))
                )
            )
        sizes = tuple(sum(self.sizes[i] for i in rows) for rows in groups.values())
        nonfinite = tuple(
            tuple(sum(self.nonfinite_at(i, j) for i in rows) for j in range(len(self.steps)))
            for rows in groups.values()
        )
        return replace(
            self,
            addresses=tuple(groups),
            values=tuple(values),
            sizes=sizes,
            depth=depth,
            nonfinite=nonfinite if self.nonfinite else (),
        )

    def to_json(self) -> dict[str, Any]:
        """The timeline as plain data, ready for :func:`json.dumps`.

        Returns:
            dict[str, Any]: ``{"url", "checkpoints", "depth", "rows", "damaged"}``: one row per
            address with its size, values and non-finite counts; non-finite values as the strings "nan" and
            "inf".
        """

        def clean(v: float) -> float | str:
            return v if math.isfinite(v) else str(v)

        return {
            "url": self.url,
            "checkpoints": list(self.checkpoints),
            "depth": self.depth,
            "rows": [
                {
                    "address": a,
                    "size": n,
                    "values": [clean(v) for v in row],
                    "nonfinite": [self.nonfinite_at(i, j) for j in range(len(row))],
                }
                for i, (a, n, row) in enumerate(zip(self.addresses, self.sizes, self.values, strict=True))
            ],
            "damaged": [{"name": name, "problem": problem} for name, problem in self.damaged],
        }

    def heatmap(self, *, scale: str = "row", ascii: bool = False) -> str:
        """One line per address that changed: one character per step, `` ▁▂▃▄▅▆▇█`` for no
        change up to the largest change of the row (``scale="row"``) or of the whole map
        (``scale="global"``), ``·`` where the leaf is absent, ``!`` where elements changed to,
        from or between NaN and ±inf; then the row's largest change (of the finite elements) and
        the steps with such non-finite changes. A line above numbers the steps, and a key below
        names the checkpoints of each numbered step; the addresses unchanged at every step are
        named on one line instead of drawn. With ``ascii=True`` the levels are `` .:-=+*#@`` and
        absence is ``x``.

        Args:
            scale: ``"row"`` or ``"global"``: what the levels are relative to.
            ascii: Draw with ASCII characters only.

        Returns:
            The heatmap, its lines joined by newlines, after a heading line; a line for each
            damaged checkpoint follows.

        Raises:
            InvalidInputError: ``scale`` is neither ``"row"`` nor ``"global"``.

        Examples:
            >>> from treestore.types import Timeline
            >>> values = ((0.5, 1.0), (0.0, 0.0), (0.0, float("nan")))
            >>> t = Timeline("memory://x", ("a", "b", "c"), ("w", "b", "v"), values, (4, 2, 2))
            >>> print(t.heatmap())
            3 checkpoints, 2 steps: a -> c; relative L2 change of leaves, scaled per row
               01
            w  ▄█  max 1
            v   ·  max 0
            unchanged at every step: b
            steps: 0 a -> b, 1 b -> c
        """
        marked = [[self.nonfinite_at(i, j) > 0 for j in range(len(row))] for i, row in enumerate(self.values)]
        shown = [i for i, row in enumerate(self.values) if any(v != 0 for v in row) or any(marked[i])]
        drawn = set(shown)
        quiet = [a for i, a in enumerate(self.addresses) if i not in drawn]
        body = _heatmap.rows(
            [self.addresses[i] for i in shown],
            [self.values[i] for i in shown],
            [marked[i] for i in shown],
            scale,
            ascii,
            "  non-finite changes in {} step(s)",
        )
        span = f"{self.checkpoints[0]} -> {self.checkpoints[-1]}" if self.checkpoints else "no checkpoints"
        scaled = "per row" if scale == "row" else "to the largest change of all"
        rows = f"groups of depth {self.depth}" if self.depth else "leaves"
        what = f"relative L2 change of {rows}, scaled {scaled}"
        lines = [f"{len(self.checkpoints)} checkpoints, {len(self.steps)} steps: {span}; {what}"]
        if body and self.steps:
            width = max(len(self.addresses[i] or "(root)") for i in shown)
            lines += _heatmap.ruler(len(self.steps), width + 2)
        lines += body
        if quiet:
            names = ", ".join(a or "(root)" for a in quiet[:5])
            more = f" and {len(quiet) - 5} more" if len(quiet) > 5 else ""
            lines.append(f"unchanged at every step: {names}{more}")
        if self.steps:
            every = 1 if len(self.steps) <= 10 else 10
            marks = sorted({*range(0, len(self.steps), every), len(self.steps) - 1})
            key = ", ".join(f"{j} {self.checkpoints[j]} -> {self.checkpoints[j + 1]}" for j in marks)
            lines.append(f"steps: {key}")
        lines += [f"damaged, left out: {name}: {problem}" for name, problem in self.damaged]
        return "\n".join(lines)

    def to_html(self, *, scale: str = "row", title: str | None = None) -> str:
        """A self-contained HTML page (no external scripts, styles or fonts): the heatmap as
        inline SVG, one line per top-level group, and a table of every value (each cell's exact
        value also in its ``data-value`` attribute).

        Args:
            scale: ``"row"`` or ``"global"``: what the heatmap's levels are relative to.
            title: The page's title (default: ``treestore timeline: URL``).

        Returns:
            The page, as HTML text.

        Raises:
            InvalidInputError: ``scale`` is neither ``"row"`` nor ``"global"``.
        """
        tops = _heatmap.top(self.values, scale)  # checks scale
        lines = self if self.depth == 1 else self.grouped(1)
        return _html.page(self, lines, tops, title or f"treestore timeline: {self.url}", scale)


def _pool(pairs: list[tuple[int, float]]) -> float:
    present = [(max(n, 1), v) for n, v in pairs if not math.isnan(v)]
    if not present:
        return math.nan
    if any(math.isinf(v) for _, v in present):
        return math.inf
    return math.sqrt(sum(n * v * v for n, v in present) / sum(n for n, _ in present))


def array_leaves(c: Columns) -> dict[str, int]:
    """The array leaves of a checkpoint: leaf index by address."""
    return {c.addresses[i]: i for i in np.flatnonzero(c.is_array).tolist()}


def _changed_bytes(a: Columns, b: Columns, chosen: set[str]) -> int:
    """Raw bytes of the leaves a diff of values reads for this pair (both sides): array leaves
    at one address whose digests differ and whose shapes are equal."""
    ia, ib = a.match(b)
    arrays = a.is_array[ia] & b.is_array[ib]
    read = arrays & ~a.same_leaves(ia, b, ib) & a.same_shapes(ia, b, ib)
    return sum(
        int(a.leaf_nbytes[i] + b.leaf_nbytes[j])
        for i, j in zip(ia[read].tolist(), ib[read].tolist(), strict=True)
        if a.addresses[i] in chosen
    )


def readable(storage: Storage) -> tuple[list[Checkpoint], tuple[tuple[str, str], ...]]:
    """The checkpoints of a store whose commit record and manifest can be read, oldest first,
    and (name, problem) of the others, in name order; one of a format this version cannot read
    raises UnsupportedFormatError (as listing does: upgrade treestore)."""
    records, bad = _committed.committed_records(storage)
    if not records and not bad:
        raise _committed.not_found(storage, None)
    problems: dict[str, TreestoreError] = dict(bad)
    views = []
    for r in sorted(records, key=_paths.commit_order):
        try:
            views.append(Checkpoint(storage, _committed.read_columns(storage, r)))
        except CheckpointNotFoundError:
            continue  # deleted since the listing
        except (DamagedError, UnsupportedFormatError) as exc:
            problems[r.name] = exc
    newer = [e for e in problems.values() if isinstance(e, UnsupportedFormatError)]
    if newer:
        raise newer[0]
    if problems:
        _log.warning("%s: timeline leaves out %d damaged checkpoint(s)", storage.url, len(problems))
    return views, tuple((name, str(problems[name])) for name in sorted(problems))


def chosen_leaves(
    storage: Storage, select: _select.Patterns, depth: int | None
) -> tuple[list[Checkpoint], tuple[tuple[str, str], ...], list[dict[str, int]], list[str]]:
    """What a timeline and the norms walk: the :func:`readable` checkpoints and the others'
    problems, each checkpoint's :func:`array_leaves`, and the addresses ``select`` chooses among
    all of them (in order of first appearance). Raises InvalidInputError for a ``depth`` that is
    not an int of at least 1."""
    if depth is not None and (type(depth) is not int or depth < 1):
        raise InvalidInputError(f"depth must be an int of at least 1, got {depth!r}")
    views, damaged = readable(storage)
    arrays = [array_leaves(v._columns) for v in views]
    every = list(dict.fromkeys(a for leaves in arrays for a in leaves))
    chosen = _select.select(every, select, where=f"the checkpoints of {storage.url}")
    return views, damaged, arrays, chosen


def timeline(
    storage: Storage,
    *,
    select: _select.Patterns = None,
    depth: int | None = None,
    progress: Progress | None = None,
) -> Timeline:
    """The :class:`Timeline` of every checkpoint of a store, oldest first (see
    :meth:`treestore.Store.timeline`)."""
    views, damaged, arrays, chosen = chosen_leaves(storage, select, depth)
    row = {a: i for i, a in enumerate(chosen)}
    sizes = [0] * len(chosen)
    for view, leaves in zip(views, arrays, strict=True):
        for address, k in leaves.items():
            if address in row:
                sizes[row[address]] = math.prod(view._columns.shape(k))
    pats = _select.patterns(select)
    wanted = set(chosen)
    steps = len(views) - 1
    values = np.full((len(chosen), max(steps, 0)), np.nan)
    nonfinite = np.zeros(values.shape, np.int64)
    work = [_changed_bytes(views[j]._columns, views[j + 1]._columns, wanted) for j in range(steps)]
    total, done = sum(work), 0
    if progress is not None:
        progress(0, total)
    for j in range(steps):
        a, b = views[j], views[j + 1]
        present = set(arrays[j]) | set(arrays[j + 1])
        pair: list[str] | None = None
        if pats is not None:  # each pattern passed to diff must match a leaf of the pair
            pair = [p for p in pats if any(_select.matches(x, (p,)) for x in present)]
            if not pair:
                continue
        share, before = work[j], done

        def advance(part: int, whole: int, share: int = share, before: int = before) -> None:
            if progress is not None:  # this pair's fraction, on its share of the total
                progress(before + (share * part // whole if whole else 0), total)

        compared = _diff.diff_checkpoints(a, b, values=True, select=pair, progress=advance).leaves
        assert isinstance(compared, _diff.DiffLeaves)
        # Every chosen array leaf of both is compared (it matches a pattern of the pair): 0.0
        # unless it differs; one of another shape or type has no relative change (NaN).
        both = [row[x] for x in arrays[j] if x in arrays[j + 1] and x in row]
        values[both, j] = 0.0
        for d in compared.differing():
            i = row.get(d.address)
            if i is None or d.address not in arrays[j] or d.address not in arrays[j + 1]:
                continue
            if d.status == _diff.CHANGED and d.change is not None:
                values[i, j] = d.change.rel_l2
                nonfinite[i, j] = d.change.nonfinite_changed
            else:
                values[i, j] = np.nan
        done += work[j]
        if progress is not None:
            progress(done, total)
    result = Timeline(
        storage.url,
        tuple(v.name for v in views),
        tuple(chosen),
        tuple(tuple(float(v) for v in r) for r in values),
        tuple(sizes),
        nonfinite=tuple(tuple(int(n) for n in r) for r in nonfinite) if nonfinite.any() else (),
        damaged=damaged,
    )
    return result if depth is None else result.grouped(depth)


# The doctests of the methods: the classes report themselves as treestore.X (or treestore.types.X),
# which hides their methods from doctest's search of this module.
__test__ = {
    f"{cls.__name__}.{name}": getattr(cls, name)
    for cls in (Timeline,)
    for name, value in vars(cls).items()
    if not name.startswith("__") and ">>>" in (getattr(value, "__doc__", None) or "")
}
