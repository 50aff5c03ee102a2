"""Errors and result fields are named by the SPEC's words; the names they replaced still work, with a
warning."""

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

    with pytest.warns(DeprecationWarning, match=new):
        cls = getattr(errors, old)
    assert cls is getattr(errors, new)
    if old == "CorruptionError":
        with pytest.warns(DeprecationWarning):
            assert treestore.CorruptionError is errors.DamagedError
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
