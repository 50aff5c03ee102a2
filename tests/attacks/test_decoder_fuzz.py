"""Property-based fuzzing of every decoder a store's bytes pass through.

Arbitrary bytes, arbitrary msgpack, and valid records with one field replaced by an arbitrary
value: the decoders (manifest, commit record, chunk objects, addresses, key records, lock records)
raise a TreestoreError subclass or succeed, and a full load of a fuzzed manifest does the same.
"""

from __future__ import annotations

import contextlib
import functools
import math
import struct
import uuid
from typing import Any

import msgpack
import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import treestore
from treestore._format import codecs as _codecs
from treestore._format import layout as _layout
from treestore._format.address import canonical_segment, format_address, key_from_record, parse_address
from treestore._format.commit_record import decode_commit_record
from treestore._format.manifest import decode_manifest

from .. import hostile

pytestmark = pytest.mark.timeout(120)

FAST = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
SLOW = settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=40)
    | st.sampled_from([2**48, 2**62, 256 * 2**20, 0, 1, -1])
    | st.sampled_from(["leaf", "dict", "list", "seq", "float32", "uint8", "numpy", "jax", "prng_key"])
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
ALLOWED = (treestore.errors.ManifestCorruptError, treestore.UnsupportedFormatError)


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
        _layout.chunk_path(m.leaves[[e.address for e in m.leaves].index("w")].chunks[0].digest)
    )
    return url, hostile.manifest_record(url, "c"), hostile.ref_record(url, "c"), chunk


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


def _replace(rec: Any, path: tuple[Any, ...], value: Any) -> Any:
    rec = msgpack.unpackb(msgpack.packb(rec, use_bin_type=True), raw=False)  # a deep copy
    obj = rec
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value
    return rec


def _decodes(decode: Any, data: bytes) -> None:
    with contextlib.suppress(*ALLOWED):
        decode(data, "c")


# --- arbitrary bytes and msgpack --------------------------------------------------------------------
@FAST
@given(st.binary(max_size=300))
def test_decode_manifest_of_arbitrary_bytes(data):
    _decodes(decode_manifest, data)


@FAST
@given(st.binary(max_size=300))
def test_decode_ref_of_arbitrary_bytes(data):
    _decodes(decode_commit_record, data)


@FAST
@given(values)
def test_decoders_of_arbitrary_msgpack(value):
    data = msgpack.packb(value, use_bin_type=True)
    _decodes(decode_manifest, data)
    _decodes(decode_commit_record, data)


@FAST
@given(st.data())
def test_manifest_with_one_field_replaced(data):
    _, manifest, _, _ = sample()
    path = data.draw(st.sampled_from(_paths(manifest)), label="path")
    value = data.draw(values, label="value")
    _decodes(decode_manifest, msgpack.packb(_replace(manifest, path, value), use_bin_type=True))


@FAST
@given(st.data())
def test_commit_record_with_one_field_replaced(data):
    _, _, ref, _ = sample()
    path = data.draw(st.sampled_from(_paths(ref)), label="path")
    value = data.draw(values, label="value")
    _decodes(decode_commit_record, msgpack.packb(_replace(ref, path, value), use_bin_type=True))


@SLOW
@given(st.data())
def test_load_of_a_manifest_with_one_field_replaced(data):
    """The whole read path, not just the decoder: only TreestoreError escapes a load."""
    url, manifest, ref, _ = sample()
    path = data.draw(st.sampled_from(_paths(manifest)), label="path")
    value = data.draw(values, label="value")
    name = f"f{uuid.uuid4().hex[:12]}"
    blob = msgpack.packb({**_replace(manifest, path, value), "name": name}, use_bin_type=True)
    digest = treestore._format.manifest.digest(blob)
    storage = hostile.storage(url)
    storage.write(_layout.manifest_path(digest), [blob])
    rec = {**ref, "name": name, "manifest": digest, "manifest_size": len(blob)}
    storage.write(_layout.record_path(name), [msgpack.packb(rec, use_bin_type=True)])
    try:
        for fn in (
            lambda: treestore.load(url, name),
            lambda: [np.asarray(x) for x in treestore.open(url, name).leaves.values()],
            lambda: treestore.verify(f"{url}#{name}"),
        ):
            with contextlib.suppress(treestore.TreestoreError):
                fn()
    finally:
        storage.delete(_layout.record_path(name))


# --- chunk objects ----------------------------------------------------------------------------------
def _decode_chunk(obj: bytes, size: int) -> None:
    out = np.empty(size, np.uint8)
    with contextlib.suppress(treestore.errors.ChunkCorruptError, treestore.UnsupportedFormatError):
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
    try:
        _codecs.decode_into(bytes(obj), out)
    except (treestore.errors.ChunkCorruptError, treestore.UnsupportedFormatError):
        return
    if treestore._format.manifest.digest(out) != treestore._format.manifest.digest(good):
        assert bytes(obj) != chunk  # decoded to other bytes: the reader's digest check catches it


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


@SLOW
@given(st.binary(max_size=5000) | values.map(lambda v: msgpack.packb(v, use_bin_type=True)))
def test_gc_with_lock_objects_of_arbitrary_content(content):
    url = f"memory://fuzz-locks/{uuid.uuid4().hex}"
    store = treestore.Store(url)
    store.save({"a": np.arange(3)}, "c")
    store.storage.write(f"{_layout.LOCKS}/save-{uuid.uuid4().hex}", [content])
    store.storage.write(f"{_layout.LOCKS}/gc-{uuid.uuid4().hex}", [content])
    with contextlib.suppress(treestore.TreestoreError):
        store.gc(grace=0, wait=0)
    assert math.isfinite(store.list()[0].created)
