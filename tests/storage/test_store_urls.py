"""A store given by a plain local path opens without fsspec, at the root fsspec's local
filesystem gives that path, and is the same store as its ``file://`` spelling."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest

import treestore
from treestore._storage.local import LocalStorage
from treestore._storage.registry import local_root, open_storage

SPELLINGS = ["store", "store/", "./store", "a/../store", "a//store", "a/./store", ".", "./"]


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_a_plain_path_opens_at_the_root_fsspec_gives_it(spelling, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    storage = open_storage(spelling)
    assert isinstance(storage, LocalStorage) and storage._fs is None  # no filesystem object yet
    assert storage.root == fsspec.core.url_to_fs(spelling)[1].rstrip("/")
    assert local_root(spelling) == fsspec.core.url_to_fs(spelling)[1]
    as_url = open_storage("file://" + os.path.abspath(spelling))
    assert storage.location() == as_url.location() and storage.overlaps(as_url)


@pytest.mark.parametrize("spelling", ["~", "~/store", "/", "/tmp/x/"])
def test_absolute_and_home_paths_match_fsspec(spelling):
    assert local_root(spelling) == fsspec.core.url_to_fs(spelling)[1]


@pytest.mark.parametrize("url", ["file:///tmp/x", "local:///tmp/x", "memory://x", "data:x", "a::b"])
def test_urls_are_left_to_fsspec(url):
    assert local_root(url) is None


def test_what_needs_the_filesystem_object_makes_it_on_first_use(tmp_path: Path):
    url = str(tmp_path / "s")
    treestore.save(url, {"w": np.arange(3.0)}, "c")
    storage = open_storage(url)
    assert storage._fs is None
    assert storage.exists("checkpoints/c") and not storage.exists("checkpoints/d")  # fsspec's exists
    assert storage._fs is not None and storage.protocol == "file"
    np.testing.assert_array_equal(treestore.load(url, "c")["w"], np.arange(3.0))


def test_checkpoint_arguments_of_the_wrong_form_are_refused_naming_the_forms(tmp_path):
    """A checkpoint is URL, URL#NAME or (URL, NAME): a pair of the wrong shape, another type, or
    a name given twice that disagrees are InvalidInputErrors that say so; a name given twice
    that agrees is fine."""
    url = str(tmp_path / "s")
    treestore.save(url, {"w": np.arange(3.0)}, "a")
    for bad in ((url, 5), (url,), (url, "a", "b"), (5, "a")):
        with pytest.raises(treestore.InvalidInputError, match=r"URL, URL#NAME or \(URL, NAME\), got \("):
            treestore.load(bad)  # type: ignore[arg-type]
    with pytest.raises(treestore.InvalidInputError, match="got int"):
        treestore.load(42)  # type: ignore[arg-type]
    with pytest.raises(treestore.InvalidInputError, match=r"named twice: 'a' in .*#\.\.\. and 'b'"):
        treestore.open(f"{url}#a", "b")
    assert treestore.open(f"{url}#a", "a").name == "a" and treestore.open((url, "a")).name == "a"


def test_save_takes_every_checkpoint_form_that_load_takes(tmp_path):
    """``save`` names its checkpoint as ``load`` does: ``URL, NAME``, ``URL#NAME`` or
    ``(URL, NAME)``; without a name, or with two that disagree, it refuses before writing."""
    url = str(tmp_path / "s")
    treestore.save(url, {"w": np.arange(3.0)}, "a")
    treestore.save(f"{url}#b", {"w": np.arange(4.0)})
    treestore.save((url, "c"), {"w": np.arange(5.0)})
    treestore.save(f"{url}#d", {"w": np.arange(6.0)}, "d")
    assert [len(treestore.load(f"{url}#{n}")["w"]) for n in "abcd"] == [3, 4, 5, 6]
    with pytest.raises(treestore.InvalidInputError, match=r"save needs a checkpoint name: .*#NAME"):
        treestore.save(url, {"w": np.arange(3.0)})
    with pytest.raises(treestore.InvalidInputError, match=r"named twice: 'e' in .*#\.\.\. and 'f'"):
        treestore.save(f"{url}#e", {"w": np.arange(3.0)}, "f")
    assert [info.name for info in treestore.Store(url).list()] == ["a", "b", "c", "d"]


@pytest.mark.parametrize(
    ("url", "message"),
    [(7, r"^a store URL is a str or path, got int$"), ("", r"^a store URL cannot be empty$")],
)
def test_a_store_url_that_is_not_one_is_refused(url, message):
    with pytest.raises(treestore.InvalidInputError, match=message):
        treestore.Store(url)


def test_a_chained_url_opens_the_store_through_its_layers():
    """``simplecache::memory://...``: fsspec's layers over the store's filesystem (the outermost
    names the protocol); what is saved through them is in the store below."""
    below = f"memory://treestore-tests/chain-{uuid.uuid4().hex}"
    treestore.save(below, {"w": np.arange(3.0)}, "c")
    chained = treestore.Store(f"simplecache::{below}")
    assert np.array_equal(chained.load("c")["w"], np.arange(3.0))
    chained.save({"w": np.ones(2)}, "d")
    assert [c.name for c in treestore.Store(below).list()] == ["c", "d"]


def test_a_chained_url_over_a_local_path_reads_the_store(tmp_path):
    """``simplecache::/path``: a chain whose last layer is a plain local path (no ``://``)."""
    treestore.save(str(tmp_path / "s"), {"w": np.arange(3.0)}, "c")
    chained = treestore.Store(f"simplecache::{tmp_path / 's'}")
    assert not isinstance(chained._storage, LocalStorage)  # fsspec's layers, not the local fast path
    assert np.array_equal(chained.load("c")["w"], np.arange(3.0))


@pytest.mark.parametrize(
    ("url", "added"),
    [("s3://b/x", True), ("gs://b/x", True), ("az://c/x", True), ("memory://x", False), ("https://h", False)],
)
def test_storage_options_go_to_fsspec_unchanged_but_for_uncached_listings(url, added, monkeypatch):
    """docs/guides/cloud.md: the one thing treestore adds to ``storage_options`` is
    ``use_listings_cache=False`` for S3, GCS and Azure, unless the caller set it."""
    given: list[dict] = []

    def url_to_fs(url: str, **options: object) -> tuple[object, str]:
        given.append(options)
        raise ValueError("stop here")

    monkeypatch.setattr(fsspec.core, "url_to_fs", url_to_fs)
    for options in ({"anon": True}, {"anon": True, "use_listings_cache": True}):
        with pytest.raises(treestore.errors.InvalidInputError):
            open_storage(url, dict(options))
    expected = {"anon": True, "use_listings_cache": False} if added else {"anon": True}
    assert given == [expected, {"anon": True, "use_listings_cache": True}]
