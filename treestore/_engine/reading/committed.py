"""What a store has committed: its checkpoint names, their commit records and the manifests those
name, each verified before use (a damaged record or manifest is an error naming its checkpoint)."""

from __future__ import annotations

import difflib
import logging
import threading
from collections import OrderedDict

from treestore._engine.reading.parts import assemble
from treestore._format import paths as _paths
from treestore._format.commit_record import CommitRecord, decode_commit_record
from treestore._format.limits import MAX_MANIFEST_BYTES, MAX_RECORD_BYTES
from treestore._format.manifest.codec import decode_any
from treestore._format.manifest.columns import Columns
from treestore._format.manifest.frame import Frame
from treestore._format.manifest.rules import check_name
from treestore._kernels.digest import digest
from treestore._storage.base import Storage
from treestore.errors import (
    CheckpointNotFoundError,
    DamagedError,
    ManifestDamagedError,
    TreestoreError,
    UnsupportedFormatError,
)

_log = logging.getLogger("treestore")


def read_commit_record(storage: Storage, name: str) -> CommitRecord:
    check_name(name)
    data = storage.read_range(_paths.record_path(name), 0, MAX_RECORD_BYTES + 1)
    if data is None:
        raise not_found(storage, name)
    return decode_commit_record(data, name)


def not_found(storage: Storage, name: str | None) -> CheckpointNotFoundError:
    """The error for a checkpoint ``name`` (None: any checkpoint) that is not in ``storage``, in
    the one wording every reader uses: "no treestore store at URL" when nothing of a store is
    there, else "no checkpoint 'NAME' in store URL (did you mean 'N1'?)" or "no checkpoints in
    store URL". Only this error path lists the store (a listing that fails adds nothing)."""
    if not _is_store(storage):
        wanted = f" (looking for checkpoint {name!r})" if name is not None else ""
        return CheckpointNotFoundError(f"no treestore store at {storage.url}{wanted}", checkpoint=name)
    if name is None:
        return CheckpointNotFoundError(f"no checkpoints in store {storage.url}")
    try:
        names = checkpoint_names(storage)
    except TreestoreError:  # a read-only store that cannot be listed: no suggestions
        names = None
    close = difflib.get_close_matches(name, names or [], n=3, cutoff=0.6)
    hint = f" (did you mean {' or '.join(repr(n) for n in close)}?)" if close else ""
    if names == []:
        hint = " (it has no checkpoints)"
    return CheckpointNotFoundError(f"no checkpoint {name!r} in store {storage.url}{hint}", checkpoint=name)


def _is_store(storage: Storage) -> bool:
    """Whether anything of a store is at ``storage``'s URL; a store that cannot tell (a server
    that answers no folder URL) counts as one."""
    if storage.read_only:
        return True
    try:
        return any(storage.exists(folder) for folder in _paths.FOLDERS)
    except TreestoreError:
        return True


def checkpoint_names(storage: Storage) -> list[str]:
    """Names of the committed checkpoints: objects directly in ``checkpoints/`` whose names are
    valid checkpoint names (anything else there is ignored)."""
    names = {_paths.parse_record(obj.path) for obj in storage.list(_paths.CHECKPOINTS)}
    return sorted(name for name in names if name is not None)


def committed_records(
    storage: Storage,
) -> tuple[list[CommitRecord], dict[str, DamagedError | UnsupportedFormatError]]:
    """The commit records of every checkpoint, and the checkpoints whose record cannot be used:
    name -> the error reading it raised (damaged, or of a format this version cannot read).

    One deleted while listing is in neither. A listing or read that fails raises StorageError.
    """
    records = []
    damaged: dict[str, DamagedError | UnsupportedFormatError] = {}
    for name in checkpoint_names(storage):
        try:
            records.append(read_commit_record(storage, name))
        except CheckpointNotFoundError:
            continue  # deleted since the listing: it needs no protection and no entry
        except (DamagedError, UnsupportedFormatError) as exc:
            damaged[name] = exc
    return records, damaged


def readable_records(storage: Storage) -> list[CommitRecord]:
    """The commit records a listing shows: a damaged one is left out, with a warning (logger
    ``treestore``) naming it, so one bad checkpoint does not hide the others; one of a format
    this version cannot read raises UnsupportedFormatError (upgrade treestore)."""
    records, damaged = committed_records(storage)
    for exc in damaged.values():
        if isinstance(exc, UnsupportedFormatError):
            raise exc
    if damaged:
        _log.warning(
            "%s: %d damaged checkpoint(s) left out (verify names what is wrong; delete them to "
            "let gc free space): %s",
            storage.url,
            len(damaged),
            "; ".join(str(exc) for exc in damaged.values()),
        )
    return records


def newest_record(storage: Storage) -> CommitRecord:
    """The newest readable commit record (see :func:`readable_records`)."""
    records = readable_records(storage)
    if not records:
        raise not_found(storage, None)
    return max(records, key=_paths.commit_order)


def find_record(storage: Storage, name: str | None) -> CommitRecord:
    """The commit record of checkpoint ``name``, or the newest readable one when ``name`` is None."""
    return newest_record(storage) if name is None else read_commit_record(storage, name)


def delete_record(storage: Storage, name: str) -> None:
    """Remove checkpoint ``name`` by its commit record, damaged or not (gc frees the rest)."""
    check_name(name)
    path = _paths.record_path(name)
    if not storage.exists(path):  # a damaged record can still be deleted
        raise not_found(storage, name)
    storage.delete(path)


def read_manifest_bytes(storage: Storage, record: CommitRecord) -> bytes:
    """The manifest a commit record names, after checking its size and digest."""
    path = _paths.manifest_path(record.manifest)
    data = storage.read_range(path, 0, min(record.manifest_size, MAX_MANIFEST_BYTES) + 1)
    if data is None:
        raise ManifestDamagedError(
            f"manifest of checkpoint {record.name!r} is missing from {storage.url}",
            checkpoint=record.name,
        )
    if len(data) != record.manifest_size or digest(data) != record.manifest:
        raise ManifestDamagedError(
            f"manifest of checkpoint {record.name!r} does not match its digest "
            f"({len(data)} bytes read, {record.manifest_size} expected)",
            checkpoint=record.name,
        )
    return data


def read_columns(storage: Storage, record: CommitRecord, data: bytes | None = None) -> Columns:
    """The verified manifest of a commit record, of either format version, as :class:`Columns`:
    what readers that need a few leaves, or whole columns, use (no per-leaf object is made).
    One stored in parts is completed with its parts."""
    found = read_frame(storage, record, data)
    return assemble(storage, found) if isinstance(found, Frame) else found


def read_frame(storage: Storage, record: CommitRecord, data: bytes | None = None) -> Columns | Frame:
    """The verified manifest of a commit record as :func:`read_columns` gives it, except that
    one stored in parts stays its frame (checked against the record; its parts not read): for
    readers of some leaves, which complete it with the parts they need
    (:func:`treestore._engine.reading.parts.assemble`). ``data``: its bytes as
    :func:`read_manifest_bytes` gives them, when the caller has them.

    The bytes are always read and checked against the record's digest; a manifest decoded
    before in this process (same digest, so same bytes) is not decoded and validated again
    (:class:`_Decoded`)."""
    data = data if data is not None else read_manifest_bytes(storage, record)
    found = _decoded.get(record.manifest)
    if found is None:
        found = decode_any(data, record.name)
        _decoded.put(record.manifest, found, len(data))
    if isinstance(found, Frame):
        _described(record, found.columns)
        return found
    return _described(record, found)


class _Decoded:
    """Manifests this process decoded, by digest: a manifest is immutable and named by the
    digest of its bytes, and what decoding makes of it (:class:`Columns`, :class:`Frame`) is
    immutable too, so reopening a checkpoint reuses it. Only manifests of at most
    ``MAX_BYTES`` are kept, at most ``MAX_COUNT`` of them, the least recently used leaving
    first: a training loop's checkpoints come and go without growing it."""

    MAX_COUNT = 32
    MAX_BYTES = 1 << 20

    def __init__(self) -> None:
        self._found: OrderedDict[bytes, Columns | Frame] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: bytes) -> Columns | Frame | None:
        with self._lock:
            found = self._found.get(key)
            if found is not None:
                self._found.move_to_end(key)
            return found

    def put(self, key: bytes, found: Columns | Frame, size: int) -> None:
        if size > self.MAX_BYTES:
            return
        with self._lock:
            self._found[key] = found
            while len(self._found) > self.MAX_COUNT:
                self._found.popitem(last=False)


_decoded = _Decoded()


def _described(record: CommitRecord, manifest: Columns) -> Columns:
    """``manifest``, once the commit record naming it is checked to describe it."""
    differences = manifest.mismatches(record)
    if differences:
        raise ManifestDamagedError(
            f"commit record of checkpoint {record.name!r} does not match its manifest: "
            + "; ".join(differences),
            checkpoint=record.name,
        )
    return manifest
