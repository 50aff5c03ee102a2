"""Commit records: the small object ``checkpoints/NAME`` whose existence makes a checkpoint visible
(SPEC.md, section 6). Its ``check`` digest covers every field, so a damaged record is caught by a
listing without reading manifests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._errors import ManifestCorruptError
from ._schema import DIGEST_BYTES, FORMAT_VERSION, digest
from ._schema import Bad as _Bad
from ._schema import check_version as _check_version
from ._schema import count as _count
from ._schema import field as _get
from ._schema import pack as _pack
from ._schema import unpack as _unpack

REF_MAGIC = "treestore.checkpoint"
MAX_REF_BYTES = 2 * 2**20
MAX_MANIFEST_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Ref:
    """The small commit record that makes a checkpoint visible."""

    name: str
    manifest: bytes  # digest of the manifest's bytes
    manifest_size: int
    created: float
    metadata: Any = None
    leaves: int = 0
    nbytes: int = 0
    version: int = FORMAT_VERSION


def _ref_check(r: Ref) -> bytes:
    """The digest that covers every field of a commit record (its ``check`` field)."""
    return digest(_pack([r.name, r.manifest, r.manifest_size, r.created, r.metadata, r.leaves, r.nbytes]))


def encode_ref(r: Ref) -> bytes:
    return _pack(
        {
            "format": REF_MAGIC,
            "version": r.version,
            "name": r.name,
            "manifest": r.manifest,
            "manifest_size": r.manifest_size,
            "created": r.created,
            "metadata": r.metadata,
            "leaves": r.leaves,
            "nbytes": r.nbytes,
            "check": _ref_check(r),
        }
    )


def decode_ref(data: bytes, name: str) -> Ref:
    what = f"commit record of checkpoint {name!r}"
    if len(data) > MAX_REF_BYTES:
        raise ManifestCorruptError(f"{what} is {len(data)} bytes, over its limit", checkpoint=name)
    rec = _unpack(data, what, name)
    version = _check_version(rec, REF_MAGIC, what, name)
    try:
        if _get(rec, "name", str) != name:
            raise _Bad(f"names checkpoint {rec['name']!r}")
        manifest = _get(rec, "manifest", bytes)
        if len(manifest) != DIGEST_BYTES:
            raise _Bad("manifest digest has the wrong length")
        ref = Ref(
            name=name,
            manifest=manifest,
            manifest_size=_count(rec.get("manifest_size"), "manifest_size", MAX_MANIFEST_BYTES),
            created=_get(rec, "created", float),
            metadata=rec.get("metadata"),
            leaves=_count(rec.get("leaves"), "leaves"),
            nbytes=_count(rec.get("nbytes"), "nbytes"),
            version=version,
        )
        if _get(rec, "check", bytes) != _ref_check(ref):
            raise _Bad("its fields do not match its check digest")
        return ref
    except _Bad as exc:
        raise ManifestCorruptError(f"{what}: {exc}", checkpoint=name) from None
