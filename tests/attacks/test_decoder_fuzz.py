"""Property-based fuzzing of every decoder a store's bytes pass through.

Arbitrary bytes, arbitrary msgpack, and valid records with one field replaced by an arbitrary
value: the decoders (manifest, commit record, chunk objects, addresses, key records, lock records)
raise a TreestoreError subclass or succeed, and a full load of a fuzzed manifest does the same.

Each fuzzer must reach the validation it claims to fuzz: records past the envelope (format and
version) are generated as maps that pass it, and a fuzzed manifest is committed with a commit
record whose ``check`` is recomputed, so a load gets past the record to the manifest. Each test
asserts that it got there.
"""

from __future__ import annotations

import contextlib
import functools
import os
import struct
import tempfile
import time
import uuid
from typing import Any

import msgpack
import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import treestore
from treestore._engine.locks import STALE_AFTER
from treestore._engine.reading.read import decode_chunk
from treestore._format import codecs as _codecs
from treestore._format import paths as _paths
from treestore._format.address import canonical_segment, format_address, key_from_record, parse_address
from treestore._format.commit_record import RECORD_MAGIC, decode_commit_record
from treestore._format.encoding import FORMAT_VERSION, check_version, from_msgpack
from treestore._format.manifest.codec import decode_any as decode_manifest  # the reader's entry point
from treestore._format.manifest.records import ChunkRef
from treestore._format.manifest.rules import MANIFEST_MAGIC
from treestore._format.manifest.v1 import VERSION as V1

from .. import strategies
from ..support import hostile

pytestmark = pytest.mark.timeout(120)

FAST = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
SLOW = settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))

values = strategies.trees(
    strategies.scalars(ints=st.integers(-(2**63), 2**64 - 1), complex_numbers=False, max_size=40)
    | st.sampled_from([2**48, 2**62, 256 * 2**20, 0, 1, -1])
    | st.sampled_from(["leaf", "dict", "list", "seq", "float32", "uint8", "numpy", "jax", "prng_key"]),
    keys=st.text(max_size=8),
    containers=("list", "dict"),
    max_size=5,
    max_leaves=12,
)
ALLOWED = (treestore.errors.ManifestDamagedError, treestore.UnsupportedFormatError)
MANIFEST_FIELDS = ["name", "created", "metadata", "codec", "chunk_size", "tree", "packs", "leaves"]
RECORD_FIELDS = ["name", "manifest", "manifest_size", "created", "metadata", "leaves", "nbytes", "check"]


def enveloped(magic: str, fields: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """msgpack maps that pass the envelope of a record (its format and version), with arbitrary
    values in some of the record's fields (and in the odd unknown one)."""
    return st.dictionaries(st.sampled_from(fields) | st.text(max_size=6), values, max_size=len(fields)).map(
        lambda d: {**d, "format": magic, "version": _version(magic)}
    )


def _version(magic: str) -> int:
    """The version whose layout the fields fuzzed here are: version 1 for manifests (sample()
    converts the manifest save writes to that layout; tests/format/test_columns.py fuzzes version 2)."""
    return V1 if magic == MANIFEST_MAGIC else FORMAT_VERSION


def past_envelope(data: bytes, magic: str) -> None:
    """Assert that ``data`` passes the envelope, so what a decoder says of it comes from the
    validation behind it."""
    check_version(from_msgpack(data, "fuzzed record", "c"), magic, "fuzzed record", "c")


@functools.cache
def sample() -> tuple[str, dict[str, Any], dict[str, Any], bytes]:
    """A memory store with one checkpoint; its manifest record, commit record and one chunk."""
    url = f"memory://fuzz/{uuid.uuid4().hex}"
    tree = {
        "w": np.linspace(0, 1, 30_000, dtype=np.float32),
        "i": np.arange(20_000, dtype=np.int64),
        "small": [np.arange(3), np.float16(2.5), {"k": np.ones(2, np.uint8)}],
        "py": {"n": 1, "s": "x", "c": 1j, "b": b"\x00", "t": (None, 2.5)},
    }
    treestore.Store(url).save(
        tree, "c", options=treestore.SaveOptions(chunk_size=64 * 1024, small_leaf=8 * 1024)
    )
    m = treestore.Store(url).manifest("c")
    chunk = hostile.storage(url).read(
        _paths.chunk_path(m.leaves[[e.address for e in m.leaves].index("w")].chunks[0].digest)
    )
    return url, hostile.manifest_record(url, "c"), hostile.commit_record(url, "c"), chunk


def _field_paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _field_paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _field_paths(v, (*prefix, i))
    return out


def _replace(rec: Any, path: tuple[Any, ...], value: Any) -> Any:
    rec = msgpack.unpackb(msgpack.packb(rec, use_bin_type=True), raw=False)  # a deep copy
    obj = rec
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value
    return rec


def _decodes(decode: Any, data: bytes) -> None:
    """``decode`` accepts ``data`` or refuses it from one of its checks: the decoder's net for an
    exception a check missed ("unexpected malformation") is never what refuses it."""
    try:
        decode(data, "c")
    except ALLOWED as exc:
        assert "unexpected malformation" not in str(exc), exc


def _changed(data: bytes, changes: list[tuple[int, int]], keep: int) -> bytes:
    """``data`` with bytes set at some offsets at or after ``keep``."""
    out = bytearray(data)
    for at, b in changes:
        if len(out) > keep:
            out[keep + at % (len(out) - keep)] = b
    return bytes(out)


_changes = st.lists(st.tuples(st.integers(0, 2**16), st.integers(0, 255)), max_size=3)


# --- arbitrary bytes and msgpack --------------------------------------------------------------------
@FAST
@given(st.binary(max_size=300))
def test_decode_manifest_of_arbitrary_bytes(data):
    """Arbitrary bytes: the msgpack and envelope checks (the next tests go past them)."""
    _decodes(decode_manifest, data)


@FAST
@given(st.binary(max_size=300))
def test_decode_ref_of_arbitrary_bytes(data):
    _decodes(decode_commit_record, data)


@FAST
@given(st.data())
def test_decode_real_records_with_bytes_changed(data):
    """The bytes of the real manifest and commit record, a few changed after the envelope (the
    first map entries, format and version, are left alone)."""
    _, manifest, ref, _ = sample()
    for decode, rec, magic in (
        (decode_manifest, manifest, MANIFEST_MAGIC),
        (decode_commit_record, ref, RECORD_MAGIC),
    ):
        head = {"format": magic, "version": _version(magic)}
        blob = msgpack.packb({**head, **rec}, use_bin_type=True)
        keep = len(msgpack.packb(head, use_bin_type=True))
        changes = data.draw(_changes, label="changes")
        _decodes(decode, _changed(blob, changes, keep))


@FAST
@given(enveloped(MANIFEST_MAGIC, MANIFEST_FIELDS))
def test_decode_manifest_of_arbitrary_msgpack(value):
    data = msgpack.packb(value, use_bin_type=True)
    past_envelope(data, MANIFEST_MAGIC)
    _decodes(decode_manifest, data)


@FAST
@given(enveloped(RECORD_MAGIC, RECORD_FIELDS))
def test_decode_commit_record_of_arbitrary_msgpack(value):
    data = msgpack.packb(value, use_bin_type=True)
    past_envelope(data, RECORD_MAGIC)
    _decodes(decode_commit_record, data)


@FAST
@given(values)
def test_decoders_of_arbitrary_msgpack(value):
    """Any msgpack at all; then the same value as each field in turn of the real manifest and
    of the real commit record (sealed again), so every field's validation sees it."""
    data = msgpack.packb(value, use_bin_type=True)
    _decodes(decode_manifest, data)
    _decodes(decode_commit_record, data)
    _, manifest, ref, _ = sample()
    for field in MANIFEST_FIELDS:
        data = msgpack.packb({**manifest, field: value}, use_bin_type=True)
        past_envelope(data, MANIFEST_MAGIC)
        _decodes(decode_manifest, data)
    for field in RECORD_FIELDS:
        rec = {**ref, field: value}
        data = msgpack.packb(rec if field == "check" else hostile.seal(rec), use_bin_type=True)
        past_envelope(data, RECORD_MAGIC)
        _decodes(decode_commit_record, data)


@FAST
@given(st.data())
def test_manifest_with_one_field_replaced(data):
    _, manifest, _, _ = sample()
    path = data.draw(st.sampled_from(_field_paths(manifest)), label="path")
    value = data.draw(values, label="value")
    blob = msgpack.packb(_replace(manifest, path, value), use_bin_type=True)
    if path[0] not in ("format", "version"):
        past_envelope(blob, MANIFEST_MAGIC)
    _decodes(decode_manifest, blob)


@FAST
@given(st.data())
def test_commit_record_with_one_field_replaced(data):
    """One field replaced, and the record sealed again (its ``check`` recomputed, unless the
    field is ``check`` itself): the decoder's checks of every field, not the check digest, must
    catch it; what it accepts it returns as stored."""
    _, _, ref, _ = sample()
    path = data.draw(st.sampled_from(_field_paths(ref)), label="path")
    value = data.draw(values, label="value")
    rec = _replace(ref, path, value)
    if path[0] != "check":
        rec = hostile.seal(rec)
    blob = msgpack.packb(rec, use_bin_type=True)
    try:
        got = decode_commit_record(blob, "c")
    except ALLOWED as exc:
        assert path[0] == "check" or "check digest" not in str(exc), exc
        return
    for field in hostile.CHECKED:
        assert msgpack.packb(getattr(got, field)) == msgpack.packb(rec[field]), field


def commit(url: str, name: str, manifest: Any, ref: dict[str, Any]) -> None:
    """Commit ``manifest`` (a record) as checkpoint ``name``, with a commit record that readers
    accept: sealed, and consistent with the manifest where the manifest allows."""
    blob = msgpack.packb(manifest, use_bin_type=True)
    digest = treestore._format.manifest.rules.digest(blob)
    storage = hostile.storage(url)
    storage.write(_paths.manifest_path(digest), [blob])

    def sealed(rec: dict[str, Any]) -> bytes:
        return msgpack.packb(hostile.seal(rec), use_bin_type=True)

    rec = {**ref, "name": name, "manifest": digest, "manifest_size": len(blob)}
    for field, value in hostile.summary(manifest).items():  # what a valid record can copy
        with contextlib.suppress(*ALLOWED, TypeError, ValueError, OverflowError):
            decode_commit_record(sealed({**rec, field: value, "name": name}), name)
            rec[field] = value
    rec["name"] = name
    data = sealed(rec)
    decode_commit_record(data, name)  # the load gets past the commit record to the manifest
    storage.write(_paths.record_path(name), [data])


def _read_everything(url: str, name: str) -> None:
    for fn in (
        lambda: treestore.load(url, name),
        lambda: [np.asarray(x) for x in treestore.open(url, name).leaves.values()],
        lambda: treestore.verify(f"{url}#{name}"),
    ):
        with contextlib.suppress(treestore.TreestoreError):
            fn()


def test_the_load_fuzzer_reaches_the_manifest():
    """The committing helper of the next test, on the unmodified manifest: the checkpoint loads
    (a helper whose records readers refuse would let the fuzzer test nothing)."""
    url, manifest, ref, _ = sample()
    commit(url, "unmodified", {**manifest, "name": "unmodified"}, ref)
    try:
        got = treestore.load(url, "unmodified")
        assert np.array_equal(got["w"], np.linspace(0, 1, 30_000, dtype=np.float32))
        assert not treestore.verify(f"{url}#unmodified").problems
    finally:
        hostile.storage(url).delete(_paths.record_path("unmodified"))


@SLOW
@given(st.data())
def test_load_of_a_manifest_with_one_field_replaced(data):
    """The whole read path, not just the decoder: only TreestoreError escapes a load."""
    url, manifest, ref, _ = sample()
    path = data.draw(st.sampled_from(_field_paths(manifest)), label="path")
    value = data.draw(values, label="value")
    name = f"f{uuid.uuid4().hex[:12]}"
    commit(url, name, {**_replace(manifest, path, value), "name": name}, ref)
    try:
        _read_everything(url, name)
    finally:
        hostile.storage(url).delete(_paths.record_path(name))


# --- chunk objects ----------------------------------------------------------------------------------
def _decode_chunk(obj: bytes, size: int) -> None:
    out = np.empty(size, np.uint8)
    with contextlib.suppress(treestore.errors.ChunkDamagedError, treestore.UnsupportedFormatError):
        _codecs.decode_into(obj, out)


@FAST
@given(st.binary(max_size=200), st.integers(0, 4096))
def test_decode_chunk_of_arbitrary_bytes(obj, size):
    _decode_chunk(obj, size)


@FAST
@given(
    codec=st.integers(0, 255),
    width=st.integers(0, 255),
    mask=st.integers(0, 2**16 - 1),
    declared=st.sampled_from([0, 1, 7, 64, 4096, 2**32, 2**64 - 1]),
    body=st.binary(max_size=200),
    size=st.sampled_from([0, 1, 7, 64, 4096]),
)
def test_decode_chunk_with_arbitrary_header(codec, width, mask, declared, body, size):
    _decode_chunk(_codecs.HEADER.pack(_codecs.MAGIC, codec, width, mask, declared) + body, size)


@FAST
@given(st.data())
def test_decode_chunk_with_plane_table_and_frames_that_lie(data):
    width = data.draw(st.integers(2, 8))
    n = width * data.draw(st.integers(0, 64))
    raw = data.draw(st.binary(min_size=n, max_size=n))
    planes = [raw[j::width] for j in range(width)]
    parts = [
        zstandard.ZstdCompressor(write_content_size=data.draw(st.booleans())).compress(p) for p in planes
    ]
    lengths = data.draw(
        st.lists(st.integers(0, 2**64 - 1), min_size=width, max_size=width) | st.just([len(p) for p in parts])
    )
    mask = data.draw(st.integers(0, 2**width - 1))
    body = struct.pack(f"<{width}Q", *lengths) + b"".join(parts)
    _decode_chunk(_codecs.HEADER.pack(_codecs.MAGIC, _codecs.PLANES, width, mask, n) + body, n)


@FAST
@given(st.data())
def test_real_chunk_with_bytes_changed(data):
    """A real chunk object with a few bytes changed: an error, or exactly the original bytes."""
    _, _, _, chunk = sample()
    size = struct.unpack_from("<Q", chunk, 8)[0]
    good = np.empty(size, np.uint8)
    _codecs.decode_into(chunk, good)
    obj = bytearray(chunk)
    for at, b in data.draw(
        st.lists(st.tuples(st.integers(0, len(obj) - 1), st.integers(0, 255)), max_size=3)
    ):
        obj[at] = b
    out = np.empty(size, np.uint8)
    ref = ChunkRef(treestore._format.manifest.rules.digest(good), size, len(chunk))
    try:
        decode_chunk(bytes(obj), ref, out)  # what every reader of a chunk goes through
    except (treestore.errors.ChunkDamagedError, treestore.UnsupportedFormatError):
        return
    assert out.tobytes() == good.tobytes(), "a changed chunk decoded to other bytes, unnoticed"


# --- addresses, key records, locks ------------------------------------------------------------------
@FAST
@given(
    st.text(max_size=60)
    | st.sampled_from(['"%', '"%u12"', '"%U110000"', "{-0}", "{18446744073709551616}", "#01", ".1a"])
)
def test_parse_address_of_arbitrary_text(text):
    try:
        path = parse_address(text)
    except treestore.InvalidInputError:
        return
    again = format_address(path)
    assert parse_address(again) == path
    for segment in again.split("/") if again else []:
        canonical_segment(segment)


@FAST
@given(values)
def test_parse_address_and_key_records_of_arbitrary_values(value):
    for fn in (parse_address, key_from_record, canonical_segment):
        try:
            fn(value)
        except (treestore.InvalidInputError, TypeError) as exc:
            # canonical_segment is cached: unhashable values raise TypeError before it runs
            assert fn is canonical_segment or isinstance(exc, treestore.InvalidInputError), exc


def _names_a_writer(content: bytes) -> bool:
    """Whether ``content`` reads as a lock record (created, host, pid): its age is its own, not
    its mtime's."""
    try:
        rec = msgpack.unpackb(content, raw=False)
        return {"created", "host", "pid"} <= set(rec)
    except Exception:
        return False


@SLOW
@given(st.binary(max_size=5000) | values.map(lambda v: msgpack.packb(v, use_bin_type=True)))
def test_gc_with_lock_objects_of_arbitrary_content(content):
    """Locks that do not decode age by their mtime: written two stale limits ago, they are
    stale, so gc runs its collection, and it removes an unreferenced chunk, the stale locks,
    and nothing the checkpoint needs."""
    assume(not _names_a_writer(content))
    with tempfile.TemporaryDirectory() as tmp:
        url = os.path.join(tmp, "store")
        store = treestore.Store(url)
        tree = {"a": np.arange(100_000), "b": np.arange(3)}
        store.save(tree, "c")
        orphan = _paths.chunk_path(bytes(32))  # a chunk's name, which no manifest references
        misplaced = f"{_paths.CHUNKS}/ff/{bytes(32).hex()}"  # named like a chunk, in the wrong folder
        store._storage.write(misplaced, [content])
        locks = [_paths.lock_path(kind, uuid.uuid4().hex) for kind in _paths.LOCK_KINDS]
        for path in [*locks, orphan]:
            store._storage.write(path, [content])
            long_ago = time.time() - 2 * STALE_AFTER
            os.utime(os.path.join(url, path), (long_ago, long_ago))
        report = store.gc(grace=0, wait=0)
        assert report.chunks_removed == 1 and report.locks_removed == 2, report
        assert store._storage.object_size(orphan) is None
        assert store._storage.object_size(misplaced) == len(content)  # not a chunk: not gc's
        assert all(store._storage.object_size(p) is None for p in locks)
        got = store.load("c")
        assert np.array_equal(got["a"], tree["a"]) and np.array_equal(got["b"], tree["b"])
        assert not treestore.verify(f"{url}#c").problems
