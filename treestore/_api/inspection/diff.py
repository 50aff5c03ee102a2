"""Exact diffs between two checkpoints, from their manifests: which addresses were added, removed
or changed, and the share of each leaf's chunks that differ (numeric change: :mod:`diff_values`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, overload

import numpy as np

from treestore._api.checkpoint import Checkpoint
from treestore._api.inspection import diff_values as _values
from treestore._api.inspection.diff_values import ValueChange
from treestore._api.lazy_leaf import LazyLeaf
from treestore._deprecated import renamed_attribute
from treestore._engine.progress import Progress, counter
from treestore._format import select as _select
from treestore._format.manifest.columns import Columns

ADDED, REMOVED, CHANGED, SHAPE, DTYPE, UNCHANGED = (
    "added",
    "removed",
    "changed",
    "shape_changed",
    "dtype_changed",
    "unchanged",
)


@dataclass(frozen=True)
class LeafDiff:
    """How one address differs: its status, its type in a and b, the share of chunks that differ.

    Attributes:
        address: The address compared.
        status: ``"added"`` (only b has it), ``"removed"`` (only a has it), ``"changed"``
            (its value differs), ``"shape_changed"``, ``"dtype_changed"`` (its dtype, or the
            kind of a Python scalar, differs) or ``"unchanged"``.
        a: Its type in a: ``"float32[3, 4]"`` for an array, the kind (``"int"``, ``"float"``,
            ...) for a Python scalar; None when a lacks it.
        b: Its type in b, the same way.
        chunks_changed: The fraction of the leaf's chunks whose digests differ; None unless it
            is an array in both, of one shape and dtype, chunked alike.
        change: How much its values changed, with ``diff(values=True)``, for a changed array
            leaf; else None.
    """

    address: str
    status: str
    a: str | None
    b: str | None
    chunks_changed: float | None = None
    change: ValueChange | None = None

    stats = renamed_attribute("LeafDiff", "stats", "change")


def _describe(c: Columns, i: int) -> str:
    """Leaf i's type as a diff shows it: ``float32[3, 4]``, or a Python scalar's kind."""
    return _array_type(c.dtype_name(i), c.shape(i)) if c.is_array[i] else c.kind(i)


def _array_type(dtype: str | None, shape: tuple[int, ...]) -> str:
    """An array leaf's type as a diff shows it: ``float32[3, 4]``."""
    return f"{dtype}{list(shape)}"


@dataclass(frozen=True)
class Diff:
    """The difference between checkpoints ``a`` and ``b``: one :class:`LeafDiff` per address.

    Falsy when the checkpoints hold identical trees. Iterating (and ``len()``) gives the leaves
    that differ; ``str()`` is a table; :meth:`to_json` gives plain data.

    Attributes:
        a: The first checkpoint, as ``URL#NAME``.
        b: The second checkpoint, as ``URL#NAME``.
        leaves: A :class:`LeafDiff` for every address compared, unchanged ones too: a's
            addresses in tree order, then those only b has.
    """

    a: str
    b: str
    leaves: Sequence[LeafDiff]

    def __bool__(self) -> bool:
        return next(iter(self), None) is not None

    def __iter__(self) -> Iterator[LeafDiff]:
        if isinstance(self.leaves, DiffLeaves):
            return iter(self.leaves.differing())
        return (d for d in self.leaves if d.status != UNCHANGED)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def by_status(self, status: str) -> tuple[LeafDiff, ...]:
        """The leaves of one status.

        Args:
            status: A :attr:`LeafDiff.status`: ``"added"``, ``"removed"``, ``"changed"``,
                ``"shape_changed"``, ``"dtype_changed"`` or ``"unchanged"``.

        Returns:
            tuple[LeafDiff, ...]: Their :class:`LeafDiff`, in the order of ``leaves`` (empty for
            any other status).
        """
        if status != UNCHANGED:
            return tuple(d for d in self if d.status == status)
        return tuple(d for d in self.leaves if d.status == status)

    def _counts(self) -> dict[str, int]:
        counts = dict.fromkeys((ADDED, REMOVED, CHANGED, SHAPE, DTYPE), 0)
        for d in self:
            counts[d.status] += 1
        counts[UNCHANGED] = len(self.leaves) - sum(counts.values())
        return counts

    @property
    def added(self) -> tuple[str, ...]:
        """The addresses only b has."""
        return tuple(d.address for d in self.by_status(ADDED))

    @property
    def removed(self) -> tuple[str, ...]:
        """The addresses only a has."""
        return tuple(d.address for d in self.by_status(REMOVED))

    @property
    def changed(self) -> tuple[str, ...]:
        """The addresses whose value changed (same shape and dtype)."""
        return tuple(d.address for d in self.by_status(CHANGED))

    @property
    def unchanged(self) -> tuple[str, ...]:
        """The addresses equal in both."""
        return tuple(d.address for d in self.by_status(UNCHANGED))

    def filter(self, patterns: str | Sequence[str]) -> Diff:
        """Only the addresses matching any of the patterns.

        Args:
            patterns: Patterns over addresses (one or a list); unlike ``select``, a
                pattern that matches nothing is no error.

        Returns:
            Diff: A :class:`Diff` of the matching addresses, in the same order.
        """
        if isinstance(self.leaves, DiffLeaves):
            addresses = self.leaves.addresses()
        else:
            addresses = [d.address for d in self.leaves]
        chosen = {a for p in _select.patterns(patterns) or () for a in _select.matching(p, addresses)}
        kept = [k for k, a in enumerate(addresses) if a in chosen]
        if isinstance(self.leaves, DiffLeaves):
            return replace(self, leaves=self.leaves.subset(np.array(kept, np.int64)))
        return replace(self, leaves=tuple(self.leaves[k] for k in kept))

    def to_json(self) -> dict[str, Any]:
        """The diff as plain data, ready for :func:`json.dumps`.

        Returns:
            dict[str, Any]: ``{"a", "b", "identical", "counts", "leaves"}``: ``counts`` maps each
            status to its number of addresses, ``leaves`` holds every :class:`LeafDiff` as a dict (non-finite
            statistics as the strings "nan" and "inf").
        """

        def clean(v: Any) -> Any:
            if isinstance(v, float) and not math.isfinite(v):
                return str(v)
            return v

        leaves = []
        for d in self.leaves:
            rec = asdict(d)
            if d.change is not None:
                rec["change"] = {k: clean(v) for k, v in asdict(d.change).items()}
            leaves.append(rec)
        return {"a": self.a, "b": self.b, "identical": not self, "counts": self._counts(), "leaves": leaves}

    def __str__(self) -> str:
        return self.table()

    def table(self, *, ascii: bool = False) -> str:
        """A human-readable table of what differs: one row per added, removed or changed
        address; with values compared, each leaf's max |a-b|, relative L2 change and share of elements
        changed, NaN/Inf counts of the leaves that hold any, and the relative change of
        floating-point leaves drawn as a bar scaled to the largest, ``!`` after it where elements
        changed to, from or between NaN and ±inf; then a one-line summary (and a line saying what
        ``!`` means, when one is shown).

        Args:
            ascii: Draw the bars with ``#`` instead of block characters.

        Returns:
            The table, its lines joined by newlines.
        """
        shown = list(self)
        values = any(d.change is not None for d in shown)
        barred = {
            d.address: d.change.rel_l2
            for d in shown
            if d.change is not None and (d.a or "").startswith(_FLOATING) and not math.isnan(d.change.rel_l2)
        }
        top = max((v for v in barred.values() if math.isfinite(v)), default=0.0)
        nonfinite = any(s and (s.nan_a or s.nan_b or s.inf_a or s.inf_b) for s in (d.change for d in shown))
        header = ["", "address", "a", "b", "chunks"]
        if values:
            header += [
                "max abs",
                "rel L2",
                "changed",
                *(["nonfinite"] if nonfinite else []),
                "relative change",
            ]
        rows = []
        for d in shown:
            row = [_MARKS[d.status], d.address or "(root)", d.a or "", d.b or ""]
            row.append("" if d.chunks_changed is None else f"{d.chunks_changed:.0%}")
            s = d.change
            if values:
                row += (
                    ["", "", ""] if s is None else [_num(s.max_abs), _num(s.rel_l2), f"{s.frac_changed:.1%}"]
                )
                if nonfinite:
                    row.append(_nonfinite(s) if s else "")
                rel = barred.get(d.address, 0.0)
                bar = _bar(top if math.isinf(rel) else rel, top or 1.0, ascii) if rel else ""
                row.append(bar + (" !" if s is not None and s.nonfinite_changed else ""))
            rows.append(row)
        lines = [f"--- {self.a}", f"+++ {self.b}"]
        if rows:
            lines += _columns(header, rows, right={4, 5, 6, 7})
        counts = self._counts()
        parts = [f"{counts[k]} {k.replace('_', ' ')}" for k in _MARKS if counts[k]]
        lines.append(f"{', '.join(parts) if parts else 'identical'}; {counts[UNCHANGED]} leaves unchanged")
        if any(d.change is not None and d.change.nonfinite_changed for d in shown):
            lines.append(
                "!: elements changed to, from or between NaN and ±inf (max abs is then inf; rel L2 "
                "and the bar measure the elements finite in both)"
            )
        return "\n".join(lines)


_MARKS = {ADDED: "+", REMOVED: "-", CHANGED: "~", SHAPE: "!", DTYPE: "!"}
_FLOATING = ("float", "bfloat", "complex")  # leaves whose change is drawn as a bar
_EIGHTHS = " ▏▎▍▌▋▊▉"


def _num(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3g}"


def _nonfinite(s: ValueChange) -> str:
    """The NaN and Inf counts of a leaf that has any, on either side (blank for one without)."""
    parts = [
        f"{what} {a}->{b}" for what, a, b in (("NaN", s.nan_a, s.nan_b), ("Inf", s.inf_a, s.inf_b)) if a or b
    ]
    if s.nonfinite_changed:
        parts.append(f"{s.nonfinite_changed} changed")
    return ", ".join(parts)


def _bar(value: float, top: float, ascii: bool, width: int = 20) -> str:
    """``width`` cells for ``value`` out of ``top``, in eighths of a cell; any nonzero value
    shows at least a sliver."""
    eighths = max(1, round(min(value / top, 1.0) * width * 8))
    full, part = divmod(eighths, 8)
    if ascii:
        return "#" * max(full, 1)
    return "█" * full + (_EIGHTHS[part] if part else "")


def _columns(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    cells = [header, *rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return [
        "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in cells
    ]


CUT = "cut"  # equal types cut into other chunks or pieces: the data must be compared


def _compare(ca: Columns, ia: np.ndarray, cb: Columns, ib: np.ndarray) -> tuple[list[str], np.ndarray]:
    """How pairs of leaves at one address whose digests differ (``ca`` leaf ia[k], ``cb`` leaf
    ib[k]) differ, column by column: each pair's status (CUT when only their data can tell)
    and, where they are cut into chunks alike, the share of chunks whose digests differ (else NaN)."""
    arrays = ca.is_array[ia] & cb.is_array[ib]
    types = ca.same_types(ia, cb, ib)
    status = np.full(len(ia), CHANGED, object)  # Python scalars of one kind: changed values
    status[~arrays & ~types] = DTYPE  # an array and a scalar, or scalars of two kinds
    shape = arrays & ~ca.same_shapes(ia, cb, ib)
    status[shape] = SHAPE
    dtype = arrays & ~shape & ~types
    status[dtype] = DTYPE
    rest = arrays & ~shape & ~dtype
    plain, share = ca.chunk_changes(ia, cb, ib)
    status[rest & plain & (share == 0)] = UNCHANGED
    status[rest & ~plain] = CUT
    return status.tolist(), np.where(rest & plain, share, np.nan)


class DiffLeaves(Sequence[LeafDiff]):
    """The :class:`LeafDiff` of every address two checkpoints are compared at, in order: a's
    addresses (leaf order), then those only b has. The differing ones are made while diffing;
    an unchanged one only when asked for, so a diff of huge, mostly equal trees stays cheap."""

    def __init__(
        self,
        a: Checkpoint,
        b: Checkpoint,
        rows: np.ndarray,
        partner: np.ndarray,
        added: np.ndarray,
        differing: dict[int, LeafDiff],
    ) -> None:
        self._a, self._b = a, b
        self._rows = rows  # positions compared: k < len(a) is a's leaf k, else b's added[k - len(a)]
        self._partner = partner  # b's leaf index for each of a's leaves, -1 when b lacks it
        self._added = added
        self._differing = differing
        self._made: dict[int, LeafDiff] = {}

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, k: int) -> LeafDiff: ...
    @overload
    def __getitem__(self, k: slice) -> list[LeafDiff]: ...
    def __getitem__(self, k: int | slice) -> LeafDiff | list[LeafDiff]:
        if isinstance(k, slice):
            return [self[j] for j in range(*k.indices(len(self)))]
        row = int(self._rows[k])  # IndexError past the end
        found = self._differing.get(row) or self._made.get(row)
        if found is None:
            c = self._a._columns
            described = _describe(c, row)
            found = self._made[row] = LeafDiff(c.address(row), UNCHANGED, described, described)
        return found

    def __iter__(self) -> Iterator[LeafDiff]:
        return (self[k] for k in range(len(self)))

    def differing(self) -> list[LeafDiff]:
        """The leaves that differ, in order."""
        return [self._differing[r] for r in sorted(self._differing) if _contains(self._rows, r)]

    def addresses(self) -> list[str]:
        na = len(self._a._columns)
        a, b = self._a._columns.addresses, self._b._columns.addresses
        return [a[r] if r < na else b[int(self._added[r - na])] for r in self._rows.tolist()]

    def subset(self, kept: np.ndarray) -> DiffLeaves:
        """The positions ``kept`` (indices into this sequence) only."""
        return DiffLeaves(self._a, self._b, self._rows[kept], self._partner, self._added, self._differing)


def _contains(sorted_rows: np.ndarray, row: int) -> bool:
    """Whether ``row`` is one of ``sorted_rows`` (increasing, as diffs keep them)."""
    k = int(np.searchsorted(sorted_rows, row))
    return k < len(sorted_rows) and int(sorted_rows[k]) == row


def diff_checkpoints(
    a: Checkpoint,
    b: Checkpoint,
    *,
    values: bool = False,
    select: _select.Patterns = None,
    progress: Progress | None = None,
) -> Diff:
    """Compare two checkpoints (possibly in different stores on different filesystems).

    Without ``values`` only the manifests are read, and compared column by column: leaves are
    matched by address (without building an address when both trees are the same) and compared
    by their digests' parts; only the leaves that differ are looked at one by one. With ``values``,
    how much each changed array leaf's values changed is computed chunk by chunk, reading the chunks
    whose digests differ (and a's unchanged chunks once, for the norm ‖a‖), ``progress`` told
    the raw bytes compared (both sides) of the leaves compared by value. ``select`` (its
    patterns) limits the comparison, values included, to matching addresses.
    """
    ca, cb = a._columns, b._columns
    na = len(ca)
    ia, ib = ca.match(cb)
    same = ca.same_leaves(ia, cb, ib)
    partner = np.full(na, -1, np.int64)
    partner[ia] = ib
    taken = np.zeros(len(cb), bool)
    taken[ib] = True
    added = np.flatnonzero(~taken)
    rows = np.arange(na + len(added))
    if select is not None:
        addresses = list(ca.addresses) + [cb.addresses[int(j)] for j in added]
        wanted = set(_select.select(list(dict.fromkeys(addresses)), select, where="either checkpoint"))
        rows = np.array([k for k, x in enumerate(addresses) if x in wanted], np.int64)
    look = np.zeros(na + len(added), bool)  # the rows that may differ
    look[na:] = True
    look[:na] = partner < 0
    look[ia[~same]] = True
    differing: dict[int, LeafDiff] = {}
    if not values:  # leaves whose chunks alone differ: told apart column by column
        pa, pb = ia[~same], ib[~same]
        plain, share = ca.chunk_changes(pa, cb, pb)
        for i, frac in zip(pa[plain].tolist(), share[plain].tolist(), strict=True):
            described = _describe(ca, i)
            differing[i] = LeafDiff(ca.address(i), CHANGED, described, described, frac)
            look[i] = False
    found = np.flatnonzero(look[rows] if len(rows) else look[:0])
    found = rows[found] if len(rows) else found
    pairs = found[(found < na)]
    pairs = pairs[partner[pairs] >= 0]
    status, share = _compare(ca, pairs, cb, partner[pairs])
    compared = dict(zip(pairs.tolist(), zip(status, share.tolist(), strict=True), strict=True))
    tick = None
    if values and progress is not None:
        by_value = [
            int(ca.leaf_nbytes[i] + cb.leaf_nbytes[partner[i]])
            for i, s in zip(pairs.tolist(), status, strict=True)
            if s in (CHANGED, CUT) and ca.is_array[i]
        ]
        tick = counter(progress, sum(by_value))
    for row in found.tolist():
        if row >= na:
            j = int(added[row - na])
            differing[row] = LeafDiff(cb.address(j), ADDED, None, _describe(cb, j))
        elif partner[row] < 0:
            differing[row] = LeafDiff(ca.address(row), REMOVED, _describe(ca, row), None)
        else:
            status_of, share_of = compared[row]
            leaf = _compared(a, b, row, int(partner[row]), status_of, share_of, values, tick)
            if leaf.status != UNCHANGED:
                differing[row] = leaf
    return Diff(f"{a.url}#{a.name}", f"{b.url}#{b.name}", DiffLeaves(a, b, rows, partner, added, differing))


def _compared(
    a: Checkpoint,
    b: Checkpoint,
    i: int,
    j: int,
    status: str,
    share: float,
    values: bool,
    tick: Callable[[int], None] | None = None,
) -> LeafDiff:
    """How leaf i of a and leaf j of b (at one address) differ, given their :func:`_compare`."""
    address = a._columns.address(i)
    frac = None if math.isnan(share) else share
    change = None
    if status == CUT:
        status = CHANGED if _bytes_differ(a[address], b[address]) else UNCHANGED
        if values and status == CHANGED:
            change = _values.whole_change(a[address], b[address], tick)
        elif tick is not None and a._columns.is_array[i]:
            tick(int(a._columns.leaf_nbytes[i] + b._columns.leaf_nbytes[j]))  # compared: equal
    elif values and status == CHANGED and a._columns.is_array[i]:
        change = _values.chunk_change(a, i, b, j, tick)
    return LeafDiff(address, status, _describe(a._columns, i), _describe(b._columns, j), frac, change)


def _bytes_differ(a: LazyLeaf, b: LazyLeaf) -> bool:
    return bool(np.asarray(a).tobytes() != np.asarray(b).tobytes())
