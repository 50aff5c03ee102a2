"""Writers and readers keep to one definition of every bound (treestore/_format/limits.py).

Each bound is checked at its edge from both sides: what a writer produces at the limit a reader
accepts, and one step past it the writer refuses what the reader would refuse.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import treestore
from treestore._format import dtypes, limits
from treestore._format.manifest import rules as manifest


def files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    "value",
    [
        limits.INT_START - 1,
        limits.INT_END,
        10**limits.MAX_INT_DIGITS - 1,  # 4300 digits
        -(10 ** (limits.MAX_INT_DIGITS - 1) - 1),  # a sign and 4299 digits
    ],
    ids=["-2**63-1", "2**64", "4300-digits", "minus-4299-digits"],
)
def test_int_text_at_the_limit_is_written_and_read(value):
    record = dtypes.int_to_record(value)
    assert record == str(value) and len(record) <= limits.MAX_INT_DIGITS
    assert dtypes.int_from_record(record) == value


@pytest.mark.parametrize(
    "value",
    [10**limits.MAX_INT_DIGITS, -(10 ** (limits.MAX_INT_DIGITS - 1)), 10**9000],
    ids=["10**4300", "-10**4299", "10**9000"],  # pytest's own ids would str() them
)
def test_int_text_past_the_limit_is_refused_by_the_writer(value):
    with pytest.raises(ValueError, match="at most 4300 characters"):
        dtypes.int_to_record(value)


@pytest.mark.parametrize(
    "text",
    [
        "007",
        "+18446744073709551616",
        " 18446744073709551616",
        "18_446_744_073_709_551_616",
        "5",
        "-0",
        "١٨٤٤٦٧٤٤٠٧٣٧٠٩٥٥١٦١٦",
        "9" * (limits.MAX_INT_DIGITS + 1),
    ],
    ids=["zeros", "plus", "space", "underscores", "in-range", "minus-zero", "arabic", "4301-digits"],
)
def test_int_text_a_writer_never_writes_is_refused_by_the_reader(text):
    """Only canonical decimal text of an int outside the msgpack range: int() alone would accept
    signs, spaces, underscores and non-ASCII digits."""
    with pytest.raises(ValueError):
        dtypes.int_from_record(text)


@pytest.mark.parametrize(
    ("shape", "ok"),
    [
        ((0, limits.MAX_DIM), True),
        ((0, limits.MAX_DIM + 1), False),
        ((1,) * limits.MAX_NDIM, True),
        ((1,) * (limits.MAX_NDIM + 1), False),
        ((2**31, 2**31), True),  # 2**62 one-byte elements
        ((2**31, 2**32), False),  # 2**63
        ((-1,), False),
    ],
)
def test_one_shape_check_for_writers_and_readers(shape, ok):
    if ok:
        assert manifest.check_shape(shape, 1) == shape
    else:
        with pytest.raises(ValueError):
            manifest.check_shape(shape, 1)


def test_manifest_over_the_limit_is_refused_before_the_manifest_is_written(tmp_path, monkeypatch):
    """The Python scalars alone fit (prepare lets the save start), but the manifest as encoded,
    chunk refs included, is over the limit: the save fails before writing the manifest or the
    commit record, leaving only unreferenced chunks, and the store stays readable."""
    url = tmp_path / "store"
    treestore.save(url, {"base": np.arange(4.0)}, "base")
    before = files(url)
    monkeypatch.setattr(manifest, "MAX_MANIFEST_BYTES", 12 * 1024)  # the one size check, every version
    tree = {"text": "x" * 8000, "w": np.arange(4096 * 100, dtype=np.float32)}  # 100 chunks
    options = treestore.SaveOptions(chunk_size=4096, small_leaf=1024)
    with pytest.raises(treestore.InvalidInputError, match="manifest of checkpoint 'c' would be"):
        treestore.Store(url).save(tree, "c", options=options)
    monkeypatch.undo()
    new = files(url) - before
    assert new and all(f.startswith("chunks/") for f in new), sorted(new)[:5]
    assert [c.name for c in treestore.Store(url).list()] == ["base"]
    assert treestore.verify(url).ok
    assert treestore.load(url, "base")["base"].tolist() == [0.0, 1.0, 2.0, 3.0]


READERS = {
    "manifest": lambda url: treestore.Store(url).manifest("big").tree,  # a view: made when read
    "load": lambda url: treestore.load(url + "#big"),
    "open().tree": lambda url: treestore.open(url + "#big").tree,
    "open().manifest": lambda url: treestore.open(url + "#big").manifest.tree,
    "verify": lambda url: treestore.verify(url + "#big"),
    "copy": lambda url: treestore.copy(url + "#big", url + "-copy"),
    "diff": lambda url: treestore.diff(url + "#big", url + "#big"),
}


@pytest.mark.parametrize("reader", sorted(READERS))
def test_running_out_of_memory_past_the_decoder_names_the_checkpoint(store_url, monkeypatch, reader):
    """A big manifest (400k leaves) can fit its decoder's bounds and still not fit in memory
    when its objects and tree are made: wherever a reader then runs out, the caller gets
    OutOfMemoryError naming the checkpoint, not a bare MemoryError. Running out is simulated
    where each reader builds per-leaf objects (a real limit makes Python's own handling of a
    MemoryError, before treestore sees it, fail at random places); verify and copy build none,
    and run out where they group a manifest's chunk refs by object."""
    treestore.save(store_url, {"w": np.zeros(3), "n": 1}, "big")

    def out_of_memory(*args, **kwargs):
        raise MemoryError

    from treestore._api.inspection import diff as diff_module
    from treestore._engine import objects
    from treestore._format.manifest.tree import Nodes

    monkeypatch.setattr(Nodes, "tree_record", out_of_memory)
    monkeypatch.setattr(Nodes, "addresses", out_of_memory)
    monkeypatch.setattr(diff_module, "diff_checkpoints", out_of_memory)
    monkeypatch.setattr(objects, "ChunkObject", out_of_memory)
    with pytest.raises(treestore.errors.OutOfMemoryError) as caught:
        READERS[reader](store_url)
    assert caught.value.checkpoint == "big" or "'big'" in str(caught.value), str(caught.value)
    assert "out of memory" in str(caught.value)


def test_copy_and_verify_running_out_of_memory_on_chunks_name_the_checkpoint(tmp_path, monkeypatch):
    """Out of memory while copying or verifying chunk objects (a pack's members listed, a chunk
    decoded) is OutOfMemoryError naming what was being done, never a bare MemoryError; copy
    commits nothing."""
    from treestore._engine import objects

    url = str(tmp_path / "s")
    treestore.save(url, {"w": np.arange(4096, dtype=np.float32), "n": np.ones(3)}, "big")

    def out_of_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(objects.ChunkObject, "members", out_of_memory)
    with pytest.raises(treestore.errors.OutOfMemoryError, match="out of memory copying checkpoint 'big'"):
        treestore.copy(url + "#big", url + "-copy")
    assert treestore.Store(url + "-copy").list() == []
    with pytest.raises(treestore.errors.OutOfMemoryError, match="out of memory verifying the chunks"):
        treestore.verify(url + "#big")


@pytest.mark.parametrize("reader", ["copy", "verify"])
def test_copy_and_verify_threads_that_cannot_start_are_out_of_memory(tmp_path, monkeypatch, reader):
    """Under an address-space limit no thread can be made: copy and verify raise
    OutOfMemoryError, not the executor's bare RuntimeError."""
    import threading

    url = str(tmp_path / "s")
    treestore.save(url, {"w": np.arange(8192, dtype=np.float32), "v": np.ones(8192)}, "big")

    def refuse(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(treestore.errors.OutOfMemoryError, match=f"cannot start 7 {reader} thread"):
        if reader == "copy":
            treestore.copy(url + "#big", url + "-copy", threads=7)
        else:
            treestore.verify(url + "#big", threads=7)


def test_verify_out_of_memory_reading_a_manifest_is_raised_not_reported_as_damage(tmp_path, monkeypatch):
    """A manifest too big for this process's memory says nothing about the store: verify raises
    OutOfMemoryError instead of reporting the checkpoint's manifest as damaged."""
    from treestore._api import verify as verify_module

    url = str(tmp_path / "s")
    treestore.save(url, {"w": np.ones(3)}, "big")

    def out_of_memory(storage, record, data=None):
        raise treestore.errors.OutOfMemoryError("manifest of checkpoint 'big': out of memory decoding it")

    monkeypatch.setattr(verify_module._committed, "read_columns", out_of_memory)
    with pytest.raises(treestore.errors.OutOfMemoryError, match="'big'"):
        treestore.verify(url)
