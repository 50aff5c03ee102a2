"""Garbage and truncated msgpack in manifests and commit records, and msgpack that declares more
than it holds (containers of 2**32 - 1 items, nesting a hundred thousand deep)."""

from __future__ import annotations

import struct

import msgpack
import pytest

import treestore
from treestore._format.commit_record import decode_commit_record
from treestore._format.manifest.codec import decode_any as decode_manifest  # the reader's entry point

from ._harness import MiB, guarded, memory_peak

BOMBS = {
    "array32 of 2**32-1": b"\xdd\xff\xff\xff\xff",
    "map32 of 2**32-1": b"\xdf\xff\xff\xff\xff",
    "str32 of 2**32-1": b"\xdb\xff\xff\xff\xff" + b"x" * 100,
    "bin32 of 2**32-1": b"\xc6\xff\xff\xff\xff" + b"x" * 100,
    "ext32 of 2**32-1": b"\xc9\xff\xff\xff\xff\x05" + b"x" * 100,
    "nested arrays 100000 deep": b"\x91" * 100_000 + b"\xc0",
    "nested maps 100000 deep": b"\x81\xa1k" * 100_000 + b"\xc0",
    "reserved byte": b"\xc1",
    "empty": b"",
    "nil": b"\xc0",
    "a list": msgpack.packb([1, 2, 3]),
    "a string": msgpack.packb("treestore.manifest"),
    "int map keys": msgpack.packb({1: 2}),
    "nil map key": b"\x81\xc0\x01",
    "float map key": b"\x81\xcb" + struct.pack(">d", 1.5) + b"\x01",
    "array map key": b"\x81\x91\x01\x01",
    "invalid utf-8": b"\x81\xa2\xff\xfe\x01",
    "surrogate in utf-8": b"\x81\xa3\xed\xa0\x80\x01",
    "timestamp ext": msgpack.packb({"format": msgpack.Timestamp(1, 2)}),
    "duplicate keys": b"\x82\xa6format\xc0\xa6format\xb2treestore.manifest",
    "trailing bytes": msgpack.packb({"format": "x"}) + b"\x00\x01",
    "two maps": msgpack.packb({}) + msgpack.packb({}),
}


@pytest.mark.timeout(60)
def test_every_truncation_of_a_manifest_is_refused(store):
    """Every proper prefix of a real manifest, decoded directly (all of them) and through the
    store (one in ten)."""
    ref = store.ref_record()
    data = (store.root / "manifests" / ref["manifest"].hex()).read_bytes()
    decode_manifest(data, "bad")
    for keep in range(len(data)):
        with pytest.raises(treestore.errors.ManifestDamagedError):
            decode_manifest(data[:keep], "bad")
    for keep in range(0, len(data), max(1, len(data) // 40)):
        store.write_manifest(None, raw=data[:keep])
        out = store.check(ops=["load", "verify"], memory=None)
        assert isinstance(out["load"].error, treestore.errors.ManifestDamagedError)


@pytest.mark.timeout(60)
def test_every_truncation_of_a_commit_record_is_refused(store):
    data = store.ref_bytes()
    for keep in range(len(data)):
        store.write_ref(raw=data[:keep])
        out = store.check(ops=["list", "load", "verify all"], memory=None)
        assert isinstance(out["load"].error, treestore.errors.ManifestDamagedError), keep
        assert out["load"].error.checkpoint == "bad"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bomb", list(BOMBS), ids=list(BOMBS))
@pytest.mark.parametrize("where", ["manifest", "record"])
def test_msgpack_garbage(store, bomb, where):
    data = BOMBS[bomb]
    if where == "manifest":
        store.write_manifest(None, raw=data)
        ops = ["manifest", "load", "verify"]
    else:
        store.write_ref(raw=data)
        ops = ["list", "latest", "load", "verify all"]
    out = store.check(ops=ops, memory=16 * MiB)
    assert isinstance(out["load"].error, treestore.errors.ManifestDamagedError), out["load"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bomb", list(BOMBS), ids=list(BOMBS))
def test_decoders_alone(bomb):
    data = BOMBS[bomb]
    with guarded([]), memory_peak() as peak:
        for decode in (decode_manifest, decode_commit_record):
            with pytest.raises((treestore.errors.ManifestDamagedError, treestore.UnsupportedFormatError)):
                decode(data, "x")
    assert peak[0] < 16 * MiB


@pytest.mark.timeout(60)
def test_metadata_of_every_msgpack_kind_round_trips_or_is_refused(store):
    """Hostile metadata (informational) is returned as it is stored, never interpreted."""
    weird = {
        "ext": msgpack.ExtType(99, b"\x80\x04\x95"),  # looks like the start of a pickle
        "ts": msgpack.Timestamp(10, 20),
        "bin": b"\x00" * 10,
        "nested": [[[[{"a": None}]]]],
    }
    store.mutate_manifest(lambda m: m.update(metadata=weird))
    store.write_ref({**store.ref_record(), "metadata": weird})
    out = store.check(ops=["list", "manifest", "load", "verify"])
    listed = {c.name: c.metadata for c in out["list"].value}
    assert listed["bad"] == weird
    assert out["manifest"].value.metadata == weird
