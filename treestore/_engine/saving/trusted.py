"""Trusted chunks: the chunk objects a committed checkpoint references, which a save (or a copy)
may reference without asking the store whether it holds them.

A save of step N+1 usually shares most chunks with step N. Without this, each of them costs a
size request (a HEAD on object stores) and a read of its first bytes (the reuse check, SPEC.md
section 5.2). :func:`learn` reads one checkpoint's manifest instead (its commit record and its
manifest: two requests, a listing more to find the store's newest) and gives a table of digest
-> stored size, looked up once per chunk.

Why a trusted chunk needs no check (SPEC.md sections 5.2 and 9):

* A chunk a committed checkpoint references is deleted only by gc, and gc deletes only what no
  commit record listed in its run references. A checkpoint's chunks therefore vanish only after
  its commit record is removed *and* a gc runs.
* :func:`learn` runs holding the save's lock, after :func:`treestore._engine.locks.save_lock`
  has waited for any running gc to finish, and reads the commit record then. The writer that
  last committed that record made its chunks durable first, under a save lock of its own: the
  same exclusion kept every gc from deleting from then to its commit, and every gc after the
  commit listed the record (listings are strongly consistent) and kept its chunks. So they exist
  when the record is read.
* From then until the save's commit, the save's lock keeps every gc from deleting anything
  (gc defers while a live save lock exists; the save refreshes its lock, so it never goes stale).
  If the record is deleted meanwhile, its chunks stay until the save has committed, and from then
  the new checkpoint references them. (A gc run with a stale limit shorter than a save takes
  ignores that save's lock: that endangers every save, trusting or not; SPEC.md section 9.)

A hint learned *before* the lock (a table kept in memory from an earlier save) would not be safe:
the checkpoint could have been deleted and gc run in between. That is why callers name the
checkpoint (or ask for the store's newest) and its record and manifest are read under the lock.

What a manifest's bytes give is a pure function of them, and the bytes are named by their
digest: the table learned from a manifest (or made from the columns a save in this process
committed) is kept with the commit record it was checked against (:class:`_Tables`). The record
and the manifest's bytes are still read under the lock, and the bytes checked against the
record's digest, every time; the table is used only for an equal record. Only the decoding of
bytes already decoded (or encoded) here is skipped, which at 100k leaves is most of what
learning costs.

A trusted chunk also skips the reuse check: the save that committed it wrote it or checked it, and
damage since then (a body rotted on disk) is what ``verify`` finds, as for any chunk whose body
is damaged behind an intact header. A hint that cannot be used (no such checkpoint, a damaged or
unsupported commit record or manifest, a failed read) is dropped silently: the save then checks
every chunk, as it would without one. ``trust_previous=False`` asks for that every time.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from treestore._engine.reading.committed import read_columns, read_commit_record, read_manifest_bytes
from treestore._format import paths as _paths
from treestore._format.commit_record import CommitRecord
from treestore._format.manifest.columns import Columns
from treestore._storage.base import Storage
from treestore.errors import TreestoreError

_log = logging.getLogger("treestore")


@dataclass(frozen=True)
class TrustedChunks:
    """The chunk objects checkpoint ``checkpoint`` references, by digest: their stored sizes."""

    checkpoint: str
    stored: Mapping[bytes, int]  # chunk digest -> stored size (Columns.chunk_objects); read-only

    def __len__(self) -> int:
        return len(self.stored)


# What a caller names as the source of trusted chunks: a checkpoint's name, True for the store's
# newest checkpoint, False for none (check every chunk in the store).
Previous = str | bool


def learn(storage: Storage, previous: Previous) -> TrustedChunks | None:
    """The chunks checkpoint ``previous`` of ``storage`` references (True: the checkpoint whose
    commit record was written last; False: none), read now. Call it holding a save lock (see the
    module's docstring); None when there is no usable hint, for whatever reason."""
    if previous is False:
        return None
    try:
        name = previous if isinstance(previous, str) else _newest(storage)
        if name is None:
            return None
        record = read_commit_record(storage, name)
        data = read_manifest_bytes(storage, record)  # read and checked now, under the lock
        stored = _tables.get(record)
        if stored is None:
            stored = read_columns(storage, record, data).chunk_objects()
            _tables.put(record, stored)
        return TrustedChunks(record.name, MappingProxyType(stored))
    except TreestoreError as exc:  # an unusable hint: the save checks every chunk instead
        _log.debug("%s: no trusted chunks from %r (%s: %s)", storage.url, previous, type(exc).__name__, exc)
        return None


def remember(record: CommitRecord, columns: Columns) -> None:
    """Keep the chunk table of ``columns``, just committed by ``record`` (as readers decode it),
    for :func:`learn` (a manifest in parts, whose pieces are not all at hand, is left to be
    decoded when learned)."""
    if not columns.unread.any() and columns.chunk_object_count() <= _Tables.MAX_CHUNKS:
        _tables.put(record, columns.chunk_objects())


class _Tables:
    """Chunk tables by manifest digest, each with the commit record it was checked against, the
    least recently used leaving first: at most ``MAX_COUNT`` of them (a store and its remote
    tier), none of more than ``MAX_CHUNKS`` chunk objects (a table costs about 150 bytes a chunk,
    so they hold 30 MB at most; a bigger manifest is decoded each time it is learned)."""

    MAX_COUNT = 2
    MAX_CHUNKS = 100_000

    def __init__(self) -> None:
        self._found: OrderedDict[bytes, tuple[CommitRecord, dict[bytes, int]]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, record: CommitRecord) -> dict[bytes, int] | None:
        """The table of ``record``'s manifest, if kept for an equal record."""
        with self._lock:
            found = self._found.get(record.manifest)
            if found is None or found[0] != record:
                return None
            self._found.move_to_end(record.manifest)
            return found[1]

    def put(self, record: CommitRecord, stored: dict[bytes, int]) -> None:
        if len(stored) > self.MAX_CHUNKS:
            return
        with self._lock:
            self._found[record.manifest] = (record, stored)
            while len(self._found) > self.MAX_COUNT:
                self._found.popitem(last=False)


_tables = _Tables()


def _newest(storage: Storage) -> str | None:
    """The checkpoint whose commit record was written last, by the listing's mtimes (ties, and
    backends without mtimes, by name): one listing, no record read."""
    newest: tuple[float, str] | None = None
    for obj in storage.list(_paths.CHECKPOINTS):
        name = _paths.parse_record(obj.path)
        if name is None:
            continue
        key = (obj.mtime if obj.mtime is not None else 0.0, name)
        newest = key if newest is None or key > newest else newest
    return None if newest is None else newest[1]
