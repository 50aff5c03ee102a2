"""The grammar of store paths (SPEC.md 3.1, and the gc table of section 10): every builder's path
parses back to what built it, and every near miss is refused, since gc deletes only what parses."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from treestore._format import paths as _paths

DIGEST = bytes(range(32))
HEX = DIGEST.hex()
TOKEN = "0123456789abcdef" * 2


@given(st.binary(min_size=32, max_size=32))
def test_digest_paths_round_trip(digest):
    assert _paths.parse_chunk(_paths.chunk_path(digest)) == digest
    assert _paths.parse_manifest(_paths.manifest_path(digest)) == digest
    assert _paths.parse_manifest(_paths.chunk_path(digest)) is None
    assert _paths.parse_chunk(_paths.manifest_path(digest)) is None


def test_chunk_path_layout():
    assert _paths.chunk_path(DIGEST) == f"chunks/00/{HEX}"
    assert _paths.manifest_path(DIGEST) == f"manifests/{HEX}"


@pytest.mark.parametrize(
    "path",
    [
        f"chunks/00/{HEX[:-1]}",  # too short
        f"chunks/00/{HEX}0",  # too long
        f"chunks/00/{HEX.upper()}",  # uppercase hex
        f"chunks/00/{HEX[:-1]}A",
        f"chunks/ff/{HEX}",  # a chunk in another chunk's folder
        f"chunks/0/{HEX}",
        f"chunks/000/{HEX}",
        f"chunks/{HEX}",  # no folder
        f"chunks/00/00/{HEX}",  # one folder too many
        f"manifests/00/{HEX}",  # the wrong prefix folder
        f"Chunks/00/{HEX}",
        f"/chunks/00/{HEX}",
        f"./chunks/00/{HEX}",
        f"chunks/00/{HEX}/",
        f"chunks/00/{HEX}.tmp",
        f"chunks/00/.tmp-{TOKEN}",
        f"chunks/00/{HEX}\n",
        "",
    ],
)
def test_near_miss_chunk_paths_are_refused(path):
    assert _paths.parse_chunk(path) is None


@pytest.mark.parametrize(
    "path",
    [
        f"manifests/{HEX[:-1]}",
        f"manifests/{HEX}0",
        f"manifests/{HEX.upper()}",
        f"chunks/{HEX}",  # the wrong prefix folder
        f"checkpoints/{HEX}",
        f"manifests/00/{HEX}",
        f"manifest/{HEX}",
        f"manifests/{HEX}\n",
        f"manifests/.tmp-{TOKEN}",
    ],
)
def test_near_miss_manifest_paths_are_refused(path):
    assert _paths.parse_manifest(path) is None


@pytest.mark.parametrize("kind", _paths.LOCK_KINDS)
def test_lock_paths_round_trip(kind):
    token = os.urandom(16).hex()
    path = _paths.lock_path(kind, token)
    assert path == f"locks/{kind}-{token}"
    assert _paths.parse_lock(path) == (kind, token)


@pytest.mark.parametrize(
    "path",
    [
        f"locks/save-{TOKEN[:-1]}",  # too short
        f"locks/save-{TOKEN}0",  # too long
        f"locks/save-{TOKEN.upper()}",
        f"locks/load-{TOKEN}",  # not a kind of lock
        f"locks/Save-{TOKEN}",
        f"locks/save_{TOKEN}",
        f"locks/save{TOKEN}",
        f"staging/save-{TOKEN}",  # the wrong prefix folder
        f"locks/x/save-{TOKEN}",
        f"locks/.tmp-{TOKEN}",
        "locks/save-but-not-a-lock",
        "locks/README",
    ],
)
def test_near_miss_lock_paths_are_refused(path):
    assert _paths.parse_lock(path) is None


def test_staging_paths_round_trip():
    assert _paths.outcome_path(TOKEN) == f"staging/{TOKEN}/outcome"
    assert _paths.parse_staging(_paths.outcome_path(TOKEN)) == (TOKEN, "outcome")
    assert _paths.parse_staging(f"staging/{TOKEN}/process-12") == (TOKEN, "process-12")


@pytest.mark.parametrize(
    "path",
    [
        f"staging/{TOKEN[:-1]}/outcome",
        f"staging/{TOKEN}0/outcome",
        f"staging/{TOKEN.upper()}/outcome",
        f"staging/{TOKEN}/outcomes",
        f"staging/{TOKEN}/process-",
        f"staging/{TOKEN}/process-x",
        f"staging/{TOKEN}/Outcome",
        f"locks/{TOKEN}/outcome",  # the wrong prefix folder
        f"staging/{TOKEN}/outcome/x",
        f"staging/{TOKEN}",
        f"staging/{TOKEN}/.tmp-{TOKEN}",
    ],
)
def test_near_miss_staging_paths_are_refused(path):
    assert _paths.parse_staging(path) is None


def test_ids():
    assert _paths.is_id(TOKEN) and _paths.is_id(os.urandom(16).hex())
    for bad in (TOKEN[:-1], TOKEN + "0", TOKEN.upper(), "g" * 32, "", f"{TOKEN[:-1]}/"):
        assert not _paths.is_id(bad)


@pytest.mark.parametrize("name", ["a", "step-000000001", "A.b_c=d+e-f", "9" * 200])
def test_record_paths_round_trip(name):
    assert _paths.record_path(name) == f"checkpoints/{name}"
    assert _paths.parse_record(_paths.record_path(name)) == name


@pytest.mark.parametrize(
    "path",
    [
        "checkpoints/",
        "checkpoints/.hidden",  # a name starts with a letter or digit
        "checkpoints/-a",
        f"checkpoints/.tmp-{TOKEN}",
        "checkpoints/a/b",  # nested: not a checkpoint
        "checkpoints/a b",
        "checkpoints/" + "a" * 201,  # too long
        "checkpoints/a\n",
        "manifests/a",  # the wrong prefix folder
        "checkpoint/a",
        "a",
        "",
    ],
)
def test_near_miss_record_paths_are_refused(path):
    assert _paths.parse_record(path) is None


def test_temporary_names():
    name = _paths.temporary_name(TOKEN)
    assert name == f".tmp-{TOKEN}" and _paths.is_temporary(name)
    assert name.startswith(_paths.TEMPORARY_PREFIX)
    for bad in (f".tmp-{TOKEN[:-1]}", f".tmp-{TOKEN}0", f".tmp-{TOKEN.upper()}", f"tmp-{TOKEN}", ".tmp-2"):
        assert not _paths.is_temporary(bad)


@given(st.integers(min_value=0, max_value=10**15))
def test_step_names_round_trip(step):
    name = _paths.step_name(step)
    assert _paths.parse_step_name(name) == step
    assert _paths.parse_record(_paths.record_path(name)) == name


@given(st.integers(min_value=0, max_value=10**9 - 2))
def test_step_names_sort_like_steps(step):
    assert _paths.step_name(step) < _paths.step_name(step + 1)


@pytest.mark.parametrize(
    "name", ["step-1", "step-00000001", "step--00000001", "Step-000000001", "step-000000001x"]
)
def test_other_names_are_no_steps(name):
    assert _paths.parse_step_name(name) is None


def test_commit_order():
    class Record:
        def __init__(self, name: str, created: float) -> None:
            self.name, self.created = name, created

    records = [Record("b", 2.0), Record("a", 2.0), Record("z", 1.0)]
    assert [r.name for r in sorted(records, key=_paths.commit_order)] == ["z", "a", "b"]
