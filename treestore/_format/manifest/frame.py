"""Manifests stored in parts (SPEC.md, section 8.4): a multi-process save's manifest is a frame
— every leaf, and the chunk refs of the leaves that are not sharded — and the list of the parts
each process wrote with its pieces, so the primary's commit never reads or merges the pieces.

:class:`Frame` is a decoded frame; :mod:`treestore._engine.reading.parts` reads the parts (those a
reader of some leaves needs, or all) and completes it into the checkpoint's
:class:`~treestore._format.manifest.columns.Columns`, checked as any manifest.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from treestore._format.encoding import Bad
from treestore._format.encoding import field as _get
from treestore._format.limits import MAX_PART_BYTES, MAX_PARTS, MAX_PARTS_BYTES
from treestore._format.manifest.columns import Columns, prefix_sums


class ListedPart(NamedTuple):
    """A part as its frame lists it: its digest and size, and the leaf indices ``[first, end)``
    its pieces lie in (``0, 0`` when it holds none)."""

    digest: bytes
    size: int
    first: int
    end: int


@dataclass(frozen=True, eq=False)
class Frame:
    """The frame of a manifest stored in parts: its ``columns`` (its leaves saved in pieces wait for
    their parts: they list no piece here), the ``layout`` digest every part must carry, and each
    part, in process order."""

    columns: Columns
    layout: bytes
    parts: tuple[ListedPart, ...]

    @property
    def name(self) -> str:
        return self.columns.name

    @functools.cached_property
    def ranges(self) -> np.ndarray:
        """Each part's leaf range ``[first, end)``, one int64 row per part."""
        return np.array([(p.first, p.end) for p in self.parts], np.int64).reshape(-1, 2)

    def needed(self, leaves: np.ndarray | None = None) -> np.ndarray:
        """The indices of the parts a reader of ``leaves`` (a bool mask over the frame's leaves;
        None: every leaf) reads: those whose leaf range meets one of them saved in pieces."""
        wanted = self.columns.unread if leaves is None else self.columns.unread & leaves
        held = prefix_sums(wanted.astype(np.int64))
        return np.flatnonzero(held[self.ranges[:, 1]] > held[self.ranges[:, 0]])

    def covered(self, parts: np.ndarray) -> np.ndarray:
        """Per leaf of the frame: whether every part whose leaf range holds it is one of
        ``parts`` (indices), so that those parts alone complete it."""
        n = len(self.columns)

        def holding(rows: np.ndarray) -> np.ndarray:  # parts whose range holds each leaf
            steps = np.bincount(rows[:, 0], minlength=n + 1) - np.bincount(rows[:, 1], minlength=n + 1)
            return np.cumsum(steps)[:n]

        return holding(self.ranges) == holding(self.ranges[parts])


def parts_from_record(rec: dict[str, Any], nleaves: int) -> tuple[bytes, tuple[ListedPart, ...]]:
    """The ``layout`` and ``parts`` fields of a manifest record stored in parts, whose tree has
    ``nleaves`` leaves; Bad when they are malformed."""
    items = _get(rec, "parts", list)
    if len(items) > MAX_PARTS:
        raise Bad(f"it lists {len(items)} parts, over the limit of {MAX_PARTS}")
    layout = _get(rec, "layout", bytes)
    if len(layout) != 32:
        raise Bad(f"its layout is {len(layout)} bytes, not 32")
    parts = []
    for item in items:
        if not (
            isinstance(item, list)
            and len(item) == 4
            and type(item[0]) is bytes
            and all(type(n) is int for n in item[1:])
        ):
            raise Bad("a part should be [digest, size, first leaf, end leaf]")
        found, size, first, end = item
        if len(found) != 32 or not 0 <= size <= MAX_PART_BYTES:
            raise Bad(f"a part has a {len(found)}-byte digest or a size outside [0, {MAX_PART_BYTES}]")
        if not 0 <= first <= end <= nleaves:
            raise Bad(f"a part's leaves [{first}, {end}) are not a range of the tree's {nleaves}")
        parts.append(ListedPart(found, size, first, end))
    if sum(p.size for p in parts) > MAX_PARTS_BYTES:
        raise Bad(f"its parts take {sum(p.size for p in parts)} bytes, over the limit of {MAX_PARTS_BYTES}")
    return layout, tuple(parts)


def parts_fields(frame: Frame | None) -> dict[str, Any]:
    """The fields of a manifest record that say where its pieces are (none when it is not stored
    in parts)."""
    if frame is None:
        return {"parts": []}
    return {"layout": frame.layout, "parts": [list(p) for p in frame.parts]}


__all__ = ["Frame", "ListedPart", "parts_fields", "parts_from_record"]
