"""Imported and exported files at the edges of their formats: an .npz member in .npy format 2.0,
a shard that is a dangling link, and the optional packages a format needs when they are absent."""

from __future__ import annotations

import json
import sys
import uuid
import zipfile

import numpy as np
import pytest

import treestore


def memory() -> str:
    return f"memory://treestore-tests/{uuid.uuid4().hex}"


def test_an_npz_member_in_npy_format_2_is_read(tmp_path):
    """np.save writes format 2.0 for a header over 64 KiB; a reader of .npz reads both."""
    file = tmp_path / "w.npz"
    arrays = {"v2": np.arange(12, dtype=np.int16).reshape(3, 4), "v1": np.ones(3)}
    with zipfile.ZipFile(file, "w") as z:
        with z.open("v2.npy", "w") as f:
            np.lib.format.write_array(f, arrays["v2"], version=(2, 0))
        with z.open("v1.npy", "w") as f:
            np.lib.format.write_array(f, arrays["v1"], version=(1, 0))
    url = memory()
    treestore.import_file(file, f"{url}#w")
    back = treestore.load(url, "w")
    for key, array in arrays.items():
        assert back[key].dtype == array.dtype and np.array_equal(back[key], array), key


def test_a_shard_that_is_a_dangling_link_is_refused(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-1.safetensors"}})
    )
    (folder / "model-1.safetensors").symlink_to(tmp_path / "gone.safetensors")
    url = memory()
    with pytest.raises(treestore.UnsupportedFormatError) as caught:
        treestore.import_file(folder, f"{url}#m")
    message = str(caught.value)
    assert message == (
        f"{folder / 'model-1.safetensors'}: expected a regular file, "
        "but cannot stat it: No such file or directory"
    ), message
    assert treestore.Store(url).list() == []


def test_reading_and_writing_flax_msgpack_without_flax_says_what_to_install(tmp_path, monkeypatch):
    pytest.importorskip("flax")
    url = memory()
    treestore.save(url, {"w": np.arange(3.0)}, "c")
    file = tmp_path / "w.msgpack"
    treestore.export_file(f"{url}#c", file)
    monkeypatch.setitem(sys.modules, "flax", None)  # as in an install without it
    with pytest.raises(treestore.UnsupportedFormatError) as caught:
        treestore.import_file(file, f"{url}#back")
    assert str(caught.value) == (
        f"reading the flax msgpack file {file} needs the flax package, "
        "which is not installed: pip install flax"
    )
    with pytest.raises(treestore.UnsupportedFormatError) as caught:
        treestore.export_file(f"{url}#c", tmp_path / "again.msgpack")
    assert str(caught.value) == (
        "writing flax msgpack files needs the flax package, which is not installed: pip install flax"
    )
    assert not (tmp_path / "again.msgpack").exists()
    assert [c.name for c in treestore.Store(url).list()] == ["c"]


def test_writing_safetensors_without_the_package_says_what_to_install(tmp_path, monkeypatch):
    url = memory()
    treestore.save(url, {"w": np.arange(3.0)}, "c")
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
    with pytest.raises(treestore.UnsupportedFormatError) as caught:
        treestore.export_file(f"{url}#c", tmp_path / "w.safetensors")
    assert str(caught.value) == (
        "writing .safetensors files needs the safetensors package, "
        "which is not installed: pip install safetensors"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == []
