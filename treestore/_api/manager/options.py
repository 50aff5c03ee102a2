"""The settings of a checkpoint manager that come as objects: :class:`Retention` (which steps the
local tier keeps) and :class:`RemoteTier` (the store committed steps are replicated to, and what
it keeps), each validated when made; and the flat keywords that stood for them before, read into
them with a DeprecationWarning naming the replacement."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Any

from treestore.errors import InvalidInputError


def check_count(name: str, value: object) -> int | None:
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise InvalidInputError(f"{name} must be a positive int or None, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class Retention:
    """Which steps a :class:`CheckpointManager` keeps, given as its ``retention=``.

    A step is kept if any rule keeps it, and the newest step is always kept; with no rule every
    step is kept. After each save the manager deletes the other steps, then gc frees their
    chunks (see :class:`CheckpointManager`).

    Attributes:
        keep_last: Keep the N newest steps.
        keep_every: Keep every step divisible by this.
        keep_best: Keep the N best steps by ``best_metric`` (every save then passes that
            metric; ties go to the newer step).
        best_metric: The metric ``keep_best`` ranks by.
        best_mode: "min" (the default: the lowest is best) or "max".

    Raises:
        InvalidInputError: A count that is not a positive int, ``keep_best`` without
            ``best_metric`` (or ``best_metric``/``best_mode`` without ``keep_best``), or a
            ``best_mode`` other than "min" and "max".

    Examples:
        >>> import treestore
        >>> treestore.Retention(keep_last=2, keep_best=1, best_metric="loss")
        Retention(keep_last=2, keep_every=None, keep_best=1, best_metric='loss', best_mode=None)
    """

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: str | None = None

    def __post_init__(self) -> None:
        check_count("keep_last", self.keep_last)
        check_count("keep_every", self.keep_every)
        check_count("keep_best", self.keep_best)
        if self.keep_best is None and (self.best_metric is not None or self.best_mode is not None):
            raise InvalidInputError("best_metric and best_mode apply only with keep_best=N")
        if self.keep_best is not None and not (isinstance(self.best_metric, str) and self.best_metric):
            raise InvalidInputError(
                f"keep_best={self.keep_best} needs best_metric, the name of a metric passed to "
                f"save(), got {self.best_metric!r}"
            )
        if self.best_mode not in (None, "min", "max"):
            raise InvalidInputError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")


@dataclass(frozen=True)
class RemoteTier:
    """The remote tier of a :class:`CheckpointManager`, given as its ``remote=``: the store its
    committed steps are replicated to, which of them are, and which the remote keeps.

    ``remote="s3://bucket/run"`` is ``remote=RemoteTier("s3://bucket/run")``: every committed
    step replicated, every replicated step kept.

    Attributes:
        url: The remote store (a local path or fsspec URL).
        keep_last: The remote tier keeps its N newest steps.
        keep_every: The remote tier keeps every step divisible by this (with neither rule, every
            replicated step is kept; the newest always is).
        replicate_every_steps: Replicate only the steps divisible by this (default: every
            step; a step saved after a SIGTERM always is).
        storage_options: fsspec options of the remote store.

    Raises:
        InvalidInputError: ``url`` is not a str or path, a count is not a positive int, or
            ``storage_options`` is not a dict.

    Examples:
        >>> import treestore
        >>> treestore.RemoteTier("s3://bucket/run", keep_last=3, replicate_every_steps=1000)
        RemoteTier(url='s3://bucket/run', keep_last=3, keep_every=None, replicate_every_steps=1000,
                   storage_options=None)
    """

    url: str | os.PathLike[str]
    _: KW_ONLY
    keep_last: int | None = None
    keep_every: int | None = None
    replicate_every_steps: int | None = None
    storage_options: Mapping[str, Any] | None = dataclasses.field(default=None, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.url, (str, os.PathLike)):
            raise InvalidInputError(f"a remote store's URL is a str or path, got {type(self.url).__name__}")
        check_count("replicate_every_steps", self.replicate_every_steps)
        Retention(keep_last=self.keep_last, keep_every=self.keep_every)  # the same checks
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise InvalidInputError(
                f"storage_options must be a dict of fsspec options, got {type(self.storage_options).__name__}"
            )


# The flat keywords of CheckpointManager that these objects replace: the retention's by the same
# names, the remote tier's without their "remote_" prefix.
_RETENTION_KEYWORDS = tuple(f.name for f in dataclasses.fields(Retention))
_REMOTE_KEYWORDS = {
    "replicate_every_steps": "replicate_every_steps",
    "remote_keep_last": "keep_last",
    "remote_keep_every": "keep_every",
    "remote_storage_options": "storage_options",
}


def read_options(
    retention: Retention | None, remote: str | os.PathLike[str] | RemoteTier | None, flat: dict[str, Any]
) -> tuple[Retention, RemoteTier | None]:
    """The retention and the remote tier of a manager made with ``retention=``, ``remote=`` and
    the deprecated flat keywords ``flat`` (each None is as if not given). Every check is made,
    and every error raised, before the DeprecationWarning of the flat keywords.

    Raises:
        TypeError: ``flat`` holds a keyword CheckpointManager never had.
        InvalidInputError: An option object and flat keywords of the same settings, tier
            keywords without ``remote=``, or a setting out of range.
    """
    unknown = sorted(set(flat) - {*_RETENTION_KEYWORDS, *_REMOTE_KEYWORDS})
    if unknown:
        raise TypeError(f"CheckpointManager() got an unexpected keyword argument {unknown[0]!r}")
    old_retention = {k: v for k in _RETENTION_KEYWORDS if (v := flat.get(k)) is not None}
    old_remote = {k: v for k in _REMOTE_KEYWORDS if (v := flat.get(k)) is not None}
    in_tier = {_REMOTE_KEYWORDS[k]: v for k, v in old_remote.items()}  # as RemoteTier names them
    if retention is not None and not isinstance(retention, Retention):
        raise InvalidInputError(f"retention must be a treestore.Retention, got {type(retention).__name__}")
    if retention is not None and old_retention:
        raise InvalidInputError(
            f"retention= and {_listed(old_retention)} both say which steps to keep: give "
            f"{_listed(old_retention)} inside retention=treestore.Retention(...) only"
        )
    if remote is None and old_remote:
        raise InvalidInputError(
            "replicate_every_steps, remote_keep_last, remote_keep_every and remote_storage_options "
            "apply only with remote= (the URL of the remote store)"
        )
    if isinstance(remote, RemoteTier) and old_remote:
        raise InvalidInputError(
            f"remote=treestore.RemoteTier(...) and {_listed(old_remote)} both set the remote tier: give "
            f"{_listed(in_tier)} inside the RemoteTier only"
        )
    if remote is not None and not isinstance(remote, (str, os.PathLike, RemoteTier)):
        raise InvalidInputError(
            f"remote must be the remote store's URL or a treestore.RemoteTier, got {type(remote).__name__}"
        )
    kept = retention if retention is not None else Retention(**old_retention)
    tier = remote if isinstance(remote, RemoteTier) else None
    if isinstance(remote, (str, os.PathLike)):  # the URL, and the tier's flat keywords if any
        tier = RemoteTier(remote, **in_tier)
    if old_retention:
        _warn(_listed(old_retention), f"retention=treestore.Retention({_listed(old_retention)})")
    if old_remote:
        _warn(f"remote=URL, {_listed(old_remote)}", f"remote=treestore.RemoteTier(URL, {_listed(in_tier)})")
    return kept, tier


def _listed(keywords: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}=" for k in keywords)


def _warn(old: str, new: str) -> None:
    warnings.warn(
        f"CheckpointManager({old}) is deprecated: use CheckpointManager({new}), the same settings",
        DeprecationWarning,
        stacklevel=4,  # the caller of CheckpointManager(...)
    )
