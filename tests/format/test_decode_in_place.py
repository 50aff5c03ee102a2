"""Big chunks read from a local store are decoded in the read buffer itself (byte planes
unshuffled from where they were read): the result, and every error on a damaged object, is the
same as decoding a copy of the object."""

from __future__ import annotations

import os
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import treestore
from treestore._format import codecs as C
from treestore._format.paths import chunk_path
from treestore._kernels import planes
from treestore.errors import ChunkDamagedError

SIZE = 256 * 1024  # a chunk as big as the in-place path starts at


def weights(dtype: Any, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = SIZE // np.dtype(dtype).itemsize
    return (rng.standard_normal(n) * 0.02).astype(dtype)


def chunk(raw: np.ndarray) -> bytes:
    data = raw.reshape(-1).view(np.uint8)
    return b"".join(bytes(b) for b in C.encode(data, C.plane_width(raw.dtype), C.Codec()))


def in_place(obj: bytes, size: int) -> np.ndarray:
    room = np.zeros(C.in_place_room(size), np.uint8)
    room[: len(obj)] = np.frombuffer(obj, np.uint8)
    out = np.empty(size, np.uint8)
    C.decode_in_place(room, len(obj), out)
    return out


def from_copy(obj: bytes, size: int) -> np.ndarray:
    out = np.empty(size, np.uint8)
    C.decode_into(obj, out)
    return out


CASES = {
    "float32": weights(np.float32),  # exponent plane compressed, mantissa planes raw
    "bfloat16": weights(ml_dtypes.bfloat16),
    "float64": weights(np.float64),
    "zeros": np.zeros(SIZE // 4, np.float32),  # every plane compressed
    "noise": np.random.default_rng(1).integers(0, 2**32, SIZE // 4, dtype=np.uint32).view(np.float32),
    "ints": np.arange(SIZE // 8, dtype=np.int64),  # one zstd frame, no planes
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_decoding_in_place_gives_the_raw_bytes(case):
    raw = CASES[case]
    obj = chunk(raw)
    assert np.array_equal(in_place(obj, raw.nbytes), raw.reshape(-1).view(np.uint8))


@pytest.mark.parametrize("case", ["float32", "bfloat16", "zeros"])
def test_weights_take_the_in_place_path(case, monkeypatch):
    """The planes of weights are raw below the compressed exponent plane, which is what the
    path needs: it decodes them without falling back to decoding a copy."""
    if not planes.joined_fast(CASES[case].dtype.itemsize):
        pytest.skip("planes of this width are joined plane by plane here (no compiled part): not in place")
    obj = chunk(CASES[case])
    monkeypatch.setattr(C, "decode_into", lambda *a: pytest.fail("fell back to decode_into"))
    assert np.array_equal(in_place(obj, SIZE), CASES[case].reshape(-1).view(np.uint8))


def _outcome(fn: Any, obj: bytes, size: int) -> Any:
    try:
        return fn(obj, size).tobytes()
    except ChunkDamagedError:
        return ChunkDamagedError


@settings(max_examples=200, deadline=None)
@given(
    case=st.sampled_from(["float32", "bfloat16", "zeros"]),
    edits=st.lists(st.tuples(st.integers(0, 2**31), st.integers(0, 255)), min_size=1, max_size=4),
    cut=st.one_of(st.none(), st.integers(0, 2**31)),
    extra=st.binary(max_size=16),
)
def test_a_damaged_object_fails_exactly_as_a_copy_of_it_does(case, edits, cut, extra):
    raw = CASES[case]
    obj = bytearray(chunk(raw))
    for at, value in edits:  # most edits land in the header and the plane table
        obj[at % min(len(obj), 64) if at % 2 else at % len(obj)] = value
    if cut is not None:
        obj = obj[: cut % (len(obj) + 1)]
    damaged = bytes(obj) + extra
    assert _outcome(in_place, damaged, raw.nbytes) == _outcome(from_copy, damaged, raw.nbytes)


def test_a_big_chunk_damaged_on_disk_is_refused_naming_its_leaf(tmp_path):
    url = str(tmp_path / "s")
    w = weights(np.float32, seed=2)
    treestore.save(url, {"w": w}, "c", options=treestore.SaveOptions(chunk_size=SIZE))
    ref = treestore.Store(url).manifest("c").leaves[0].chunks[0]
    path = os.path.join(url, chunk_path(ref.digest))
    with open(path, "rb") as f:
        data = bytearray(f.read())
    data[100] ^= 0xFF  # a raw mantissa byte: decodes, but to other bytes
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(ChunkDamagedError, match=r"^w: chunk .* does not match its digest"):
        treestore.load(url, "c")
