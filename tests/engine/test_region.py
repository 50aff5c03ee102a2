"""Reading boxes of a leaf saved in pieces: every box, whatever the pieces, the chunks and the
box have in common, comes back exactly.

The case that matters most is a box that cuts across a piece's rows (a leaf sharded along a later
axis, restored onto other devices): each chunk is decoded in its thread's scratch and its rows
placed straight into the result, a row split between two chunks gathered on the side.
"""

from __future__ import annotations

import itertools
import uuid
from collections import Counter
from typing import Any

import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import treestore
from tests.support.jobs import prepared
from treestore._api.checkpoint import Checkpoint
from treestore._engine.reading import read as _read
from treestore._engine.reading.committed import read_columns, read_commit_record
from treestore._engine.write import SaveOptions, write
from treestore._storage.registry import open_storage

SHAPES = st.sampled_from([(12, 40), (7, 9, 33), (5, 300), (64, 3, 2), (1, 2000)])


def _cuts(draw: Any, n: int) -> list[int]:
    inner = draw(st.sets(st.integers(1, n - 1), max_size=3)) if n > 1 else set()
    return [0, *sorted(inner), n]


@st.composite
def saved_in_pieces(draw: Any) -> tuple[np.ndarray, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """A leaf and a grid of boxes tiling it (cut along any axes)."""
    shape = draw(SHAPES)
    dtype = draw(st.sampled_from(["float32", "int16", "float64"]))
    value = np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
    grids = [_cuts(draw, n) for n in shape]
    boxes = [((), ())]
    for cuts in grids:
        boxes = [
            ((*start, a), (*extent, b - a)) for start, extent in boxes for a, b in itertools.pairwise(cuts)
        ]
    return value, boxes


@settings(max_examples=60, deadline=None)
@given(case=saved_in_pieces(), data=st.data(), small=st.booleans())
def test_every_box_of_a_leaf_saved_in_pieces_reads_back_exactly(case, data, small):
    value, boxes = case
    storage = open_storage(f"memory://region-{uuid.uuid4().hex}")
    # Chunks of 4 KiB split rows wherever they fall; with ``small``, pieces up to 4 KiB are packed.
    options = SaveOptions(chunk_size=4096, small_leaf=4096 if small else 0, threads=2)
    write(storage, prepared({"x": value}, {"x": [boxes]}, 0), "c", options=options)
    columns = read_columns(storage, read_commit_record(storage, "c"))
    leaf = Checkpoint(storage, columns)["x"]
    for _ in range(4):
        region = []
        for n in value.shape:
            a = data.draw(st.integers(0, n - 1))
            region.append(slice(a, data.draw(st.integers(a + 1, n))))
        np.testing.assert_array_equal(leaf.region(tuple(region)), value[tuple(region)])
    np.testing.assert_array_equal(np.asarray(leaf), value)


def test_a_chunk_two_regions_meet_is_fetched_once(monkeypatch):
    """One process restoring a leaf saved whole onto two devices: its one chunk is fetched and
    decoded once, not once per device's region."""
    value = np.random.default_rng(0).standard_normal((256, 64)).astype(np.float32)
    url = f"memory://share-plan/{uuid.uuid4().hex}"
    treestore.save(url, {"w": value}, "c")
    fetched = Counter()
    real = _read.fetch_object

    def counted(storage, c):
        fetched[c.digest] += 1
        return real(storage, c)

    monkeypatch.setattr(_read, "fetch_object", counted)
    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    for spec in (P("model"), P(None, "model")):
        fetched.clear()
        like = {"w": jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=NamedSharding(mesh, spec))}
        out = treestore.load(url, "c", like=like)["w"]
        assert np.asarray(out).tobytes() == value.tobytes()
        assert list(fetched.values()) == [1], spec
