"""Hostile version-2 (columnar) manifests in a store: every reader refuses them with a
TreestoreError naming the checkpoint, under the guards of the other attack tests, and gc deletes
nothing while one cannot be read. (The version-1 layout is attacked by the other files, through
tests/support/hostile.py; tests/format/test_columns.py fuzzes the decoder itself.)"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

import treestore
from treestore._format import paths as _paths
from treestore._format.manifest.columns import CHUNK_DTYPE, LEAF_DTYPE

from ..support import hostile


def _raw(store: Any, name: str = "bad") -> dict[str, Any]:
    ref = hostile.commit_record(store.url, name)
    data = store.storage.read(_paths.manifest_path(ref["manifest"]))
    rec = msgpack.unpackb(data, raw=False)
    assert rec["version"] == 2  # what save writes
    return rec


def _rewrite(store: Any, rec: dict[str, Any], name: str = "bad") -> None:
    hostile.write_manifest(store.url, name, rec, leaves=hostile.commit_record(store.url, name)["leaves"])


def _set(table: str, dtype: np.dtype, field: str, value: Any, row: int = 0):
    def change(rec: dict[str, Any]) -> None:
        rows = np.frombuffer(rec[table], dtype).copy()
        rows[field][row] = value
        rec[table] = rows.tobytes()

    return change


CASES = {
    "truncated leaves": lambda r: r.update(leaves=r["leaves"][:-1]),
    "truncated chunks": lambda r: r.update(chunks=r["chunks"][:-3]),
    "leaves not bin": lambda r: r.update(leaves=list(r["leaves"])),
    "parts not empty": lambda r: r.update(parts=[{"manifest": b"\0" * 32}]),
    "unsupported leaf kind": _set("leaves", LEAF_DTYPE, "kind", 200),
    "unsupported dtype": _set("leaves", LEAF_DTYPE, "dtype", 250),
    "reserved flag bits": _set("leaves", LEAF_DTYPE, "flags", 0xF0),
    "too many chunks": _set("leaves", LEAF_DTYPE, "chunks", 2**32 - 1),
    "huge ndim": _set("leaves", LEAF_DTYPE, "ndim", 255),
    "raw size over the limit": _set("chunks", CHUNK_DTYPE, "raw", 2**32 - 1),
    "pack index out of range": _set("chunks", CHUNK_DTYPE, "pack", 10**6),
    "huge dimension": lambda r: r.update(shapes=np.full(len(r["shapes"]) // 8, 2**63, "<u8").tobytes()),
    "bad segment": lambda r: r.update(segments=["../..", *r["segments"][1:]]),
    "node parent out of range": lambda r: r.update(nodes=b"\xff" * len(r["nodes"])),
    "node leaves out of range": lambda r: r.update(node_leaves=b"\xff" * len(r["node_leaves"])),
    "missing values": lambda r: r.update(values=[]),
    "missing field": lambda r: r.pop("segments"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_columns_are_refused(store, case):
    rec = _raw(store)
    CASES[case](rec)
    _rewrite(store, rec)
    out = store.check(ops=["load", "open", "verify"])
    err = out["load"].error
    assert isinstance(err, (treestore.errors.ManifestDamagedError, treestore.UnsupportedFormatError)), (
        case,
        err,
    )
    assert "'bad'" in str(err), err
    assert not out["verify"].value.ok


@pytest.mark.timeout(60)
def test_gc_deletes_nothing_while_a_columnar_manifest_is_bad(store):
    rec = _raw(store)
    rec["chunks"] = rec["chunks"][:-1]
    _rewrite(store, rec)
    before = {p for p in store.root.rglob("*") if p.is_file()}
    report = treestore.Store(store.url).gc(grace=0)
    assert report.damaged == ("bad",)
    assert (report.chunks_removed, report.manifests_removed, report.bytes_freed) == (0, 0, 0)
    assert {p for p in store.root.rglob("*") if p.is_file()} == before
