"""Unknown codecs, dtypes, leaf kinds, PRNG implementations, node types and format versions.

Something this treestore does not know must be an error (UnsupportedFormatError where the store
may simply be newer, ManifestDamagedError or ChunkDamagedError where it cannot be valid), never a
guess; and data the store declares must not reach numpy or jax in a form they reject.
"""

from __future__ import annotations

import struct

import pytest

import treestore
from treestore._format import codecs as _codecs

from ..support import hostile
from ._harness import errors

READ_CHUNKS = ["load", "open", "verify", "diff"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("codec", [3, 4, 127, 128, 255])
def test_unknown_chunk_codec(store, codec):
    path = store.chunk_file("w")
    data = bytearray(path.read_bytes())
    data[4] = codec
    path.write_bytes(bytes(data))
    out = store.check(ops=READ_CHUNKS)
    assert errors(out) == dict.fromkeys(["load", "open", "diff"], errors(out)["load"])
    err = out["load"].error
    assert isinstance(err, (treestore.errors.ChunkDamagedError, treestore.UnsupportedFormatError))
    assert err.address == "w" and f"codec id {codec}" in str(err)
    assert out["verify"].value.problems[0].address == "w"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("magic", [b"TSC2", b"TSC0", b"\0\0\0\0", b"PK\3\4", b"\x80\x04\x95\0"])
def test_unknown_chunk_magic(store, magic):
    path = store.chunk_file("w")
    path.write_bytes(magic + path.read_bytes()[4:])
    out = store.check(ops=READ_CHUNKS)
    assert isinstance(out["load"].error, treestore.errors.ChunkDamagedError)
    assert out["load"].error.address == "w"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "dtype",
    [
        "object",
        "O",
        "<f4",
        ">i4",
        "float128",
        "complex256",
        "V8",
        "S10",
        "U3",
        "datetime64[ns]",
        "timedelta64",
        "numpy.float32",
        "float32 ",
        "FLOAT32",
        "float32\x00",
        "os.system",
        "builtins.eval",
        "",
        "f" * 10_000,
    ],
)
def test_unknown_dtype(store, dtype):
    store.mutate_manifest(hostile.set_leaf("w", dtype=dtype))
    out = store.check(ops=["manifest", "load", "verify", "list"])
    assert isinstance(out["load"].error, treestore.UnsupportedFormatError), errors(out)
    assert out["load"].error.address == "w"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["pickle", "object", "numpy.ndarray", "Array", "NUMPY", "", "jax "])
def test_unknown_leaf_kind(store, kind):
    store.mutate_manifest(hostile.set_leaf("w", kind=kind))
    out = store.check(ops=["load", "verify"])
    assert isinstance(
        out["load"].error, (treestore.UnsupportedFormatError, treestore.errors.ManifestDamagedError)
    )


@pytest.mark.timeout(30)
@pytest.mark.parametrize("impl", ["threefry", "rbg2", "os.system", "", None, 7, ["threefry2x32"]])
def test_unknown_prng_impl(store, impl):
    store.mutate_manifest(hostile.set_leaf("key", prng_impl=impl))
    out = store.check(ops=["load", "verify"])
    assert isinstance(
        out["load"].error, (treestore.UnsupportedFormatError, treestore.errors.ManifestDamagedError)
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("address", "fields"),
    [
        # key data of the wrong shape or dtype for its PRNG implementation
        ("key", {"prng_impl": "rbg"}),  # rbg keys are 4 uint32, threefry ones 2
        ("ids", {"kind": "prng_key", "prng_impl": "threefry2x32"}),  # int32 data, 1-d of 40000
        ("w", {"kind": "prng_key", "prng_impl": "threefry2x32"}),  # float32 key data
        ("small/s", {"kind": "prng_key", "prng_impl": "unsafe_rbg"}),  # 0-d
    ],
)
def test_prng_key_data_that_jax_rejects(store, address, fields):
    """The dtype and shape of a typed key's data are fixed by its implementation; a store that
    declares others must get a TreestoreError, not jax's TypeError."""
    store.mutate_manifest(hostile.set_leaf(address, **fields))
    out = store.check(ops=["load", "open", "diff"])
    for op in ("load", "open"):
        assert out[op].error is not None, f"{op} restored a key from data its impl cannot hold"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "dtype",
    ["int2", "uint2", "int4", "uint4", "float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn", "float8_e8m0fnu"],
)
def test_jax_kind_with_a_dtype_jax_may_not_support(store, dtype):
    """A leaf of kind "jax" with a dtype jax cannot hold: restored, or refused with a
    TreestoreError; never an XLA error."""
    store.mutate_manifest(hostile.set_leaf("ids", kind="jax", dtype=dtype, shape=[160_000]))
    store.check(ops=["load", "open", "diff"])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("node_type", ["pickle", "set", "frozenset", "object", "module", "DICT", "", "leaf "])
def test_unknown_tree_node_type(store, node_type):
    def change(m):
        m["tree"]["children"][6]["type"] = node_type  # the node at "list"

    store.mutate_manifest(change)
    out = store.check(ops=["load", "verify"])
    assert isinstance(
        out["load"].error, (treestore.UnsupportedFormatError, treestore.errors.ManifestDamagedError)
    )


@pytest.mark.timeout(30)
@pytest.mark.parametrize("version", [3, 99, 2**31, 2**63 - 1, 2**64 - 1])
@pytest.mark.parametrize("where", ["manifest", "record"])
def test_format_version_from_the_future(store, version, where):
    if where == "manifest":
        store.mutate_manifest(lambda m: m.update(version=version))
    else:
        store.write_ref({**store.ref_record(), "version": version})
    out = store.check(ops=["list", "load", "verify"] if where == "record" else ["load", "verify"])
    err = out["load"].error
    assert isinstance(err, treestore.UnsupportedFormatError), errors(out)
    assert f"version {version}" in str(err) and "upgrade treestore" in str(err)
    problems = out["verify"].value.problems
    assert problems and problems[0].kind == "unsupported", problems


@pytest.mark.timeout(30)
@pytest.mark.parametrize("version", [0, -1, -(2**63), 1.0, True, "1", None, [1]])
@pytest.mark.parametrize("where", ["manifest", "record"])
def test_format_version_that_never_existed(store, version, where):
    if where == "manifest":
        store.mutate_manifest(lambda m: m.update(version=version))
    else:
        store.write_ref({**store.ref_record(), "version": version})
    out = store.check(ops=["load", "verify"])
    assert isinstance(
        out["load"].error, (treestore.UnsupportedFormatError, treestore.errors.ManifestDamagedError)
    )


@pytest.mark.timeout(30)
@pytest.mark.parametrize("width", [0, 1, 3, 9, 16, 255])
def test_bad_byte_plane_width(store, width):
    path = store.chunk_file("w")
    data = bytearray(path.read_bytes())
    assert data[4] == _codecs.PLANES
    data[5] = width
    path.write_bytes(bytes(data))
    out = store.check(ops=READ_CHUNKS)
    assert isinstance(out["load"].error, treestore.errors.ChunkDamagedError)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("field", ["width", "mask"])
@pytest.mark.parametrize("leaf", ["ids", "small/a"])  # zstd and raw chunks: both fields must be 0
def test_plane_fields_of_a_chunk_without_planes(store, field, leaf):
    """SPEC section 4: the plane width and mask are 0 unless the codec is 2. A reader that ignores
    them lets a changed byte go undetected (the data still decodes)."""
    path = store.chunk_file(leaf)
    data = bytearray(path.read_bytes())
    assert data[4] in (_codecs.RAW, _codecs.ZSTD) and data[5:8] == b"\0\0\0"
    if field == "width":
        data[5] = 4
    else:
        struct.pack_into("<H", data, 6, 0x5)
    path.write_bytes(bytes(data))
    out = store.check(ops=["load", "verify"])
    assert isinstance(out["load"].error, treestore.errors.ChunkDamagedError), (
        "a non-canonical chunk header was accepted"
    )


def test_a_version_1_leaf_whose_shape_its_chunks_do_not_hold(store):
    """Version 1: a leaf's shape one element larger than its chunks hold is refused by every
    reader, naming the leaf and both sizes (never a read past the data)."""
    store.mutate_manifest(hostile.set_leaf("ids", shape=[40_001]))
    out = store.check(ops=["manifest", "load", "open", "verify"])
    for op in ("manifest", "load", "open"):
        error = out[op].error
        assert isinstance(error, treestore.errors.ManifestDamagedError), errors(out)
        assert "leaf ids" in str(error) and "needs 160004 bytes, chunks hold 160000" in str(error)
    assert not out["verify"].value.ok
