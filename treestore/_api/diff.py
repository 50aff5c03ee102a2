"""Exact diffs between two checkpoints, from their manifests; numeric stats from changed chunks."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from treestore._api.checkpoint import Checkpoint, LazyLeaf
from treestore._engine.region import piece_bytes
from treestore._format import select as _select
from treestore._format.manifest import LeafEntry

ADDED, REMOVED, CHANGED, SHAPE, DTYPE, UNCHANGED = (
    "added",
    "removed",
    "changed",
    "shape_changed",
    "dtype_changed",
    "unchanged",
)


@dataclass(frozen=True)
class LeafStats:
    """Numeric change of one leaf between a and b (over all its elements)."""

    max_abs: float
    mean_abs: float
    rel_l2: float  # ||a - b|| / ||a||; inf when a is all zeros and b is not
    frac_changed: float  # fraction of elements that differ (NaN == NaN)
    nan_a: int
    nan_b: int
    inf_a: int
    inf_b: int


@dataclass(frozen=True)
class LeafDiff:
    """How one address differs: its status, its type in a and b, the share of chunks that differ."""

    address: str
    status: str
    a: str | None  # "float32[3, 4]", "int", ... or None when absent
    b: str | None
    chunks_changed: float | None = None  # fraction of the leaf's chunks whose digests differ
    stats: LeafStats | None = None


def _describe(e: LeafEntry | None) -> str | None:
    if e is None:
        return None
    if e.is_array:
        return f"{e.dtype}{list(e.shape or ())}"
    return e.kind


@dataclass(frozen=True)
class Diff:
    """The difference between checkpoints ``a`` and ``b``: one :class:`LeafDiff` per address.

    Falsy when the checkpoints hold identical trees. ``str()`` is a table; :meth:`to_json` gives
    plain data.
    """

    a: str
    b: str
    leaves: tuple[LeafDiff, ...]

    def __bool__(self) -> bool:
        return any(d.status != UNCHANGED for d in self.leaves)

    def __iter__(self) -> Iterator[LeafDiff]:
        return (d for d in self.leaves if d.status != UNCHANGED)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def by_status(self, status: str) -> tuple[LeafDiff, ...]:
        return tuple(d for d in self.leaves if d.status == status)

    @property
    def added(self) -> tuple[str, ...]:
        return tuple(d.address for d in self.by_status(ADDED))

    @property
    def removed(self) -> tuple[str, ...]:
        return tuple(d.address for d in self.by_status(REMOVED))

    @property
    def changed(self) -> tuple[str, ...]:
        return tuple(d.address for d in self.by_status(CHANGED))

    @property
    def unchanged(self) -> tuple[str, ...]:
        return tuple(d.address for d in self.by_status(UNCHANGED))

    def filter(self, patterns: str | Sequence[str]) -> Diff:
        """Only the addresses matching any of the ``patterns`` (none need match)."""
        addresses = [d.address for d in self.leaves]
        chosen = {a for p in _select.patterns(patterns) or () for a in _select.matching(p, addresses)}
        kept = tuple(d for d in self.leaves if d.address in chosen)
        return replace(self, leaves=kept)

    def to_json(self) -> dict[str, Any]:
        def clean(v: Any) -> Any:
            if isinstance(v, float) and not math.isfinite(v):
                return str(v)
            return v

        leaves = []
        for d in self.leaves:
            rec = asdict(d)
            if d.stats is not None:
                rec["stats"] = {k: clean(v) for k, v in asdict(d.stats).items()}
            leaves.append(rec)
        counts = {s: len(self.by_status(s)) for s in (ADDED, REMOVED, CHANGED, SHAPE, DTYPE, UNCHANGED)}
        return {"a": self.a, "b": self.b, "identical": not self, "counts": counts, "leaves": leaves}

    def __str__(self) -> str:
        return self.table()

    def table(self, *, ascii: bool = False) -> str:
        """A human-readable table of what differs: one row per added, removed or changed
        address; with stats, each leaf's max |a-b|, relative L2 change and share of elements
        changed, NaN/Inf counts when there are any, and the relative change of floating-point
        leaves drawn as a bar scaled to the largest (of ``#`` with ``ascii=True``); then a
        one-line summary."""
        shown = list(self)
        stats = any(d.stats is not None for d in shown)
        barred = {
            d.address: d.stats.rel_l2
            for d in shown
            if d.stats is not None and (d.a or "").startswith(_FLOATING) and not math.isnan(d.stats.rel_l2)
        }
        top = max((v for v in barred.values() if math.isfinite(v)), default=0.0)
        nonfinite = any(s and (s.nan_a or s.nan_b or s.inf_a or s.inf_b) for s in (d.stats for d in shown))
        header = ["", "address", "a", "b", "chunks"]
        if stats:
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
            s = d.stats
            if stats:
                row += (
                    ["", "", ""] if s is None else [_num(s.max_abs), _num(s.rel_l2), f"{s.frac_changed:.1%}"]
                )
                if nonfinite:
                    row.append(f"NaN {s.nan_a}->{s.nan_b}, Inf {s.inf_a}->{s.inf_b}" if s else "")
                rel = barred.get(d.address, 0.0)
                row.append(_bar(top if math.isinf(rel) else rel, top or 1.0, ascii) if rel else "")
            rows.append(row)
        lines = [f"--- {self.a}", f"+++ {self.b}"]
        if rows:
            lines += _columns(header, rows, right={4, 5, 6, 7})
        counts = self.to_json()["counts"]
        parts = [f"{counts[k]} {k.replace('_', ' ')}" for k in _MARKS if counts[k]]
        lines.append(f"{', '.join(parts) if parts else 'identical'}; {counts[UNCHANGED]} leaves unchanged")
        return "\n".join(lines)


_MARKS = {ADDED: "+", REMOVED: "-", CHANGED: "~", SHAPE: "!", DTYPE: "!"}
_FLOATING = ("float", "bfloat", "complex")  # leaves whose change is drawn as a bar
_EIGHTHS = " ▏▎▍▌▋▊▉"


def _num(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3g}"


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


def _compare(ea: LeafEntry, eb: LeafEntry) -> tuple[str, float | None]:
    if ea.is_array != eb.is_array or (not ea.is_array and ea.kind != eb.kind):
        return DTYPE, None
    if not ea.is_array:
        same = ea.digest == eb.digest
        return (UNCHANGED if same else CHANGED), None
    if ea.shape != eb.shape:
        return SHAPE, None
    if ea.dtype != eb.dtype or ea.prng_impl != eb.prng_impl:
        return DTYPE, None
    if ea.digest == eb.digest:
        return UNCHANGED, None
    if _layout_of(ea) == _layout_of(eb):
        differ = sum(ca.digest != cb.digest for ca, cb in zip(ea.chunks, eb.chunks, strict=True))
        return (CHANGED if differ else UNCHANGED), differ / max(len(ea.chunks), 1)
    return "layout", None  # equal types saved with different chunk sizes: compare the data


def _layout_of(e: LeafEntry) -> list[tuple[tuple[int, ...], tuple[int, ...], list[int]]]:
    return [(p.start, p.shape, [c.raw_size for c in p.chunks]) for p in e.layout]


def diff_checkpoints(
    a: Checkpoint, b: Checkpoint, *, stats: bool = False, select: _select.Patterns = None
) -> Diff:
    """Compare two checkpoints (possibly in different stores on different filesystems).

    Without ``stats`` only the manifests are read. With ``stats``, numeric statistics of each
    changed array leaf are computed chunk by chunk, reading the chunks whose digests differ (and a's
    unchanged chunks once, for the norm ‖a‖). ``select`` (glob patterns) limits the comparison,
    stats included, to matching addresses.
    """

    addresses = list(dict.fromkeys(e.address for c in (a, b) for e in c.manifest.leaves))
    wanted = set(_select.select(addresses, select, where="either checkpoint"))
    la = {e.address: e for e in a.manifest.leaves if e.address in wanted}
    lb = {e.address: e for e in b.manifest.leaves if e.address in wanted}
    out: list[LeafDiff] = []
    for address in list(la) + [x for x in lb if x not in la]:
        ea, eb = la.get(address), lb.get(address)
        if ea is None or eb is None:
            status = ADDED if ea is None else REMOVED
            out.append(LeafDiff(address, status, _describe(ea), _describe(eb)))
            continue
        status, frac = _compare(ea, eb)
        leaf_stats = None
        if status == "layout":
            status = CHANGED if _bytes_differ(a[address], b[address]) else UNCHANGED
            frac = None
            if stats and status == CHANGED:
                leaf_stats = _stats(a[address], b[address], by_chunk=False)
        elif stats and status == CHANGED and ea.is_array:
            leaf_stats = _stats(a[address], b[address], by_chunk=True)
        out.append(LeafDiff(address, status, _describe(ea), _describe(eb), frac, leaf_stats))
    return Diff(f"{a.url}#{a.name}", f"{b.url}#{b.name}", tuple(out))


def _bytes_differ(a: LazyLeaf, b: LazyLeaf) -> bool:
    return bool(np.asarray(a).tobytes() != np.asarray(b).tobytes())


class _Accumulator:
    def __init__(self) -> None:
        self.max_abs = 0.0
        self.sum_abs = 0.0
        self.sum_sq = 0.0
        self.norm_a = 0.0
        self.changed = self.count = 0
        self.nan_a = self.nan_b = self.inf_a = self.inf_b = 0

    def add(self, xa: np.ndarray[Any, Any], xb: np.ndarray[Any, Any] | None) -> None:
        fa = xa.astype(np.complex128 if np.iscomplexobj(xa) else np.float64)
        self.count += fa.size
        self.norm_a += float(np.sum(np.abs(fa) ** 2))
        nan_a, inf_a = int(np.isnan(fa).sum()), int(np.isinf(fa).sum())
        self.nan_a += nan_a
        self.inf_a += inf_a
        if xb is None:  # identical chunk
            self.nan_b += nan_a
            self.inf_b += inf_a
            return
        fb = xb.astype(fa.dtype)
        self.nan_b += int(np.isnan(fb).sum())
        self.inf_b += int(np.isinf(fb).sum())
        both_nan = np.isnan(fa) & np.isnan(fb)
        differs = (fa != fb) & ~both_nan
        self.changed += int(differs.sum())
        with np.errstate(invalid="ignore", over="ignore"):
            delta = np.abs(np.where(differs, fb - fa, 0))
        finite = delta[np.isfinite(delta)]
        if delta.size and finite.size != delta.size:
            self.max_abs = math.inf
        if finite.size:
            self.max_abs = max(self.max_abs, float(finite.max()))
            self.sum_abs += float(finite.sum())
            self.sum_sq += float(np.sum(finite**2))
        if finite.size != delta.size:
            self.sum_abs = self.sum_sq = math.inf

    def result(self) -> LeafStats:
        n = max(self.count, 1)
        norm_a = math.sqrt(self.norm_a)
        diff_norm = math.sqrt(self.sum_sq)
        rel = diff_norm / norm_a if norm_a else (0.0 if diff_norm == 0 else math.inf)
        return LeafStats(
            self.max_abs,
            self.sum_abs / n,
            rel,
            self.changed / n,
            self.nan_a,
            self.nan_b,
            self.inf_a,
            self.inf_b,
        )


def _stats(a: LazyLeaf, b: LazyLeaf, *, by_chunk: bool) -> LeafStats:
    acc = _Accumulator()
    if not by_chunk:
        acc.add(np.asarray(a).reshape(-1), np.asarray(b).reshape(-1))
        return acc.result()
    for pa, pb in zip(a.entry.layout, b.entry.layout, strict=True):
        at = 0
        for ca, cb in zip(pa.chunks, pb.chunks, strict=True):
            xa = piece_bytes(a.reader, pa, at, at + ca.raw_size, a.address).view(a.dtype)
            same = ca.digest == cb.digest
            xb = None if same else piece_bytes(b.reader, pb, at, at + cb.raw_size, b.address).view(b.dtype)
            at += ca.raw_size
            acc.add(xa, xb)
    return acc.result()
