"""Tools to damage a store the way a hostile or broken one would, for the attack tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import blake3
import msgpack
import numpy as np

import treestore
from treestore._format import paths as _paths
from treestore._format.manifest.codec import decode_any, encode
from treestore._format.manifest.columns import ARRAY_FIELDS


def storage(url: str):
    return treestore.Store(url)._storage


def commit_record(url: str, name: str) -> dict[str, Any]:
    return msgpack.unpackb(storage(url).read(_paths.record_path(name)), raw=False)


def manifest_record(url: str, name: str) -> dict[str, Any]:
    """The manifest of ``name`` as a version-1 record (a version-2 manifest is converted, so the
    version-1 tests below damage the version-1 layout, which every reader still accepts)."""
    ref = commit_record(url, name)
    data = storage(url).read(_paths.manifest_path(ref["manifest"]))
    rec = msgpack.unpackb(data, raw=False)
    if rec.get("version") == 2:
        rec = msgpack.unpackb(encode(decode_any(data, name), 1), raw=False)
    return rec


def write_manifest(
    url: str, name: str, manifest: Any, *, raw: bytes | None = None, **ref_changes: Any
) -> None:
    """Replace the manifest of ``name`` with ``manifest`` (or the bytes ``raw``), keeping the commit
    record consistent with it, as a hostile store would."""
    data = raw if raw is not None else msgpack.packb(manifest, use_bin_type=True)
    d = blake3.blake3(data).digest()
    s = storage(url)
    s.write(_paths.manifest_path(d), [data])
    ref = commit_record(url, name)
    ref.update(manifest=d, manifest_size=len(data))
    ref.update(summary(manifest))
    ref.update(ref_changes)
    write_commit_record(url, name, ref)


def summary(manifest: Any) -> dict[str, Any]:
    """The commit-record fields a consistent record copies from its manifest (best effort: a
    hostile manifest may not have them)."""
    out: dict[str, Any] = {}
    if not isinstance(manifest, dict):
        return out
    for field in ("name", "created", "metadata"):
        if field in manifest:
            out[field] = manifest[field]
    leaves = manifest.get("leaves")
    if isinstance(leaves, list):
        out["leaves"] = len(leaves)
        total = 0
        try:
            for leaf in leaves:
                chunks = leaf.get("chunks") or [c for p in leaf.get("pieces") or [] for c in p[2]]
                total += sum(int(c[1]) for c in chunks)
            if total < 2**64:  # a hostile manifest may declare more than a record can hold
                out["nbytes"] = total
        except Exception:
            pass
    return out


CHECKED = ("name", "manifest", "manifest_size", "created", "metadata", "leaves", "nbytes")


def seal(ref: dict[str, Any]) -> dict[str, Any]:
    """``ref`` with the check digest its fields call for (SPEC.md §5.1), as a hostile store can
    compute: a test that changes a field and seals the record reaches the checks behind it."""
    fields = [ref.get(k) for k in CHECKED]
    return dict(ref, check=blake3.blake3(msgpack.packb(fields, use_bin_type=True)).digest())


def write_commit_record(url: str, name: str, ref: dict[str, Any]) -> None:
    """Write a commit record with a consistent check digest, as a hostile store would."""
    storage(url).write(_paths.record_path(name), [msgpack.packb(seal(ref), use_bin_type=True)])


def mutate_manifest(url: str, name: str, change: Callable[[dict[str, Any]], None]) -> None:
    rec = manifest_record(url, name)
    change(rec)
    write_manifest(url, name, rec)


def mutate_v2_manifest(
    url: str, name: str, change: Callable[[dict[str, Any], dict[str, np.ndarray]], None]
) -> None:
    """Edit the version-2 manifest of ``name`` in place: ``change`` gets its decoded record and
    its array fields as writable arrays (written back after), and the commit record is made
    consistent with the result, as a hostile store would."""
    ref = commit_record(url, name)
    rec = msgpack.unpackb(storage(url).read(_paths.manifest_path(ref["manifest"])), raw=False)
    assert rec["version"] == 2, rec["version"]
    arrays = {k: np.frombuffer(rec[k], dtype).copy() for k, dtype in ARRAY_FIELDS.items() if k in rec}
    change(rec, arrays)
    for k, a in arrays.items():
        rec[k] = a.tobytes()
    write_manifest(url, name, rec, leaves=ref["leaves"])


def chunk_paths(url: str, name: str) -> dict[str, list[str]]:
    """Chunk object paths of each leaf address (pack objects under the key '<pack N>')."""
    m = treestore.Store(url).manifest(name)
    out: dict[str, list[str]] = {}
    for leaf in m.leaves:
        out[leaf.address] = [_paths.chunk_path(c.digest) for c in leaf.chunks if c.pack is None]
    for i, p in enumerate(m.packs):
        out[f"<pack {i}>"] = [_paths.chunk_path(p.digest)]
    return out


def damage_manifest(url: str, name: str) -> None:
    """Overwrite the manifest of ``name`` with garbage, its commit record left intact."""
    storage(url).write(_paths.manifest_path(commit_record(url, name)["manifest"]), [b"damaged"])


def damage_stats(url: str, name: str) -> None:
    """Replace the statistics column of ``name``'s (version-2) manifest with bytes of the wrong
    size, the rest intact: a reader ignores the column, so the checkpoint's health is unknown."""
    mutate_v2_manifest(url, name, lambda rec, arrays: rec.update(stats=b"\x00" * 48))


def flip_byte(url: str, path: str, at: int) -> None:
    s = storage(url)
    data = bytearray(s.read(path))
    data[at % len(data)] ^= 0xFF
    s.write(path, [bytes(data)])


def truncate(url: str, path: str, keep: int) -> None:
    s = storage(url)
    data = s.read(path)
    s.write(path, [data[:keep]])


def set_leaf(target: str, /, **fields: Any) -> Callable[[dict[str, Any]], None]:
    """A manifest change (for :func:`mutate_manifest`) that sets ``fields`` (``address`` too) on
    the leaf entry whose address is ``target``."""

    def change(m: dict[str, Any]) -> None:
        for leaf in m["leaves"]:
            if leaf["address"] == target:
                leaf.update(fields)

    return change
