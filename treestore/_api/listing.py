"""Listing a store's committed checkpoints: :class:`CheckpointInfo`, one per checkpoint, damaged
ones included on request."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from treestore._engine.reading import committed as _committed
from treestore._format import paths as _paths
from treestore._storage.base import Storage
from treestore.errors import TreestoreError


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint as listed by :meth:`Store.list`; with ``damaged=True``, one whose
    commit record cannot be read has ``problem`` set (and NaN, 0, 0, None for what it would say).

    Attributes:
        name: The checkpoint's name.
        created: When it was saved (seconds since the epoch; NaN when its record cannot be read).
        leaves: How many leaves its tree holds.
        nbytes: Raw bytes of its array leaves.
        metadata: The metadata it was saved with.
        problem: Why its commit record cannot be read (it is damaged, or of a newer format);
            None for a readable one.
    """

    name: str
    created: float
    leaves: int
    nbytes: int
    metadata: Any
    problem: str | None = None


def list_checkpoints(storage: Storage, *, damaged: bool = False) -> list[CheckpointInfo]:
    """The committed checkpoints of ``storage``, oldest first (see :meth:`Store.list`); with
    ``damaged``, those whose commit record cannot be read after them, in name order."""
    if not damaged:
        refs = _committed.readable_records(storage)
        bad: dict[str, TreestoreError] = {}
    else:
        found, unread = _committed.committed_records(storage)
        refs, bad = found, dict(unread)
    infos = [
        CheckpointInfo(r.name, r.created, r.leaves, r.nbytes, r.metadata)
        for r in sorted(refs, key=_paths.commit_order)
    ]
    return infos + [CheckpointInfo(n, math.nan, 0, 0, None, str(bad[n])) for n in sorted(bad)]
