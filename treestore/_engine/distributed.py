"""Saves by several processes of one ``jax.distributed`` job.

Every process writes the chunks of the shards it owns and a staging record listing their pieces;
after a barrier the primary process (index 0) merges the records, writes the manifest and commits;
after a second barrier the others read the outcome, and after a third the primary removes the
staging records. If any process fails, nothing is committed and every process raises.
Synchronisation uses JAX's own runtime (``multihost_utils``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import jax
import msgpack
import numpy as np

from treestore._format import layout as _layout
from treestore._format.manifest import ChunkRef, LeafEntry, Piece
from treestore._storage.base import Storage
from treestore.errors import StorageError

STAGING = _layout.STAGING


@dataclass(frozen=True)
class Group:
    """This process's place in a multi-process save."""

    index: int
    count: int
    save_id: str

    @property
    def primary(self) -> bool:
        return self.index == 0

    def _path(self, who: str) -> str:
        return f"{STAGING}/{self.save_id}/{who}"

    def barrier(self, step: str) -> None:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"treestore-{self.save_id}-{step}")

    def share_pieces(
        self,
        storage: Storage,
        entries: list[LeafEntry],
        packs: list[ChunkRef],
        error: BaseException | None,
    ) -> None:
        """Write this process's staging record: its pieces and packs, or the error that stopped it."""
        record: dict[str, Any] = {"ok": error is None}
        if error is not None:
            record["error"] = f"{type(error).__name__}: {error}"
        else:
            record["pieces"] = {e.address: [p.to_record() for p in e.pieces] for e in entries if e.pieces}
            record["packs"] = [p.to_record() for p in packs]
        storage.write(self._path(f"process-{self.index}"), [msgpack.packb(record, use_bin_type=True)])

    def merge(self, storage: Storage, entries: list[LeafEntry]) -> tuple[list[LeafEntry], list[ChunkRef]]:
        """The primary's entries and packs with every process's pieces and packs added (pack
        indices renumbered); StorageError if any process failed."""
        gathered: dict[str, list[Piece]] = {}
        all_packs: list[ChunkRef] = []  # process 0's first, so the primary's own indices hold
        problems = []
        for i in range(self.count):
            data = storage.read(self._path(f"process-{i}"), limit=1 << 28)
            try:
                record = msgpack.unpackb(data or b"", raw=False)
                if not record["ok"]:
                    problems.append(f"process {i}: {record['error']}")
                    continue
                base = len(all_packs)
                all_packs.extend(_chunk(p, 0) for p in record["packs"])
                for address, pieces in record["pieces"].items():
                    gathered.setdefault(address, []).extend(_piece(p, base) for p in pieces)
            except Exception as exc:  # missing or unreadable record: that process did not finish
                problems.append(f"process {i}: no usable staging record ({type(exc).__name__})")
        if problems:
            raise StorageError("multi-process save failed: " + "; ".join(problems))
        merged = []
        for e in entries:
            pieces = tuple(sorted(gathered.get(e.address, ()), key=lambda p: p.start))
            if pieces:
                e = replace(e, pieces=pieces, chunks=tuple(c for p in pieces for c in p.chunks))
            merged.append(e)
        return merged, all_packs

    def announce(self, storage: Storage, error: BaseException | None) -> None:
        outcome = {
            "ok": error is None,
            "error": None if error is None else f"{type(error).__name__}: {error}",
        }
        storage.write(self._path("outcome"), [msgpack.packb(outcome)])

    def outcome(self, storage: Storage) -> None:
        """Raise unless the primary committed."""
        data = storage.read(self._path("outcome"), limit=1 << 16)
        try:
            outcome = msgpack.unpackb(data or b"", raw=False)
            ok, error = bool(outcome["ok"]), outcome["error"]
        except Exception:
            ok, error = False, "the primary process wrote no outcome"
        if not ok:
            raise StorageError(f"multi-process save failed: {error}")

    def clean(self, storage: Storage) -> None:
        storage.delete_many([self._path(f"process-{i}") for i in range(self.count)] + [self._path("outcome")])


def _chunk(rec: Any, base: int) -> ChunkRef:
    if len(rec) == 5:
        return ChunkRef(bytes(rec[0]), int(rec[1]), int(rec[2]), base + int(rec[3]), int(rec[4]))
    return ChunkRef(bytes(rec[0]), int(rec[1]), int(rec[2]))


def _piece(rec: Any, base: int) -> Piece:
    start, shape, chunks = rec
    return Piece(
        tuple(int(a) for a in start), tuple(int(n) for n in shape), tuple(_chunk(c, base) for c in chunks)
    )


def group() -> Group | None:
    """This process's Group when the job has several processes, else None."""
    count = jax.process_count()
    if count == 1:
        return None
    from jax.experimental import multihost_utils

    token = multihost_utils.broadcast_one_to_all(np.frombuffer(os.urandom(16), np.uint8))
    return Group(jax.process_index(), count, bytes(np.asarray(token, np.uint8)).hex())


def canonical(entry: LeafEntry) -> LeafEntry:
    """A leaf saved as one piece covering all of it is stored as a plain leaf."""
    if len(entry.pieces) == 1 and entry.pieces[0].shape == entry.shape:
        return replace(entry, pieces=())
    return entry
