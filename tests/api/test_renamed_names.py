"""Errors, result fields and options are named by the SPEC's words; the names they replaced still work,
with a warning."""

from __future__ import annotations

import numpy as np
import pytest

import treestore


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("CorruptionError", "DamagedError"),
        ("ChunkCorruptError", "ChunkDamagedError"),
        ("ManifestCorruptError", "ManifestDamagedError"),
    ],
)
def test_errors_renamed_to_the_spec_word_keep_their_old_names_with_a_warning(old, new):
    import treestore.errors as errors

    with pytest.warns(DeprecationWarning, match=new) as warned:
        cls = getattr(errors, old)
    assert [w.filename for w in warned] == [__file__]
    assert cls is getattr(errors, new)
    if old == "CorruptionError":
        with pytest.warns(DeprecationWarning, match="treestore.DamagedError") as warned:
            assert treestore.CorruptionError is errors.DamagedError
        assert [w.filename for w in warned] == [__file__]  # the caller's line, seen by default
    with pytest.raises(AttributeError):
        errors.NoSuchError  # noqa: B018


def test_result_fields_renamed_to_trusted_keep_their_old_names_with_a_warning():
    store = treestore.Store("memory://names/trusted")
    store.save({"w": np.zeros(9000)}, "a")
    r = store.save({"w": np.zeros(9000)}, "b")
    assert (r.chunks_trusted, r.trusted_from) == (1, "a")
    with pytest.warns(DeprecationWarning, match="chunks_trusted"):
        assert r.chunks_known == 1
    with pytest.warns(DeprecationWarning, match="trusted_from"):
        assert r.known_from == "a"
    treestore.copy("memory://names/trusted", "memory://names/copied", name="a")
    again = treestore.copy("memory://names/trusted", "memory://names/copied", name="b")
    assert again.chunks_trusted == 1
    with pytest.warns(DeprecationWarning, match="chunks_trusted"):
        assert again.chunks_known == again.chunks_trusted


def test_diff_compares_values_and_its_old_stats_names_warn():
    url = "memory://names/diff"
    treestore.save(url, {"w": np.zeros(8)}, "a")
    treestore.save(url, {"w": np.ones(8)}, "b")
    d = treestore.diff(f"{url}#a", f"{url}#b", values=True)
    (w,) = d.leaves
    assert w.change is not None and w.change.max_abs == 1.0
    assert d.to_json()["leaves"][0]["change"]["max_abs"] == 1.0
    with pytest.warns(DeprecationWarning, match="values"):
        old = treestore.diff(f"{url}#a", f"{url}#b", stats=True)
    assert old.leaves[0].change == w.change
    with pytest.warns(DeprecationWarning, match="change"):
        assert w.stats == w.change
    with pytest.warns(DeprecationWarning, match="ValueChange"):
        assert treestore.types.LeafStats is treestore.types.ValueChange


def test_cli_diff_values_and_its_hidden_old_flag(tmp_path):
    from click.testing import CliRunner

    from treestore_cli.main import cli

    url = str(tmp_path / "store")
    treestore.save(url, {"w": np.zeros(8)}, "a")
    treestore.save(url, {"w": np.ones(8)}, "b")
    new = CliRunner().invoke(cli, ["diff", f"{url}#a", f"{url}#b", "--values"])
    old = CliRunner().invoke(cli, ["diff", f"{url}#a", f"{url}#b", "--stats"])
    assert new.exit_code == old.exit_code == 1 and "rel L2" in new.stdout
    assert old.stdout == new.stdout and "deprecated: use --values" in old.stderr


def test_attributes_that_exposed_internal_objects_warn_and_name_what_to_use():
    url = "memory://names/internal"
    treestore.save(url, {"w": np.arange(4.0)}, "a")
    store = treestore.Store(url)
    ckpt = store.open("a")
    leaf = ckpt["w"]
    cases = [
        (store, "storage", "Store.url"),
        (ckpt, "columns", "Checkpoint.manifest"),
        (ckpt, "reader", "Checkpoint.bytes_read"),
        (ckpt, "storage", "Checkpoint.url"),
        (leaf, "reader", "LazyLeaf.entry"),
    ]
    for owner, old, instead in cases:
        with pytest.warns(DeprecationWarning, match=instead) as warned:
            got = getattr(owner, old)
        assert got is getattr(owner, f"_{old}")
        assert [w.filename for w in warned] == [__file__]  # the caller's line, seen by default
    assert ckpt.manifest.name == "a" and ckpt.url == store.url == url
