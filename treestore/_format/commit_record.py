"""Commit records: the small object ``checkpoints/NAME`` whose existence makes a checkpoint visible
(SPEC.md, section 5.1). Its ``check`` digest covers every field but ``format`` and ``version``, so
a damaged record is caught by a listing without reading manifests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from treestore._format.encoding import DIGEST_BYTES, FORMAT_VERSION, from_msgpack, to_msgpack
from treestore._format.encoding import Bad as _Bad
from treestore._format.encoding import check_version as _check_version
from treestore._format.encoding import count as _count
from treestore._format.encoding import field as _get
from treestore._format.limits import MAX_MANIFEST_BYTES, MAX_RECORD_BYTES
from treestore._kernels.digest import digest
from treestore.errors import ManifestDamagedError

RECORD_MAGIC = "treestore.checkpoint"


@dataclass(frozen=True)
class CommitRecord:
    """The small commit record that makes a checkpoint visible."""

    name: str
    manifest: bytes  # digest of the manifest's bytes
    manifest_size: int
    created: float
    metadata: Any = None
    leaves: int = 0
    nbytes: int = 0
    version: int = FORMAT_VERSION


def _record_check(r: CommitRecord) -> bytes:
    """The digest that covers every field of a commit record (its ``check`` field)."""
    return digest(
        to_msgpack([r.name, r.manifest, r.manifest_size, r.created, r.metadata, r.leaves, r.nbytes])
    )


def encode_commit_record(r: CommitRecord) -> bytes:
    return to_msgpack(
        {
            "format": RECORD_MAGIC,
            "version": r.version,
            "name": r.name,
            "manifest": r.manifest,
            "manifest_size": r.manifest_size,
            "created": r.created,
            "metadata": r.metadata,
            "leaves": r.leaves,
            "nbytes": r.nbytes,
            "check": _record_check(r),
        }
    )


def decode_commit_record(data: bytes, name: str) -> CommitRecord:
    what = f"commit record of checkpoint {name!r}"
    if len(data) > MAX_RECORD_BYTES:
        raise ManifestDamagedError(f"{what} is {len(data)} bytes, over its limit", checkpoint=name)
    rec = from_msgpack(data, what, name)
    version = _check_version(rec, RECORD_MAGIC, what, name)
    try:
        if _get(rec, "name", str) != name:
            raise _Bad(f"names checkpoint {rec['name']!r}")
        manifest = _get(rec, "manifest", bytes)
        if len(manifest) != DIGEST_BYTES:
            raise _Bad("manifest digest has the wrong length")
        record = CommitRecord(
            name=name,
            manifest=manifest,
            manifest_size=_count(rec.get("manifest_size"), "manifest_size", MAX_MANIFEST_BYTES),
            created=_get(rec, "created", float),
            metadata=rec.get("metadata"),
            leaves=_count(rec.get("leaves"), "leaves"),
            nbytes=_count(rec.get("nbytes"), "nbytes"),
            version=version,
        )
        if _get(rec, "check", bytes) != _record_check(record):
            raise _Bad("its fields do not match its check digest")
        return record
    except _Bad as exc:
        raise ManifestDamagedError(f"{what}: {exc}", checkpoint=name) from None
