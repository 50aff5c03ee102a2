"""The one commit (SPEC.md, "Commit protocol"): every chunk durable, then the manifest, then the
commit record, each made durable before the next. Saves, copies and imports all commit here."""

from __future__ import annotations

from treestore._format import paths
from treestore._format.commit_record import CommitRecord, decode_commit_record, encode_commit_record
from treestore._format.encoding import FORMAT_VERSION
from treestore._format.manifest.columns import Columns
from treestore._kernels.digest import digest
from treestore._storage.base import Storage
from treestore.errors import CheckpointExistsError


def commit(
    storage: Storage, manifest: bytes, columns: Columns, *, overwrite: bool, version: int = FORMAT_VERSION
) -> CommitRecord:
    """Make checkpoint ``columns.name`` visible with ``manifest`` (its encoded bytes).

    The chunks the manifest references must already be written. The commit record is built
    here from the manifest it commits: its name, creation time, metadata, leaf count and raw
    bytes from ``columns`` (the decoded manifest, or the frame of one stored in parts), its digest and
    size from ``manifest``; ``version``: the record's format version (a copy keeps its source's).
    Without ``overwrite`` the commit record is put-if-absent, and a checkpoint of that name
    committed by another writer meanwhile raises CheckpointExistsError. Returns the record as
    committed, as readers decode it (a tuple in its metadata is a list there).
    """
    storage.sync()  # chunks before the manifest
    mdigest = digest(manifest)
    path = paths.manifest_path(mdigest)
    if storage.read_range(path, 0, len(manifest) + 1) != manifest:  # absent, or not what its name says
        storage.write(path, [manifest])
    storage.sync()  # the manifest before the record
    record = CommitRecord(
        columns.name,
        mdigest,
        len(manifest),
        columns.created,
        columns.metadata,
        len(columns),
        columns.nbytes,
        version,
    )
    data = encode_commit_record(record)
    if overwrite:
        storage.write(paths.record_path(record.name), [data])
    elif not storage.write_new(paths.record_path(record.name), data):
        raise CheckpointExistsError(
            f"checkpoint {record.name!r} was committed in {storage.url} by another writer meanwhile",
            checkpoint=record.name,
        )
    storage.sync()
    return decode_commit_record(data, record.name)
