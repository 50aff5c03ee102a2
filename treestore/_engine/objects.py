"""The chunk objects a checkpoint references, each with the chunk refs that name it.

verify and copy walk a checkpoint object by object: each chunk object (a leaf's chunk outside
packs, or a pack) is fetched once and checked against its digest, and each leaf's reference into
a pack is checked against the bytes it names (:func:`treestore._engine.reading.read.pack_member`).
:func:`chunk_objects` groups a manifest's chunk refs by the object they name straight from its
columns: a few array operations, one object per chunk object, none per leaf or per ref. An
address is built only to name a leaf in an error.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from treestore._format.manifest.columns import Columns
from treestore._format.manifest.records import ChunkRef

_KEY = np.dtype([("digest", "V32"), ("raw", "<u4")])  # what names a chunk object: 36 bytes


@dataclass(frozen=True, eq=False)
class ChunkObject:
    """One chunk object of checkpoint ``columns``: ``ref`` names it; ``rows`` are the chunk refs
    (rows of ``columns.chunks``) that name it, or for a pack (``packed``) those into it."""

    ref: ChunkRef
    columns: Columns
    rows: np.ndarray
    packed: bool
    pack: int = -1  # for a pack: its index in the manifest's pack table

    @property
    def key(self) -> tuple[bytes, int]:
        """What identifies the object across checkpoints and stores: digest and raw size."""
        return self.ref.digest, self.ref.raw_size

    def leaves(self, rows: np.ndarray | None = None) -> np.ndarray:
        """The distinct leaves (indices, in order) whose chunk refs are ``rows`` (default: all)."""
        rows = self.rows if rows is None else rows
        return np.unique(np.searchsorted(self.columns.chunk_start, rows, side="right") - 1)

    def addresses(self, rows: np.ndarray | None = None) -> list[str]:
        """The addresses of :meth:`leaves`, ``(root)`` for the root leaf."""
        return [self.columns.address(int(i)) or "(root)" for i in self.leaves(rows)]

    def members(self) -> Iterator[tuple[bytes, int, int, int]]:
        """For a pack: each reference into it as (leaf chunk digest, offset, raw size, row)."""
        refs = self.columns.chunks[self.rows]
        digests = refs["digest"].tobytes()
        for k, (offset, size, row) in enumerate(
            zip(refs["offset"].tolist(), refs["raw"].tolist(), self.rows.tolist(), strict=True)
        ):
            yield digests[32 * k : 32 * k + 32], offset, size, row

    def owner(self, shown: int = 3) -> str:
        """The leaf (or leaves of a pack) this object holds, for a message."""
        leaves = self.leaves()
        named = [self.columns.address(int(i)) or "(root)" for i in leaves[:shown]]
        more = f" and {len(leaves) - shown} more" if len(leaves) > shown else ""
        return f"{', '.join(named)}{more} (pack {self.pack})" if self.packed else named[0]


def chunk_objects(columns: Columns) -> list[ChunkObject]:
    """Every chunk object ``columns`` references, once per distinct (digest, raw size) outside
    packs and once per pack, each with the refs naming it. The manifest must be complete (not a
    frame whose pieces are in parts not read)."""
    columns.require_pieces()
    chunks = columns.chunks
    out: list[ChunkObject] = []
    plain = np.flatnonzero(chunks["pack"] < 0)
    if len(plain):
        keys = np.empty(len(plain), _KEY)
        keys["digest"], keys["raw"] = chunks["digest"][plain], chunks["raw"][plain]
        _, first, which = np.unique(keys.view("V36"), return_index=True, return_inverse=True)
        order = np.argsort(which.reshape(-1), kind="stable")
        groups = np.split(plain[order], np.cumsum(np.bincount(which.reshape(-1)))[:-1])
        for j, rows in zip(plain[first].tolist(), groups, strict=True):
            out.append(ChunkObject(columns.chunk_ref(j), columns, rows, packed=False))
    if not len(columns.packs):
        return out
    packed = np.flatnonzero(chunks["pack"] >= 0)
    owner = chunks["pack"][packed]
    order = np.argsort(owner, kind="stable")
    groups = np.split(packed[order], np.cumsum(np.bincount(owner, minlength=len(columns.packs)))[:-1])
    for p, (ref, rows) in enumerate(zip(columns.pack_refs(), groups, strict=True)):
        out.append(ChunkObject(ref, columns, rows, packed=True, pack=p))
    return out
