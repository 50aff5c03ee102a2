"""Exports at their edges: the key names a tree's paths give (attributes, bool and clashing
keys), progress reports, a destination folder that is missing, and what an orbax export replaces
(a file, or the folder an export killed half-way left)."""

from __future__ import annotations

import collections
import os
import uuid

import numpy as np
import pytest
import safetensors.numpy

import treestore

Pair = collections.namedtuple("Pair", "a b")


def memory() -> str:
    return f"memory://treestore-tests/{uuid.uuid4().hex}"


def test_attribute_keys_are_key_names(tmp_path):
    url = memory()
    treestore.save(url, {"p": Pair(np.arange(3.0), np.ones(2, np.int32))}, "c")
    file = tmp_path / "w.safetensors"
    r = treestore.export_file(f"{url}#c", file)
    assert r.tensors == 2
    back = safetensors.numpy.load_file(str(file))
    assert sorted(back) == ["p.a", "p.b"] and np.array_equal(back["p.a"], np.arange(3.0))


@pytest.mark.parametrize(
    ("tree", "problem"),
    [
        ({"x": {True: np.ones(2)}}, "x/{true}: a key of this path cannot be a key name (bool or index key)"),
        ({"x": {1: np.ones(2), "1": np.zeros(2)}}, "would get the same key name"),
    ],
    ids=["bool-key", "clashing-keys"],
)
def test_paths_that_make_no_key_name_are_refused(tmp_path, tree, problem):
    url = memory()
    treestore.save(url, tree, "c")
    file = tmp_path / "w.safetensors"
    with pytest.raises(treestore.InvalidInputError) as caught:
        treestore.export_file(f"{url}#c", file)
    assert str(caught.value).startswith("cannot export 1 leaves:\n  ") and problem in str(caught.value)
    assert not file.exists() and list(tmp_path.iterdir()) == []


def test_an_export_into_a_missing_folder_is_refused(tmp_path):
    url = memory()
    treestore.save(url, {"w": np.ones(2)}, "c")
    with pytest.raises(treestore.NotFoundError, match=r"^no folder '.*nope' to write 'w.npz' in$"):
        treestore.export_file(f"{url}#c", tmp_path / "nope" / "w.npz")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fmt", ["npz", "orbax"])
def test_an_export_reports_its_progress(tmp_path, fmt):
    if fmt == "orbax":
        pytest.importorskip("orbax.checkpoint")
    url = memory()
    tree = {"a": np.arange(1000.0), "b": np.ones(10, np.int16)}
    treestore.save(url, tree, "c")
    seen: list[tuple[int, int]] = []
    out = tmp_path / ("w.npz" if fmt == "npz" else "o")
    treestore.export_file(f"{url}#c", out, format=fmt, progress=lambda d, t: seen.append((d, t)))
    total = tree["a"].nbytes + tree["b"].nbytes
    assert seen[-1] == (total, total) and [d for d, _ in seen] == sorted(d for d, _ in seen), seen


def test_an_orbax_export_replaces_a_file_and_a_killed_export_s_folder(tmp_path):
    """``overwrite=True`` replaces a file at the destination with the orbax folder; a temporary
    folder a killed export of this process id left is removed first."""
    orbax = pytest.importorskip("orbax.checkpoint")
    url = memory()
    treestore.save(url, {"w": np.arange(4.0)}, "c")
    out = tmp_path / "o"
    out.write_bytes(b"an old file")
    left = tmp_path / f".o.tmp-{os.getpid()}"
    (left / "half").mkdir(parents=True)
    (left / "half" / "written").write_bytes(b"x")
    with pytest.raises(treestore.InvalidInputError, match=r"o' exists; pass overwrite=True"):
        treestore.export_file(f"{url}#c", out, format="orbax")
    assert out.read_bytes() == b"an old file"
    treestore.export_file(f"{url}#c", out, format="orbax", overwrite=True)
    assert out.is_dir() and sorted(p.name for p in tmp_path.iterdir()) == ["o"]
    with orbax.StandardCheckpointer() as checkpointer:
        assert np.array_equal(checkpointer.restore(out)["w"], np.arange(4.0))


def test_an_orbax_checkpoint_s_custom_metadata_beyond_what_a_store_keeps_is_left_out(tmp_path):
    """orbax's ``custom_metadata`` comes along with an import; one over the metadata bound of a
    checkpoint, or a metadata file that is no JSON, is left out and the tree still imported."""
    ocp = pytest.importorskip("orbax.checkpoint")
    import json

    ckpt = tmp_path / "ck"
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(ckpt, {"w": np.arange(3.0)}, custom_metadata={"note": "hi"})
    url = memory()
    treestore.import_file(ckpt, f"{url}#kept")
    assert treestore.open(url, "kept").metadata["source"]["custom_metadata"] == {"note": "hi"}
    meta_file = ckpt / "_CHECKPOINT_METADATA"
    meta = json.loads(meta_file.read_text())
    for name, text in (
        ("too-big", json.dumps({**meta, "custom_metadata": {"note": "x" * (2**20 + 10)}})),
        ("not-json", "{not json"),
    ):
        meta_file.write_text(text)
        treestore.import_file(ckpt, f"{url}#{name}")
        assert "custom_metadata" not in treestore.open(url, name).metadata["source"], name
        assert np.array_equal(treestore.load(url, name)["w"], np.arange(3.0)), name
