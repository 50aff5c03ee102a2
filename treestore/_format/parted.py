"""Manifests stored in parts (SPEC.md, section 5.8): a multi-process save's manifest is a frame
— every leaf, and the chunk refs of the leaves that are not sharded — and the list of the parts
each process wrote with its pieces, so the primary's commit never reads or merges the pieces.

:class:`Parted` is a decoded frame; :mod:`treestore._engine.parts` reads the parts and completes
it into the checkpoint's :class:`~treestore._format.columns.Columns`, checked as any manifest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from treestore._format.columns import Columns
from treestore._format.encoding import Bad
from treestore._format.encoding import field as _get
from treestore._format.limits import MAX_PART_BYTES, MAX_PARTS, MAX_PARTS_BYTES


@dataclass(frozen=True, eq=False)
class Parted:
    """The frame of a manifest stored in parts: ``frame`` (its leaves saved in pieces list none
    here), the ``layout`` digest every part must carry, and each part's digest and size, in
    process order."""

    frame: Columns
    layout: bytes
    parts: tuple[tuple[bytes, int], ...]

    @property
    def name(self) -> str:
        return self.frame.name


def parts_from_record(rec: dict[str, Any]) -> tuple[bytes, tuple[tuple[bytes, int], ...]]:
    """The ``layout`` and ``parts`` fields of a manifest record stored in parts; Bad when they
    are malformed."""
    items = _get(rec, "parts", list)
    if len(items) > MAX_PARTS:
        raise Bad(f"it lists {len(items)} parts, over the limit of {MAX_PARTS}")
    layout = _get(rec, "layout", bytes)
    if len(layout) != 32:
        raise Bad(f"its layout is {len(layout)} bytes, not 32")
    parts = []
    for item in items:
        if not (
            isinstance(item, list) and len(item) == 2 and type(item[0]) is bytes and type(item[1]) is int
        ):
            raise Bad("a part should be [digest, size]")
        if len(item[0]) != 32 or not 0 <= item[1] <= MAX_PART_BYTES:
            raise Bad(f"a part has a {len(item[0])}-byte digest or a size outside [0, {MAX_PART_BYTES}]")
        parts.append((item[0], item[1]))
    if sum(size for _, size in parts) > MAX_PARTS_BYTES:
        raise Bad(
            f"its parts take {sum(size for _, size in parts)} bytes, over the limit of {MAX_PARTS_BYTES}"
        )
    return layout, tuple(parts)


def parts_fields(parted: Parted | None) -> dict[str, Any]:
    """The fields of a manifest record that say where its pieces are (none when not parted)."""
    if parted is None:
        return {"parts": []}
    return {"layout": parted.layout, "parts": [[d, size] for d, size in parted.parts]}


__all__ = ["Parted", "parts_fields", "parts_from_record"]
