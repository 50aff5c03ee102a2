"""Wrong types and values in every field of a manifest and a commit record.

Each case replaces one field (or deletes it) with each of a set of wrong values, keeping the commit
record consistent with the manifest (size and digest), as a hostile store would, and runs the
readers under the guards of _harness.py: a TreestoreError, or success, and nothing else.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest

import treestore

from ._harness import check_readers

DELETE = object()
SIZES: list[Any] = [-1, 2**63 - 1, 2**64 - 1, -(2**63)]  # checked with a memory bound
WRONG: list[Any] = [
    DELETE,
    None,
    True,
    0,
    *SIZES,
    1.5,
    math.nan,
    "",
    "../../outside/secret.txt",
    "\x00",
    b"",
    bytes(32),
    [],
    [None],
    [0, 0, 0],
    {},
    msgpack.ExtType(42, b"x"),
]
LEAVES = ["w", "small/a", "small/s", "key", "py/c", "py/big", "empty"]
LEAF_FIELDS = ["address", "kind", "dtype", "shape", "chunks", "prng_impl", "value", "pieces", "weak_type"]

# A path into the manifest record. ("leaf", ADDRESS, ...) starts at that leaf's entry, ("node",
# ADDRESS, ...) at the tree node of that address; the rest are keys and indices.
MANIFEST_PATHS: list[tuple[Any, ...]] = [
    *[(k,) for k in ("format", "version", "name", "created", "metadata", "codec", "chunk_size")],
    *[(k,) for k in ("tree", "packs", "leaves", "unknown-field")],
    ("codec", "name"),
    ("codec", "level"),
    *[("leaf", a, f) for a in LEAVES for f in LEAF_FIELDS],
    *[("leaf", "w", "chunks", 0, i) for i in range(3)],
    *[("leaf", "w", "chunks", 1, i) for i in range(3)],
    *[("leaf", "small/a", "chunks", 0, i) for i in range(5)],
    ("leaf", "w", "shape", 0),
    ("leaf", "w", "shape", 1),
    ("leaf", "py/c", "value", 0),
    *[("packs", 0, i) for i in range(3)],
    ("packs", 0),
    ("leaves", 0),
    *[("leaf", "sharded", "pieces", 0, i) for i in range(3)],
    ("leaf", "sharded", "pieces", 0, 0, 0),
    ("leaf", "sharded", "pieces", 0, 2, 0),
    *[("node", "", f) for f in ("type", "keys", "children")],
    ("node", "", "keys", 0),
    ("node", "", "keys", 0, 0),
    ("node", "", "keys", 0, 1),
    ("node", "", "children", 0),
    *[("node", "list", f) for f in ("type", "children")],
    ("node", "list/1", "type"),
    ("node", "list/2", "type"),
    ("node", "small", "keys", 1, 1),
    *[("node", "w", f) for f in ("type", "leaf")],
]
REF_PATHS = [
    "format",
    "version",
    "name",
    "manifest",
    "manifest_size",
    "created",
    "metadata",
    "leaves",
    "nbytes",
    "unknown-field",
]


def _node(rec: dict[str, Any], address: str) -> dict[str, Any]:
    node = rec["tree"]
    for segment in address.split("/") if address else []:
        if node["type"] in ("list", "tuple"):
            node = node["children"][int(segment)]
        else:
            keys = [k[1] for k in node["keys"]]
            node = node["children"][keys.index(segment)]
    return node


def _resolve(rec: dict[str, Any], path: tuple[Any, ...]) -> tuple[Any, Any] | None:
    """(container, key) of the field ``path`` names, or None when the store has no such field."""
    head, rest = path[0], list(path[1:])
    if head == "leaf":
        found = [leaf for leaf in rec["leaves"] if leaf["address"] == rest[0]]
        if not found:
            return None
        obj: Any = found[0]
        rest = rest[1:]
    elif head == "node":
        obj = _node(rec, rest[0])
        rest = rest[1:]
    else:
        obj, rest = rec, [head, *rest]
    for key in rest[:-1]:
        try:
            obj = obj[key]
        except (KeyError, IndexError, TypeError):
            return None
    last = rest[-1]
    if isinstance(obj, list) and not (isinstance(last, int) and last < len(obj)):
        return None
    return obj, last


def _set(container: Any, key: Any, value: Any) -> None:
    if value is DELETE:
        if isinstance(container, dict):
            container.pop(key, None)
        else:
            del container[key]
    else:
        container[key] = value


def _memory(value: Any) -> int | None:
    return 64 * 2**20 if any(value is v for v in SIZES) else None


def _label(value: Any) -> str:
    return "DELETE" if value is DELETE else repr(value)[:40]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", MANIFEST_PATHS, ids=lambda p: "/".join(map(str, p)))
def test_wrong_value_in_manifest_field(store, path):
    original = store.ref_bytes()
    if _resolve(store.manifest_record(), path) is None and path[-1] not in ("pieces", "unknown-field"):
        return  # this store has no such field (no sharded leaf without four jax devices)
    failures = []
    for value in WRONG:
        rec = store.manifest_record()
        where = _resolve(rec, path)
        if where is None:  # a new field
            if path[0] == "leaf":
                where = (next(x for x in rec["leaves"] if x["address"] == path[1]), path[-1])
            else:
                where = (rec, path[-1])
        _set(*where, value)
        store.write_manifest(rec)
        try:
            check_readers(store.url, root=store.root, ops=["load", "verify"], memory=_memory(value))
        except AssertionError as exc:
            failures.append(f"{_label(value)}: {exc}")
        finally:
            store.write_ref(raw=original)
    assert store.untouched()
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("field", "value"),
    [("name", "good"), ("created", 1.0), ("metadata", {"v": 9}), ("leaves", 1), ("nbytes", 0)],
)
def test_commit_record_changed_without_its_check(store, field, value):
    """A field covered by ``check`` changed, ``check`` left as it was: a listing (which reads no
    manifest, so only ``check`` can tell) leaves the record out, and a load refuses it."""
    rec = {**store.ref_record(), field: value}
    store.write_ref(raw=msgpack.packb(rec, use_bin_type=True))
    out = check_readers(store.url, root=store.root, ops=["list", "load", "verify all"])
    assert [c.name for c in out["list"].value] == ["good"]
    assert isinstance(out["load"].error, treestore.errors.ManifestDamagedError)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("field", REF_PATHS)
def test_wrong_value_in_commit_record_field(store, field):
    original = store.ref_bytes()
    failures = []
    for value in WRONG:
        rec = store.ref_record()
        _set(rec, field, value)
        store.write_ref(rec)
        try:
            check_readers(
                store.url, root=store.root, ops=["list", "load", "verify all"], memory=_memory(value)
            )
        except AssertionError as exc:
            failures.append(f"{_label(value)}: {exc}")
        finally:
            store.write_ref(raw=original)
    assert store.untouched()
    assert not failures, "\n".join(failures)
