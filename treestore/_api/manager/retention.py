"""Which steps a checkpoint manager saves and keeps: step names, the saved steps of a store, the
interval and retention policy, and applying it (deleting the steps it does not keep)."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from treestore._api.health import ValueStats
from treestore._api.manager.options import Retention, check_count
from treestore._api.store import Store
from treestore._format import paths as _paths
from treestore.errors import CheckpointNotFoundError, InvalidInputError, StoreBusyError, TreestoreError

_log = logging.getLogger("treestore")
# A caller's test of a step's health, given what was stored with it and its leaves' statistics.
HealthCheck = Callable[["StepInfo", Mapping[str, ValueStats]], bool]


@dataclass(frozen=True)
class StepInfo:
    """One saved step: its checkpoint name, when it was saved (seconds since the epoch), its
    metrics and the caller's data.

    Attributes:
        step: The training step.
        name: Its checkpoint's name, such as ``step-000000123``.
        created: When it was saved (seconds since the epoch).
        metrics: The metrics passed to :meth:`CheckpointManager.save`, as floats by name.
        user: The ``user`` data passed to :meth:`CheckpointManager.save` (None when none was).
    """

    step: int
    name: str
    created: float
    metrics: Mapping[str, float]
    user: Any


def check_step(step: object) -> int:
    if type(step) is not int or step < 0:
        raise InvalidInputError(f"step must be an int >= 0, got {step!r}")
    return step


def check_metrics(metrics: object) -> dict[str, float]:
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise InvalidInputError(f"metrics must be a dict of names to numbers, got {type(metrics).__name__}")
    out = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise InvalidInputError(f"metric names must be str, got {key!r}")
        try:
            if isinstance(value, (str, bytes)):
                raise TypeError
            out[key] = float(value)
        except (TypeError, ValueError):
            raise InvalidInputError(
                f"metric {key!r} must be a real number, got {type(value).__name__}"
            ) from None
    return out


@dataclass(frozen=True)
class Policy:
    """When to save and which steps to keep (a :class:`Retention`'s rules, and with
    ``keep_healthy`` the step :func:`kept_healthy` protects); validated on construction."""

    save_every_steps: int | None = None
    save_every_seconds: float | None = None
    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: str | None = None
    keep_healthy: bool = True  # never delete the newest step that may be good (see kept_healthy)
    healthy: HealthCheck | None = None  # the caller's test, beside "no NaN/inf"

    def __post_init__(self) -> None:
        if type(self.keep_healthy) is not bool:
            raise InvalidInputError(f"keep_healthy must be True or False, got {self.keep_healthy!r}")
        if self.healthy is not None and not callable(self.healthy):
            raise InvalidInputError(
                f"healthy must be a function (StepInfo, stats) -> bool, got {self.healthy!r}"
            )
        check_count("save_every_steps", self.save_every_steps)
        s = self.save_every_seconds
        if s is not None and (
            isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0
        ):
            raise InvalidInputError(f"save_every_seconds must be a positive number or None, got {s!r}")
        Retention(  # the rules' own checks
            keep_last=self.keep_last,
            keep_every=self.keep_every,
            keep_best=self.keep_best,
            best_metric=self.best_metric,
            best_mode=self.best_mode,
        )

    def due(self, step: int, elapsed: float) -> bool:
        """Whether the interval asks for a save at ``step``, ``elapsed`` s after the last save."""
        if self.save_every_steps is None and self.save_every_seconds is None:
            return True
        by_steps = self.save_every_steps is not None and step % self.save_every_steps == 0
        by_time = self.save_every_seconds is not None and elapsed >= self.save_every_seconds
        return by_steps or by_time

    def retained(self, infos: Mapping[int, StepInfo]) -> set[int]:
        """The steps to keep: any rule keeps a step, and the newest step is always kept."""
        steps = sorted(infos)
        if not steps or (self.keep_last is None and self.keep_every is None and self.keep_best is None):
            return set(steps)
        keep = {steps[-1]}
        if self.keep_last is not None:
            keep.update(steps[-self.keep_last :])
        if self.keep_every is not None:
            keep.update(s for s in steps if s % self.keep_every == 0)
        if self.keep_best is not None:
            sign = -1.0 if self.best_mode == "max" else 1.0
            scored = [
                (sign * v, -s, s)
                for s in steps
                if (v := infos[s].metrics.get(str(self.best_metric))) is not None and not math.isnan(v)
            ]
            keep.update(s for *_, s in sorted(scored)[: self.keep_best])
        return keep


def step_infos(store: Store) -> dict[int, StepInfo]:
    """The steps committed in ``store``: checkpoints named ``step-N`` whose metadata says step N."""
    out = {}
    for c in store.list():
        step = _paths.parse_step_name(c.name)
        meta = c.metadata
        if step is None or not isinstance(meta, dict) or meta.get("step") != step:
            continue
        metrics = meta.get("metrics")
        metrics = (
            {k: v for k, v in metrics.items() if isinstance(v, float)} if isinstance(metrics, dict) else {}
        )
        out[step] = StepInfo(step, c.name, c.created, metrics, meta.get("user"))
    return out


def step_health(store: Store, info: StepInfo, check: HealthCheck | None = None) -> bool | None:
    """Whether step ``info`` of ``store`` is healthy, from its manifest alone: False when its
    recorded statistics show NaN/inf or ``check`` says so, True when they show none (and
    ``check`` agrees), None when unknown (no statistics, or a check or read that failed: a
    step is never deleted for being unknown)."""
    try:
        ckpt = store.open(info.name)
        state = ckpt.healthy
        if state is False or check is None:
            return state
        return bool(check(info, ckpt.stats()))
    except TreestoreError as exc:
        _log.warning("%s: the health of %s is unknown (%s)", store.url, info.name, exc)
        return None
    except Exception as exc:  # the caller's check failed: unknown, so kept
        _log.warning("%s: health check of %s raised %s: %s", store.url, info.name, type(exc).__name__, exc)
        return None


def newest_by_health(
    steps: Iterable[tuple[int, StepInfo, Store]], check: HealthCheck | None = None
) -> tuple[int | None, int | None]:
    """Of ``steps`` (each with the store holding it), the newest known to be healthy and the
    newest not known to be unhealthy (healthy or unknown), None for either when there is none;
    manifests are read from the newest down, stopping at the first step known healthy."""
    maybe = None
    for step, info, store in sorted(steps, key=lambda s: s[0], reverse=True):
        state = step_health(store, info, check)
        if state is True:
            return step, step if maybe is None else maybe
        if state is None and maybe is None:
            maybe = step
    return None, maybe


def kept_healthy(store: Store, policy: Policy, infos: Mapping[int, StepInfo]) -> set[int]:
    """With ``policy.keep_healthy``, the step retention protects whatever the other rules say:
    the newest step known to be healthy; where there is none, the newest step not known to be
    unhealthy (its health unknown: saved without statistics, statistics or a manifest that cannot
    be read). So a run whose newest steps hold NaN/inf never loses the last step that may be good."""
    if not policy.keep_healthy or not infos:
        return set()
    known, maybe = newest_by_health(((s, i, store) for s, i in infos.items()), policy.healthy)
    found = maybe if known is None else known
    return set() if found is None else {found}


def deleted_by_retention(store: Store, policy: Policy, protected: Iterable[int] = ()) -> Iterator[int]:
    """Delete the steps of ``store`` that ``policy`` (or ``protected``) does not keep, yielding
    each step once it is gone (deleted here, or by someone else meanwhile)."""
    infos = step_infos(store)
    keep = policy.retained(infos) | set(protected)
    if set(infos) - keep:  # the newest step that may be good stays (keep_healthy)
        keep |= kept_healthy(store, policy, infos)
    for step, info in infos.items():
        if step not in keep:
            with contextlib.suppress(CheckpointNotFoundError):  # deleted by someone else
                store.delete(info.name)
            yield step


def apply_retention(store: Store, policy: Policy, protected: Iterable[int] = ()) -> bool:
    """Delete the steps of ``store`` that ``policy`` (or ``protected``) does not keep; True when
    any was deleted."""
    deleted = False
    for _ in deleted_by_retention(store, policy, protected):
        deleted = True
    return deleted


def gc_after_retention(store: Store) -> bool:
    """Collect the chunks of the steps retention deleted from ``store``; True while gc is still
    due: a save is in flight somewhere, or a damaged checkpoint keeps gc from freeing anything
    (gc logs which), and either may be gone after the next save."""
    try:
        return bool(store.gc(grace=0, wait=0).damaged)
    except StoreBusyError:
        return True
