"""The manager's option objects: ``Retention`` (``retention=``) and ``RemoteTier`` (``remote=``),
frozen and validated when made; the flat keywords they replace still work with a
DeprecationWarning naming the replacement, keep the manager exactly as the objects do, and are
refused beside the object that replaces them."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import treestore

Retention, RemoteTier = treestore.Retention, treestore.RemoteTier


def mem() -> str:
    return f"memory://options-{uuid.uuid4().hex}"


# -- the objects ----------------------------------------------------------------------------------
def test_the_objects_are_public_frozen_and_keyword_only():
    assert treestore.types.Retention is Retention and treestore.types.RemoteTier is RemoteTier
    assert {"Retention", "RemoteTier"} <= set(treestore.__all__) & set(treestore.types.__all__)
    keep = Retention(keep_last=2, keep_best=1, best_metric="loss", best_mode="max")
    with pytest.raises(dataclasses.FrozenInstanceError):
        keep.keep_last = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        Retention(2)  # type: ignore[misc]
    assert keep == Retention(keep_last=2, keep_best=1, best_metric="loss", best_mode="max")
    assert Retention() == Retention(keep_last=None)  # no rule: every step kept
    tier = RemoteTier("s3://b/run", keep_last=3, storage_options={"anon": True})
    assert tier.url == "s3://b/run" and tier.keep_every is None and tier.replicate_every_steps is None
    assert hash(tier) == hash(RemoteTier("s3://b/run", keep_last=3, storage_options={"anon": False}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        tier.url = "elsewhere"  # type: ignore[misc]
    with pytest.raises(TypeError):
        RemoteTier("s3://b/run", 3)  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"keep_last": 0},
        {"keep_every": -1},
        {"keep_last": True},
        {"keep_best": 2},
        {"best_metric": "loss"},
        {"best_mode": "max"},
        {"keep_best": 1, "best_metric": "loss", "best_mode": "mean"},
    ],
)
def test_a_retention_is_checked_when_made(kwargs: dict[str, Any]):
    with pytest.raises(treestore.InvalidInputError):
        Retention(**kwargs)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((42,), {}, "str or path"),
        (("s3://b/r",), {"keep_last": 0}, "keep_last"),
        (("s3://b/r",), {"keep_every": 1.5}, "keep_every"),
        (("s3://b/r",), {"replicate_every_steps": 0}, "replicate_every_steps"),
        (("s3://b/r",), {"storage_options": "anon"}, "storage_options"),
    ],
)
def test_a_remote_tier_is_checked_when_made(args: tuple[Any, ...], kwargs: dict[str, Any], match: str):
    with pytest.raises(treestore.InvalidInputError, match=match):
        RemoteTier(*args, **kwargs)


def test_the_manager_takes_only_option_objects(tmp_path):
    with pytest.raises(treestore.InvalidInputError, match=r"treestore\.Retention"):
        treestore.CheckpointManager(mem(), retention={"keep_last": 2})  # type: ignore[arg-type]
    with pytest.raises(treestore.InvalidInputError, match=r"treestore\.RemoteTier"):
        treestore.CheckpointManager(mem(), remote=["s3://b/r"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="keep_lats"):
        treestore.CheckpointManager(mem(), keep_lats=2)
    with pytest.raises(treestore.InvalidInputError, match="one store"):  # a RemoteTier is checked too
        treestore.CheckpointManager(str(tmp_path / "a"), remote=RemoteTier(tmp_path / "a" / "inner"))


# -- the flat keywords ----------------------------------------------------------------------------
def test_the_old_keywords_still_work_and_warn_naming_the_replacement():
    with pytest.warns(DeprecationWarning) as caught:
        m = treestore.CheckpointManager(
            mem(),
            keep_last=1,
            keep_best=1,
            best_metric="loss",
            remote=mem(),
            remote_keep_last=2,
            replicate_every_steps=2,
            async_save=False,
        )
    with m:
        for step in range(1, 5):
            m.save(step, {"w": np.full(2, step)}, metrics={"loss": abs(step - 2)})
        m.wait()
        assert m.steps() == [2, 4] and treestore.CheckpointManager(m.remote.url).steps() == [2, 4]
    said = sorted(str(w.message) for w in caught)
    assert said == [
        "CheckpointManager(keep_last=, keep_best=, best_metric=) is deprecated: use CheckpointManager("
        "retention=treestore.Retention(keep_last=, keep_best=, best_metric=)), the same settings",
        "CheckpointManager(remote=URL, replicate_every_steps=, remote_keep_last=) is deprecated: use "
        "CheckpointManager(remote=treestore.RemoteTier(URL, replicate_every_steps=, keep_last=)), "
        "the same settings",
    ]
    assert all(w.filename == __file__ for w in caught)  # the warning points at the caller


def test_old_keywords_out_of_range_are_refused_before_any_warning():
    # pytest turns warnings into errors here: an InvalidInputError shows none came first.
    with pytest.raises(treestore.InvalidInputError, match="keep_last must be"):
        treestore.CheckpointManager(mem(), keep_last=0)
    with pytest.raises(treestore.InvalidInputError, match="only with remote="):
        treestore.CheckpointManager(mem(), remote_keep_last=2)
    with pytest.raises(treestore.InvalidInputError, match="replicate_every_steps"):
        treestore.CheckpointManager(mem(), remote=mem(), replicate_every_steps=0)


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"retention": Retention(keep_last=2), "keep_last": 3}, ["retention=", "keep_last="]),
        ({"retention": Retention(), "best_mode": "max"}, ["retention=", "best_mode="]),
        (
            {"remote": RemoteTier("memory://x"), "remote_keep_last": 2},
            ["remote=treestore.RemoteTier", "remote_keep_last=", "keep_last="],
        ),
        (
            {"remote": RemoteTier("memory://x"), "remote_storage_options": {}},
            ["remote=treestore.RemoteTier", "remote_storage_options=", "storage_options="],
        ),
    ],
)
def test_an_option_object_and_its_old_keywords_together_are_refused(kwargs: dict[str, Any], names: list[str]):
    with pytest.raises(treestore.InvalidInputError) as info:
        treestore.CheckpointManager(mem(), **kwargs)
    assert all(name in str(info.value) for name in names), str(info.value)


def _run(settings: Callable[[str], dict[str, Any]]) -> tuple[list[int], list[int], Any]:
    """The steps each tier holds after saves 0..11 with ``settings(remote URL)``, and the
    manager's policy."""
    local, remote = mem(), mem()
    with treestore.CheckpointManager(local=local, async_save=False, **settings(remote)) as m:
        for step in range(12):
            m.save(step, {"w": np.full(3, step)}, metrics={"acc": (step * 7) % 5})
            m.wait()  # each replication done before the next save's retention
        policy = m._policy
    return treestore.CheckpointManager(local).steps(), treestore.CheckpointManager(remote).steps(), policy


def test_old_and_new_spellings_keep_the_same_steps():
    with pytest.warns(DeprecationWarning):
        old = _run(
            lambda remote: {
                "keep_last": 2,
                "keep_every": 5,
                "keep_best": 1,
                "best_metric": "acc",
                "best_mode": "max",
                "remote": remote,
                "replicate_every_steps": 3,
                "remote_keep_last": 2,
                "remote_keep_every": 6,
                "remote_storage_options": {},
            }
        )
    new = _run(
        lambda remote: {
            "retention": Retention(
                keep_last=2, keep_every=5, keep_best=1, best_metric="acc", best_mode="max"
            ),
            "remote": RemoteTier(
                remote, replicate_every_steps=3, keep_last=2, keep_every=6, storage_options={}
            ),
        }
    )
    assert old == new
    # Local: the two newest, every fifth, the best accuracy (4, at steps 2 and 7: the newer).
    # Remote: steps 0, 3, 6, 9 replicated; its two newest and every sixth kept.
    assert new[:2] == ([0, 5, 7, 10, 11], [0, 6, 9])
