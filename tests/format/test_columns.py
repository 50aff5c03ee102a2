"""Version-2 columnar manifests (treestore/_format/manifest/columns.py and columns_codec.py): the same
leaves as version 1, a format that cannot drift, hostile input refused with TreestoreErrors only,
and every reader bound checked at its edge."""

from __future__ import annotations

import math
import uuid
from dataclasses import replace
from typing import Any

import blake3
import jax
import jax.numpy as jnp
import ml_dtypes
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import treestore
from tests.support.records import Hand, columns_of, leaf_record, v1_bytes
from tests.tree.test_structures import CASES
from treestore._format.dtypes import DTYPES
from treestore._format.encoding import to_msgpack
from treestore._format.limits import (
    CHUNK_SLACK,
    INT_END,
    INT_START,
    MAX_CHUNK_BYTES,
    MAX_DEPTH,
    MAX_DIM,
    MAX_GRID_CELLS,
    MAX_INDEX,
    MAX_INT_DIGITS,
    MAX_MANIFEST_BYTES,
    MAX_METADATA_BYTES,
    MAX_NDIM,
    MAX_PARTS,
    MAX_PIECES,
)
from treestore._format.manifest.codec import decode_any, decode_columns, encode, encode_columns
from treestore._format.manifest.columns import ARRAY_FIELDS, IN_PIECES, LEAF_DTYPE, Columns
from treestore._format.manifest.frame import Frame
from treestore._format.manifest.record_views import Manifest
from treestore._format.manifest.records import ChunkRef, LeafEntry, Piece
from treestore.errors import (
    ManifestDamagedError,
    OutOfMemoryError,
    TreestoreError,
    UnsupportedFormatError,
)

NAME = "ckpt"


# --- helpers ----------------------------------------------------------------------------------
def saved(tree: Any, **options: Any) -> Manifest:
    url = f"memory://columns/{uuid.uuid4().hex}"
    treestore.save(url, tree, NAME, options=treestore.SaveOptions(**options) if options else None)
    return treestore.Store(url).manifest(NAME)


def assert_same(m: Manifest | Hand, c: Columns) -> None:
    """``c`` describes exactly the leaves, tree and packs of ``m``."""
    assert len(c) == len(m.leaves)
    assert c.tree_record() == m.tree
    assert c.addresses == [e.address for e in m.leaves]
    entries = Manifest(c).leaves
    for i, e in enumerate(m.leaves):
        got = entries[i]
        assert to_msgpack(leaf_record(got)) == to_msgpack(leaf_record(e)), e.address
        assert got.digest == e.digest and got.weak_type == e.weak_type and got.pieces == e.pieces
        assert c.find(e.address) == i
    assert encode(c, 1) == v1_bytes(m)  # byte for byte, as written by hand
    refs = [r for e in m.leaves for r in e.chunks]
    assert c.chunk_digests() == {r.digest for r in refs if r.pack is None} | {p.digest for p in m.packs}
    assert c.nbytes == sum(r.raw_size for r in refs)
    every = np.arange(len(c))
    assert c.same_leaves(every, c, every).all()


def round_trip(m: Manifest | Hand) -> Columns:
    data = encode_columns(columns_of(m))
    c = decode_columns(data, m.name)
    assert_same(m, c)
    assert encode_columns(c) == data
    assert_same(m, decode_any(data, m.name))
    assert_same(m, decode_any(encode(c, 1), m.name))  # version 1 stays readable
    return c


def digest_of(seed: object) -> bytes:
    return blake3.blake3(repr(seed).encode()).digest()


def entry(address: str, dtype: str, shape: tuple[int, ...], *sizes: int, **fields: Any) -> LeafEntry:
    chunks = tuple(ChunkRef(digest_of((address, j)), n, n + 16) for j, n in enumerate(sizes))
    return LeafEntry(
        address, fields.pop("kind", "numpy"), dtype, shape, fields.pop("chunks", chunks), **fields
    )


def flat_tree(n: int, names: list[str]) -> dict[str, Any]:
    return {
        "type": "dict",
        "keys": [["dict", a] for a in names],
        "children": [{"type": "leaf", "leaf": i} for i in range(n)],
    }


def hand(*leaves: LeafEntry, packs: tuple[ChunkRef, ...] = (), **fields: Any) -> Hand:
    """A manifest of leaves with bare single-segment addresses, in a flat dict."""
    tree = fields.pop("tree", None) or flat_tree(len(leaves), [e.address for e in leaves])
    return Hand(NAME, 1.5, tree, leaves, packs, fields.pop("metadata", None), {"name": "zstd"}, 4096)


def record(m: Hand) -> dict[str, Any]:
    return msgpack.unpackb(encode_columns(columns_of(m)), raw=False)


def decode(rec: dict[str, Any]) -> Columns | Frame:
    return decode_columns(to_msgpack(rec), NAME)


def column(rec: dict[str, Any], name: str) -> np.ndarray:
    return np.frombuffer(rec[name], ARRAY_FIELDS[name]).copy()


def edited(rec: dict[str, Any], name: str, f: str | None, value: Any, at: Any = 0) -> dict[str, Any]:
    """``rec`` with element ``at`` (of field ``f``, for a record column) of column ``name`` set."""
    out = dict(rec)
    a = column(rec, name)
    if f is None:
        a[at] = value
    else:
        a[f][at] = value
    out[name] = a.tobytes()
    return out


def refused(
    rec: dict[str, Any], match: str | None = None, kind: type[TreestoreError] = ManifestDamagedError
) -> None:
    with pytest.raises(kind, match=match) as info:
        decode(rec)
    assert info.value.checkpoint == NAME and NAME in str(info.value)


def bounded(accepted: Hand, rejected: Hand, match: str | None = None) -> None:
    """Readers of either version accept one side of a bound and refuse the other."""
    decode_columns(encode_columns(columns_of(accepted)), NAME)
    with pytest.raises(ManifestDamagedError, match=match):
        columns_of(rejected)


# --- round trips --------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_every_structure_round_trips(case):
    round_trip(saved(CASES[case]))


@pytest.mark.parametrize("tree", [np.arange(3.0), None, {}, [], 5, "text"], ids=repr)
def test_root_trees_round_trip(tree):
    round_trip(saved(tree))


def every_leaf_kind() -> dict[str, Any]:
    arrays = {name: np.arange(6).astype(dtype).reshape(2, 3) for name, dtype in DTYPES.items()}
    return {
        "arrays": arrays,
        "zero-d": {name: np.zeros((), dtype) for name, dtype in DTYPES.items()},
        "empty": {name: np.zeros((0, 3), dtype) for name, dtype in DTYPES.items()},
        "npscalar": [np.float32(1.5), np.int8(-3), ml_dtypes.bfloat16(2)],
        "jax": [jnp.arange(4.0), jnp.zeros((0,)), jnp.asarray(2.0), jnp.asarray(3, jnp.int32)],
        "keys": [jax.random.key(1), jax.random.key(2, impl="rbg"), jax.random.key(3, impl="unsafe_rbg")],
        "key-batch": jax.random.split(jax.random.key(4), (2, 3)),
        "scalars": [True, False, 0, -7, 2**63 - 1, INT_START, INT_END - 1, INT_END, INT_START - 1, -(10**40)],
        "floats": [0.0, -0.0, 1.5, float("inf"), float("-inf"), float("nan")],
        "complex": [1 + 2j, complex(float("nan"), -0.0)],
        "text": ["", "ünï", "a/b\x00"],
        "bytes": [b"", b"\x00\xff"],
        "none": None,
        "big": np.arange(30_000, dtype=np.float32),  # several chunks at chunk_size 4096
    }


@pytest.mark.parametrize("options", [{}, {"chunk_size": 4096, "small_leaf": 16, "pack_size": 64}])
def test_every_leaf_kind_round_trips(options):
    c = round_trip(saved(every_leaf_kind(), **options))
    assert len(c.packs) and (not options or c.leaves["chunks"].max() > 1)  # packs; several chunks


def test_weak_types_round_trip():
    c = round_trip(saved({"lr": jnp.asarray(0.1), "w": jnp.ones(2)}))
    assert [e.weak_type for e in Manifest(c).leaves] == [True, False]


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS in conftest)")
def test_sharded_pieces_round_trip():
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    values = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
    tree = {
        spec: jax.device_put(values, NamedSharding(mesh, P(*spec.split(",")) if spec else P()))
        for spec in ("a,b", "a", "b,a", "")
    }
    tree["small"] = jax.device_put(np.arange(8, dtype=np.int8), NamedSharding(mesh, P("a")))
    for options in ({}, {"chunk_size": 4096, "small_leaf": 16, "pack_size": 64}):
        c = round_trip(saved(tree, **options))
        assert sorted(len(e.pieces) for e in Manifest(c).leaves) == [0, 4, 4, 8, 8]


def test_hand_built_pieces_round_trip():
    pieces = tuple(
        Piece((r, col), (2, 3), (ChunkRef(digest_of((r, col)), 24, 30),)) for r in (0, 2) for col in (0, 3)
    )
    packed = Piece((0,), (2,), (ChunkRef(digest_of(1), 2, 0, 0, 3),))
    m = hand(
        LeafEntry("a", "numpy", "float32", (4, 6), tuple(c for p in pieces for c in p.chunks), pieces=pieces),
        LeafEntry("b", "numpy", "uint8", (3, 0), (), pieces=(Piece((0, 0), (3, 0), ()),)),
        LeafEntry("c", "numpy", "uint8", (2,), packed.chunks, pieces=(packed,)),
        packs=(ChunkRef(digest_of("pack"), 5, 20),),
    )
    round_trip(m)


def test_leaves_are_made_only_when_asked_for():
    c = decode_columns(encode_columns(columns_of(saved({"a": 1, "b": np.ones(2)}))), NAME)
    entries = Manifest(c).leaves
    assert not entries._made and "addresses" not in c.__dict__
    assert c.find("b") == 1 and entries[1] is entries[-1] and len(entries._made) == 1
    assert c.find("nope") is None and c.find("a/b") is None and entries[0:2][0].value == 1
    for made in (c, columns_of(Manifest(c))):  # nobody can change one
        assert not any(a.flags.writeable for a in (made.leaves, made.chunks, made.nodes.table, made.shapes))


def test_same_leaves_agrees_with_leaf_digests():
    base = every_leaf_kind()
    other = {**base, "arrays": {**base["arrays"], "int8": np.ones((2, 3), np.int8)}, "scalars": [1, 2]}
    a, b = (
        columns_of(saved(base)),
        columns_of(saved(other, chunk_size=4096, small_leaf=16)),
    )
    ia, ib = np.meshgrid(np.arange(len(a)), np.arange(len(b)), indexing="ij")
    same = a.same_leaves(ia.ravel(), b, ib.ravel())
    digests = [[x.digest == y.digest for y in Manifest(b).leaves] for x in Manifest(a).leaves]
    assert same.tolist() == np.array(digests).ravel().tolist()
    assert same.any() and not same.all()


def test_same_leaves_agrees_with_leaf_digests_for_pieces():
    """Leaves saved in pieces are compared column-wise too: equal exactly when their digests
    (dtype, shape, and each piece's box and chunk refs) are."""

    def ref(*seed: object) -> ChunkRef:
        return ChunkRef(digest_of(seed), 24, 30)  # one row of a float32[4, 6] leaf

    def leaf(*pieces: Piece) -> LeafEntry:
        chunks = tuple(c for p in pieces for c in p.chunks)
        return LeafEntry("x", "numpy", "float32", (4, 6), chunks, pieces=pieces)

    c = [ref(j) for j in range(4)]
    variants = [
        leaf(Piece((0, 0), (2, 6), (c[0], c[1])), Piece((2, 0), (2, 6), (c[2], c[3]))),
        leaf(Piece((0, 0), (1, 6), (c[0],)), Piece((1, 0), (3, 6), (c[1], c[2], c[3]))),  # resplit
        leaf(Piece((0, 0), (4, 3), (c[0], c[1])), Piece((0, 3), (4, 3), (c[2], c[3]))),  # other boxes
        leaf(Piece((0, 0), (2, 6), (c[0], c[1])), Piece((2, 0), (2, 6), (c[2], ref(9)))),  # other bytes
        leaf(Piece((0, 0), (2, 6), (c[0], c[1])), Piece((2, 0), (2, 6), (c[2], c[3]))),  # the first
    ]
    made = [columns_of(hand(v)) for v in variants]
    for x, a in zip(variants, made, strict=True):
        for y, b in zip(variants, made, strict=True):
            assert a.same_leaves(np.array([0]), b, np.array([0])).tolist() == [x.digest == y.digest]
    assert variants[0].digest == variants[4].digest != variants[1].digest


def test_match_pairs_leaves_by_address():
    a = columns_of(saved({"a": 1, "b": {"c": 2, "d": 3}}))
    b = columns_of(saved({"b": {"e": 5, "d": 4}, "a": 1}))
    ia, ib = a.match(b)
    assert [a.addresses[i] for i in ia] == [b.addresses[j] for j in ib] == ["a", "b/d"]
    assert a.same_leaves(ia, b, ib).tolist() == [True, False]
    same_tree = columns_of(saved({"a": 9, "b": {"c": 2, "d": 3}}))
    ia, ib = a.match(same_tree)
    assert ia.tolist() == ib.tolist() == [0, 1, 2] and "addresses" not in same_tree.__dict__
    assert a.same_leaves(ia, same_tree, ib).tolist() == [False, True, True]


# --- the format cannot drift ------------------------------------------------------------------
# The version-2 manifest of golden_manifest(), byte for byte (SPEC.md, version-2 manifest).
GOLDEN = (
    "de0015a6666f726d6174b27472656573746f72652e6d616e6966657374a776657273696f6e02a46e616d65a6676f6c64"
    "656ea763726561746564cb41d954fc40100000a86d6574616461746181a47374657003a5636f64656381a46e616d65a4"
    "7a737464aa6368756e6b5f73697a65cd1000a87365676d656e747394a161a162a22e78a22e79a56e6f646573c42d0400"
    "00000000000000000000000000000000060000000001000000000200000002000000010200000003000000aa6e6f6465"
    "5f6e616d657391a36d2e50ab6e6f64655f6c6561766573c4080000000001000000a66c6561766573c410010a01010100"
    "00000500000000000000a6736861706573c4080200000000000000a676616c75657391b72d3131383035393136323037"
    "3137343131333033343234ac70696563655f636f756e7473c400ac70696563655f6368756e6b73c400ab70696563655f"
    "7374617274c400ab70696563655f7368617065c400a66368756e6b73c430000102030405060708090a0b0c0d0e0f1011"
    "12131415161718191a1b1c1d1e1f08000000000000000000000000000000a57061636b73c42820212223242526272829"
    "2a2b2c2d2e2f303132333435363738393a3b3c3d3e3f0800000018000000a5706172747390"
)


def golden_manifest() -> Hand:
    tree = {
        "type": "dict",
        "keys": [["dict", "a"], ["dict", "b"]],
        "children": [
            {"type": "leaf", "leaf": 0},
            {
                "type": "namedtuple",
                "name": "m.P",
                "keys": [["attr", "x"], ["attr", "y"]],
                "children": [{"type": "leaf", "leaf": 1}, {"type": "none"}],
            },
        ],
    }
    leaves = (
        LeafEntry("a", "jax", "float32", (2,), (ChunkRef(bytes(range(32)), 8, 0, 0, 0),), weak_type=True),
        LeafEntry("b/.x", "int", value=-(2**70)),
    )
    packs = (ChunkRef(bytes(range(32, 64)), 8, 24),)
    return Hand("golden", 1700000000.25, tree, leaves, packs, {"step": 3}, {"name": "zstd"}, 4096)


def test_golden_bytes():
    data = encode_columns(columns_of(golden_manifest()))
    assert data.hex() == GOLDEN
    assert_same(golden_manifest(), decode_columns(bytes.fromhex(GOLDEN), "golden"))


# --- hostile input ------------------------------------------------------------------------------
def hostile_bases() -> list[bytes]:
    sharded = (
        Piece((0,), (2,), (ChunkRef(digest_of(0), 8, 9),)),
        Piece((2,), (2,), (ChunkRef(digest_of(1), 8, 0, 0, 0),)),
    )
    m = hand(
        entry("w", "float32", (2, 2), 16),
        LeafEntry("p", "numpy", "float32", (4,), tuple(c for p in sharded for c in p.chunks), pieces=sharded),
        LeafEntry("k", "prng_key", "uint32", (2,), (ChunkRef(digest_of(2), 8, 0, 0, 8),), "threefry2x32"),
        LeafEntry("i", "int", value=2**70),
        LeafEntry("s", "str", value="x"),
        packs=(ChunkRef(digest_of("pack"), 16, 20),),
        metadata={"m": [1, 2]},
    )
    return [
        encode_columns(columns_of(m)),
        encode_columns(columns_of(golden_manifest())),
    ]


BASES = hostile_bases()
INTS = st.integers(-(2**63), 2**64 - 1)  # what msgpack can encode
WORDS = [0, 1, 2, 3, 7, 255, 2**31 - 1, 2**31, 2**32 - 1, 2**48, 2**48 + 1, 2**63, 2**64 - 1]


@st.composite
def mutations(draw: st.DrawFn) -> bytes:
    data = draw(st.sampled_from(BASES))
    rec = msgpack.unpackb(data, raw=False)
    action = draw(st.sampled_from(["word", "byte", "cut", "grow", "swap", "drop", "value", "raw"]))
    key = draw(st.sampled_from(sorted(rec)))
    value = rec[key]
    if action in ("word", "byte", "cut", "grow") and isinstance(value, bytes) and value:
        if action == "word":
            width = draw(st.sampled_from([1, 4, 8]))
            at = draw(st.integers(0, max(len(value) - width, 0)))
            word = draw(st.sampled_from(WORDS)) % 2 ** (8 * width)
            value = value[:at] + word.to_bytes(width, "little") + value[at + width :]
        elif action == "byte":
            at = draw(st.integers(0, len(value) - 1))
            value = value[:at] + bytes([value[at] ^ draw(st.integers(1, 255))]) + value[at + 1 :]
        elif action == "cut":
            value = value[: draw(st.integers(0, len(value) - 1))]
        else:
            value = value + draw(st.binary(min_size=1, max_size=64))
        rec[key] = value
    elif action == "swap":
        other = draw(st.sampled_from(sorted(rec)))
        rec[key], rec[other] = rec[other], value
    elif action == "drop":
        del rec[key]
    elif action == "value":
        rec[key] = draw(
            st.one_of(
                st.none(), st.booleans(), INTS, st.floats(), st.text(max_size=8),
                st.binary(max_size=64), st.lists(st.one_of(INTS, st.text(max_size=4)), max_size=4),
                st.dictionaries(st.text(max_size=4), INTS, max_size=3),
            )
        )  # fmt: skip
    else:
        raw = bytearray(data)
        for _ in range(draw(st.integers(1, 4))):
            at = draw(st.integers(0, len(raw) - 1))
            raw[at] = draw(st.integers(0, 255))
        return bytes(raw[: draw(st.integers(0, len(raw)))])
    return to_msgpack(rec)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutations())
def test_hostile_manifests_raise_only_treestore_errors(data):
    try:
        c = decode_columns(data, NAME)
    except (ManifestDamagedError, UnsupportedFormatError, OutOfMemoryError) as exc:
        assert "malformation" not in str(exc), exc  # every refusal comes from a check, not by accident
        return
    # What version 2 accepts, every part of treestore can use, and version 1 accepts too.
    decode_any(encode(c, 1), NAME)
    assert decode_columns(encode_columns(c), NAME).addresses == c.addresses
    every = np.arange(len(c))
    assert c.same_leaves(every, c, every).tolist() == [e.digest == e.digest for e in Manifest(c).leaves]


def test_every_field_is_required():
    rec = msgpack.unpackb(BASES[0], raw=False)
    for key in rec:
        if key != "metadata":
            refused({k: v for k, v in rec.items() if k != key})


def test_versions_and_parts():
    rec = msgpack.unpackb(BASES[0], raw=False)
    refused({**rec, "version": 3}, "version", UnsupportedFormatError)
    refused({**rec, "format": "treestore.checkpoint"}, "format")
    refused({**rec, "parts": [{"digest": bytes(32), "size": 1}]}, "missing field 'layout'")
    refused({**rec, "parts": [{"digest": bytes(32), "size": 1}], "layout": bytes(32)}, "a part should be")
    with pytest.raises(UnsupportedFormatError):
        decode_columns(v1_bytes(golden_manifest()), NAME)  # version 1 goes to decode_any


def test_refusals_name_the_leaf():
    rec = record(hand(entry("w", "float32", (2,), 8), entry("v", "float32", (3,), 12)))
    refused(edited(rec, "leaves", "kind", 99, 1), "v: unsupported leaf kind", UnsupportedFormatError)
    refused(edited(rec, "leaves", "dtype", 200, 1), "v: unsupported dtype", UnsupportedFormatError)
    refused(edited(rec, "chunks", "raw", 9, 1), "leaf v: its shape needs 12 bytes, chunks hold 9")
    refused(edited(rec, "leaves", "flags", 1 << 2, 0), "leaf w: a PRNG")
    refused(edited(rec, "leaves", "flags", 1 << 4, 0), "leaf w: undefined flag")
    decode(rec)


def test_refused_trees():
    t = {"type": "list", "children": [{"type": "leaf", "leaf": 0}, {"type": "leaf", "leaf": 1}]}
    rec = record(hand(entry("0", "uint8", (1,), 1), entry("1", "uint8", (1,), 1), tree=t))
    refused(edited(rec, "nodes", "parent", 2, 2), "not an earlier node")
    refused(edited(rec, "nodes", "kind", 1, 0), "leaf or none node has children")
    refused(edited(rec, "nodes", "kind", 9, 0), "unsupported node kind", UnsupportedFormatError)
    refused(edited(rec, "nodes", "key", 0, 2), "used by no node")
    refused({**rec, "segments": ["1", "0"]}, "not its position")
    refused(edited(rec, "node_leaves", None, 0, 1), "exactly once")
    refused({**rec, "segments": ['"a"', "1"]}, "canonical")
    refused({**rec, "segments": ["0", "01"]}, "segment")
    refused({**rec, "segments": ["0", "0"]}, "repeats")
    refused({**rec, "segments": ["0", "1", "2"]}, "used by no node")
    attr = {"type": "dict", "keys": [["attr", "a"]], "children": [{"type": "leaf", "leaf": 0}]}
    with pytest.raises(ManifestDamagedError, match="not a dict key"):
        columns_of(hand(entry(".a", "uint8", (1,), 1), tree=attr))
    for keys in ([["dict", 1], ["dict", True]], [["attr", "a"], ["dict", "a"]], [["seq", 1], ["flat", 1]]):
        node = {"type": "custom", "name": "C", "keys": keys, "children": [{"type": "none"}, {"type": "none"}]}
        with pytest.raises(ManifestDamagedError, match="same key"):
            columns_of(hand(tree=node))


# --- every bound at its edge ----------------------------------------------------------------------
def one_chunk(raw: int, stored: int | None = None) -> Hand:
    return hand(
        LeafEntry(
            "a", "numpy", "uint8", (raw,), (ChunkRef(digest_of(0), raw, raw if stored is None else stored),)
        )
    )


def test_chunk_raw_and_stored_sizes():
    bounded(one_chunk(MAX_CHUNK_BYTES), one_chunk(MAX_CHUNK_BYTES + 1), "chunk size should be")
    bounded(
        one_chunk(8, MAX_CHUNK_BYTES + CHUNK_SLACK), one_chunk(8, MAX_CHUNK_BYTES + CHUNK_SLACK + 1), "stored"
    )
    rec = record(one_chunk(MAX_CHUNK_BYTES))
    refused(
        edited(edited(rec, "chunks", "raw", MAX_CHUNK_BYTES + 1), "shapes", None, MAX_CHUNK_BYTES + 1),
        "raw size",
    )
    refused(edited(rec, "chunks", "stored", MAX_CHUNK_BYTES + CHUNK_SLACK + 1), "stored size")


def packed(offset: int, raw: int, pack_raw: int, pack: int = 0) -> Hand:
    ref = ChunkRef(digest_of(1), raw, 0, pack, offset)
    return hand(
        LeafEntry("a", "numpy", "uint8", (raw,), (ref,)), packs=(ChunkRef(digest_of(2), pack_raw, 9),)
    )


def test_pack_offsets_and_indices():
    bounded(
        packed(MAX_CHUNK_BYTES, 0, MAX_CHUNK_BYTES), packed(MAX_CHUNK_BYTES + 1, 0, MAX_CHUNK_BYTES), "offset"
    )
    bounded(packed(6, 4, 10), packed(7, 4, 10), "outside pack")
    bounded(packed(0, 4, 10, 0), packed(0, 4, 10, 1), "pack index")
    rec = record(packed(6, 4, 10))
    refused(edited(rec, "chunks", "pack", -2), "pack index")
    refused(edited(rec, "chunks", "pack", -1), "offset")  # an own chunk has no offset
    refused(edited(rec, "packs", "raw", MAX_CHUNK_BYTES + 1), "pack raw size")


def test_chunk_size():
    m = one_chunk(1)
    bounded(replace(m, chunk_size=MAX_CHUNK_BYTES), replace(m, chunk_size=MAX_CHUNK_BYTES + 1), "chunk_size")


def shaped(shape: tuple[int, ...], dtype: str = "uint8") -> Hand:
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    chunks = (ChunkRef(digest_of(0), nbytes, nbytes),) if nbytes else ()
    return hand(LeafEntry("a", "numpy", dtype, shape, chunks))


def test_dimensions_and_leaf_bytes():
    bounded(shaped((1,) * MAX_NDIM), shaped((1,) * (MAX_NDIM + 1)), "dimensions")
    bounded(shaped((MAX_DIM, 0)), shaped((MAX_DIM + 1, 0)), "2\\*\\*48")
    factors = (7, 7, 73, 127, 337, 92737, 649657)
    assert math.prod(factors) == 2**63 - 1  # the most bytes a leaf may have
    bounded(shaped((*factors, 0)), shaped((2**48, 2**15, 0)), "too large")
    bounded(shaped((2**48, 2**13, 0), "int16"), shaped((2**48, 2**14, 0), "int16"), "too large")
    refused(
        edited(record(shaped((1,) * MAX_NDIM)), "leaves", "ndim", MAX_NDIM + 1) | {"shapes": bytes(8 * 65)},
        "dimensions",
    )


def pieces_of(count: int) -> Hand:
    pieces = tuple(Piece((i, 0), (1, 0), ()) for i in range(count))
    return hand(LeafEntry("a", "numpy", "uint8", (count, 0), (), pieces=pieces))


def test_piece_count():
    bounded(pieces_of(MAX_PIECES), pieces_of(MAX_PIECES + 1), "pieces")
    rec = record(pieces_of(2))
    refused(
        edited(rec, "piece_counts", None, 0) | {"piece_chunks": b"", "piece_start": b"", "piece_shape": b""},
        "1 to",
    )


def staircase(cuts: int) -> Hand:
    """Rows of a (2048, W) leaf, each cut in two at its own column: 2048 x cuts+1 grid cells."""
    width = cuts + 1
    pieces = []
    for r in range(2048):
        cut = 1 + r % cuts
        for start, n in ((0, cut), (cut, width - cut)):
            pieces.append(Piece((r, start), (1, n), (ChunkRef(digest_of((r, start)), n, n),)))
    chunks = tuple(c for p in pieces for c in p.chunks)
    return hand(LeafEntry("a", "numpy", "uint8", (2048, width), chunks, pieces=tuple(pieces)))


def test_piece_grid_cells():
    assert MAX_GRID_CELLS == 2048 * 2048
    bounded(staircase(2047), staircase(2048), "irregular grid")


def test_pieces_must_tile():
    halves = [ChunkRef(digest_of(j), 2, 2) for j in range(2)]
    pieces = (Piece((0,), (2,), (halves[0],)), Piece((2,), (2,), (halves[1],)))
    rec = record(hand(LeafEntry("a", "numpy", "uint8", (4,), tuple(halves), pieces=pieces)))
    decode(rec)
    refused(edited(rec, "piece_start", None, 1, 1), "overlap")
    refused(edited(rec, "piece_start", None, 3, 1), "outside")
    refused(edited(rec, "piece_shape", None, 1, 1), "wrong number of bytes")
    refused(edited(rec, "piece_chunks", None, 2, 0), "chunk refs")


def nested(depth: int) -> Hand:
    tree: dict[str, Any] = {"type": "leaf", "leaf": 0}
    for _ in range(depth):
        tree = {"type": "list", "children": [tree]}
    return hand(LeafEntry("/".join(["0"] * depth), "int", value=1), tree=tree)


def test_tree_depth():
    bounded(nested(MAX_DEPTH), nested(MAX_DEPTH + 1), "deeper")


def test_metadata_size():
    def of(n: int) -> Hand:
        text = "x" * (n - 8)  # a map of one entry (1 byte), the key (2) and a str 32 header (5)
        assert len(to_msgpack({"x": text})) == n
        return hand(metadata={"x": text})

    bounded(of(MAX_METADATA_BYTES), of(MAX_METADATA_BYTES + 1), "1 MiB")


def test_big_int_values():
    rec = record(hand(LeafEntry("a", "int", value=10 ** (MAX_INT_DIGITS - 1))))
    decode(rec)
    assert len(rec["values"][0]) == MAX_INT_DIGITS
    refused({**rec, "values": ["1" * (MAX_INT_DIGITS + 1)]}, "4300")
    refused({**rec, "values": [str(INT_END - 1)]}, "canonical decimal")
    decode({**rec, "values": [str(INT_END)]})
    decode({**rec, "values": [str(INT_START - 1)]})
    refused({**rec, "values": [str(INT_START)]}, "canonical decimal")
    refused({**rec, "values": ["0" + str(INT_END)]}, "canonical decimal")
    with pytest.raises(ManifestDamagedError, match="4300"):  # version 1 holds the same bound
        columns_of(hand(LeafEntry("a", "int", value="1" + "0" * MAX_INT_DIGITS)))


def test_key_indices_and_int_keys():
    def custom(*segments: str) -> dict[str, Any]:
        rec = record(
            hand(tree={"type": "custom", "name": "C", "keys": [["flat", 0]], "children": [{"type": "none"}]})
        )
        return {**rec, "segments": list(segments)}

    decode(custom(f"#{MAX_INDEX - 1}"))
    refused(custom(f"#{MAX_INDEX}"), "segment")
    decode(custom(f"{{{INT_START}}}"))
    decode(custom(f"{{{INT_END - 1}}}"))
    refused(custom(f"{{{INT_END}}}"), "segment")
    refused(custom(f"{{{INT_START - 1}}}"), "segment")


def test_manifest_size():
    with pytest.raises(ManifestDamagedError, match="size limit"):
        decode_columns(bytes(MAX_MANIFEST_BYTES + 1), NAME)


def _frame() -> dict[str, Any]:
    """The frame of the checked-in store's manifest stored in parts (SPEC.md, section 8.4)."""
    from pathlib import Path

    store = Path(__file__).parent.parent / "data" / "store-v2-parts"
    found = msgpack.unpackb((store / "checkpoints" / "sharded").read_bytes(), raw=False)["manifest"]
    rec = msgpack.unpackb((store / "manifests" / found.hex()).read_bytes(), raw=False)
    return {**rec, "name": NAME}


def test_a_frame_decodes_and_bad_frames_are_refused():
    rec = _frame()
    assert isinstance(decode(rec), Frame)
    one = rec["parts"][0]
    refused({**rec, "layout": bytes(31)}, "its layout is 31 bytes, not 32")
    refused({**rec, "parts": [[one[0], -1, *one[2:]], *rec["parts"][1:]]}, "a size outside")
    refused({**rec, "parts": [[one[0][:31], *one[1:]], *rec["parts"][1:]]}, "a 31-byte digest")
    refused({**rec, "parts": [one, one, 3]}, "a part should be")
    refused({**rec, "parts": [one[:2], *rec["parts"][1:]]}, "a part should be")
    leaves = len(np.frombuffer(rec["leaves"], LEAF_DTYPE))
    for first, end in ((2, 1), (-1, 1), (0, leaves + 1)):
        refused({**rec, "parts": [[*one[:2], first, end], *rec["parts"][1:]]}, "are not a range")
    refused({**rec, "parts": [one] * (MAX_PARTS + 1)}, f"over the limit of {MAX_PARTS}")
    in_pieces = int(np.flatnonzero(np.frombuffer(rec["leaves"], LEAF_DTYPE)["flags"] & IN_PIECES)[0])
    refused(edited(rec, "leaves", "chunks", 1, in_pieces), "1 chunk refs stored for 2")
    refused({**rec, "piece_counts": np.ones(1, "<u4").tobytes()}, "lists pieces or chunk refs")
    refused({**rec, "parts": [], "layout": b""}, "its shape needs")  # a frame alone is not a manifest


def test_columns_say_what_each_leaf_is_and_whether_two_are_of_one_type():
    """What the layers above ask of a manifest's leaves: array or Python scalar, the kind, the
    dtype's name, a value per dtype, and whether two leaves are of one type as a diff tells
    types (numpy and jax arrays of one dtype alike; PRNG implementations and scalar kinds not)."""
    tree = {
        "a": np.zeros(3, np.float32),
        "b": jnp.ones(2, jnp.bfloat16),
        "c": jax.random.key(0),
        "d": jax.random.key(0, impl="rbg"),
        "e": 3,
        "f": 1.5,
        "g": jnp.zeros(3, jnp.float32),
    }
    treestore.save("memory://columns/what", tree, "c")
    c = treestore.open("memory://columns/what#c")._columns
    at = {a: i for i, a in enumerate(c.addresses)}
    assert [bool(c.is_array[at[k]]) for k in "abcdefg"] == [True] * 4 + [False, False, True]
    assert [c.kind(at[k]) for k in "abefg"] == ["numpy", "jax", "int", "float", "jax"]
    assert sorted(c.addresses[i] for i in np.flatnonzero(c.of_kind("jax"))) == ["b", "g"]
    assert [c.dtype_name(at[k]) for k in "abg"] == ["float32", "bfloat16", "float32"]
    floating = c.by_dtype(lambda name: "float" in name) & c.is_array
    assert sorted(c.addresses[i] for i in np.flatnonzero(floating)) == ["a", "b", "g"]
    pairs = [("a", "g"), ("a", "b"), ("c", "d"), ("c", "c"), ("e", "f"), ("e", "e"), ("a", "e")]
    ia = np.array([at[x] for x, _ in pairs])
    ib = np.array([at[y] for _, y in pairs])
    assert c.same_types(ia, c, ib).tolist() == [True, False, False, True, False, True, False]
