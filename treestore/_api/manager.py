"""The checkpoint manager: when to save a training loop's state, which steps to keep, async saves,
preemption, two tiers (fast local saves replicated to a remote store), and resuming (see
:class:`CheckpointManager`)."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from treestore._api.copy import CopyReport
from treestore._api.copy import copy as _copy
from treestore._api.store import Store
from treestore._engine import write as _write
from treestore._engine.snapshot import Background, HostSnapshot
from treestore._format.manifest import check_metadata
from treestore.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptionError,
    InvalidInputError,
    StoreBusyError,
    TreestoreError,
)

_log = logging.getLogger("treestore")

_STEP_NAME = re.compile(r"step-(\d{9,})\Z")


def step_name(step: int) -> str:
    """The checkpoint name of a step: zero-padded, so names sort like steps.

    >>> step_name(123)
    'step-000000123'
    """
    return f"step-{step:09d}"


@dataclass(frozen=True)
class StepInfo:
    """One saved step: its checkpoint name, when it was saved (seconds since the epoch), its
    metrics and the caller's data."""

    step: int
    name: str
    created: float
    metrics: Mapping[str, float]
    user: Any


def _count(name: str, value: object) -> int | None:
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise InvalidInputError(f"{name} must be a positive int or None, got {value!r}")
    return value


def _step(step: object) -> int:
    if type(step) is not int or step < 0:
        raise InvalidInputError(f"step must be an int >= 0, got {step!r}")
    return step


def _metrics(metrics: object) -> dict[str, float]:
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
class _Policy:
    """When to save and which steps to keep; validated on construction."""

    save_every_steps: int | None = None
    save_every_seconds: float | None = None
    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: str | None = None

    def __post_init__(self) -> None:
        _count("save_every_steps", self.save_every_steps)
        _count("keep_last", self.keep_last)
        _count("keep_every", self.keep_every)
        _count("keep_best", self.keep_best)
        s = self.save_every_seconds
        if s is not None and (
            isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0
        ):
            raise InvalidInputError(f"save_every_seconds must be a positive number or None, got {s!r}")
        if self.keep_best is None and (self.best_metric is not None or self.best_mode is not None):
            raise InvalidInputError("best_metric and best_mode apply only with keep_best=N")
        if self.keep_best is not None and not (isinstance(self.best_metric, str) and self.best_metric):
            raise InvalidInputError(
                f"keep_best={self.keep_best} needs best_metric, the name of a metric passed to "
                f"save(), got {self.best_metric!r}"
            )
        if self.best_mode not in (None, "min", "max"):
            raise InvalidInputError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")

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


def _step_infos(store: Store) -> dict[int, StepInfo]:
    """The steps committed in ``store``: checkpoints named ``step-N`` whose metadata says step N."""
    out = {}
    for c in store.list():
        match = _STEP_NAME.match(c.name)
        meta = c.metadata
        if match is None or not isinstance(meta, dict) or meta.get("step") != int(match.group(1)):
            continue
        metrics = meta.get("metrics")
        metrics = (
            {k: v for k, v in metrics.items() if isinstance(v, float)} if isinstance(metrics, dict) else {}
        )
        out[int(match.group(1))] = StepInfo(int(match.group(1)), c.name, c.created, metrics, meta.get("user"))
    return out


def _apply_retention(store: Store, policy: _Policy, protected: Iterable[int] = ()) -> bool:
    """Delete the steps of ``store`` that ``policy`` (or ``protected``) does not keep; True when
    any was deleted."""
    infos = _step_infos(store)
    keep = policy.retained(infos) | set(protected)
    deleted = False
    for step, info in infos.items():
        if step not in keep:
            with contextlib.suppress(CheckpointNotFoundError):  # deleted by someone else
                store.delete(info.name)
            deleted = True
    return deleted


class _Replicator:
    """The remote tier: one thread copying committed local steps to the remote store, one at a
    time; a step asked for while one is copying replaces any step still waiting (the newest
    wins). Each copy transfers only the chunks the remote lacks and commits there after them
    (:func:`treestore.copy`); then the remote retention policy runs. An error is kept until
    :meth:`take_error`."""

    def __init__(
        self,
        src: tuple[str, dict[str, Any] | None],
        dst: tuple[str, dict[str, Any] | None],
        remote: Store,
        policy: _Policy,
    ) -> None:
        self._src, self._dst, self._remote, self._policy = src, dst, remote, policy
        self._cond = threading.Condition()
        self._wanted: int | None = None  # the step waiting to be copied
        self._running: int | None = None  # the step being copied
        self._error: BaseException | None = None
        self._stop = False
        self._gc_due = False
        self.last: int | None = None  # the newest step this manager replicated
        self.report: CopyReport | None = None  # of the last replication that committed
        self._thread = threading.Thread(target=self._loop, name="treestore-replicate", daemon=True)
        self._thread.start()

    def request(self, step: int) -> None:
        with self._cond:
            self._wanted = step
            self._cond.notify_all()

    def busy(self) -> set[int]:
        """The steps being copied or waiting: local retention must keep them."""
        with self._cond:
            return {s for s in (self._wanted, self._running) if s is not None}

    def take_error(self) -> BaseException | None:
        with self._cond:
            error, self._error = self._error, None
            return error

    def drain(self) -> None:
        """Wait until nothing is being copied or waiting."""
        with self._cond:
            while self._wanted is not None or self._running is not None:
                self._cond.wait()

    def close(self) -> None:
        self.drain()
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._wanted is None and not self._stop:
                    self._cond.wait()
                if self._wanted is None:
                    return
                step, self._wanted, self._running = self._wanted, None, self._wanted
            error: BaseException | None = None
            try:
                self._replicate(step)
            except BaseException as exc:  # kept for the training loop's next save/wait/close
                exc.add_note(
                    f"while replicating {step_name(step)} from {self._src[0]} to {self._dst[0]}: the "
                    "step is saved locally, and the next replication copies the newest step again"
                )
                error = exc
            with self._cond:
                self._running = None
                if error is not None:
                    self._error = error
                else:
                    self.last = step if self.last is None else max(self.last, step)
                self._cond.notify_all()

    def _replicate(self, step: int) -> None:
        (src, src_options), (dst, dst_options) = self._src, self._dst
        self.report = _copy(
            f"{src}#{step_name(step)}",
            dst,
            overwrite=True,  # the remote copy of a step follows the local one (force=True saves)
            storage_options=src_options,
            dst_storage_options=dst_options or {},
        )
        try:  # the copy is committed: retention failures are logged, as a local save's are
            self._gc_due |= _apply_retention(self._remote, self._policy)
            if self._gc_due:
                with contextlib.suppress(StoreBusyError):  # a save in flight: after the next copy
                    self._gc_due = bool(self._remote.gc(grace=0, wait=0).damaged)
        except TreestoreError as exc:
            _log.warning(
                "%s: retention after replicating %s failed (%s: %s); it runs again after the next one",
                self._remote.url,
                step_name(step),
                type(exc).__name__,
                exc,
            )


class CheckpointManager:
    """Saves a training loop's state every so often, keeps the steps a retention policy names,
    and restores the newest (or a given) step.

    >>> import numpy as np, treestore
    >>> with treestore.CheckpointManager("memory://doc/mgr", save_every_steps=10, keep_last=2) as m:
    ...     for step in range(0, 35):
    ...         saved = m.save(step, {"w": np.full(2, step, np.float32)}, metrics={"loss": 1 / (step + 1)})
    ...     m.wait()
    ...     m.steps(), m.latest_step(), m.restore()["w"], m.info(30).metrics["loss"]
    ([20, 30], 30, array([30., 30.], dtype=float32), 0.03225806451612903)

    **Saving.** ``save(step, tree)`` saves when ``force=True``; or after a SIGTERM (with
    ``preemption=True``); or when the interval asks: ``step % save_every_steps == 0``, or at
    least ``save_every_seconds`` passed on ``clock`` since the last save (or since the manager
    was made); with no interval set, every call saves. A step already saved (or in flight) is a
    CheckpointExistsError unless ``force=True``, which replaces it. Each step is the checkpoint
    ``step-000000123`` (zero-padded) with metadata ``{"step", "metrics", "user"}``; checkpoints
    of other names in the store are ignored and never deleted. A save references the chunks of
    the last step this manager saved (or the newest step it found) as that step's manifest
    records them, sending no request for each (see :meth:`treestore.Store.save`; the manifest
    is read under the save's lock, so a step deleted and collected meanwhile is not trusted);
    ``trust_previous=False`` checks every chunk in the store instead.

    **Async.** With ``async_save=True`` (the default) ``save`` blocks only while the tree is
    validated and its arrays are copied to host (see :class:`treestore._engine.snapshot.HostSnapshot`,
    which keeps one host copy of the last save to reuse); hashing, compressing, writing,
    retention and gc run on one background thread. At most one save is in flight: a save waits
    for the previous one. An error of a background save is raised, as it was raised, by the next
    ``save``, ``wait``, ``restore`` or ``close`` that finds it finished, and that call saves
    nothing; a failed save leaves no visible checkpoint. ``steps()``, ``latest_step()`` and
    ``info()`` list committed steps only (``wait()`` first to include one in flight).

    **Retention.** ``keep_last=N`` keeps the N newest steps, ``keep_every=K`` every step divisible
    by K, ``keep_best=N`` the N best by ``best_metric`` (``best_mode`` "min", the default, or
    "max"; a save must then pass that metric; ties go to the newer step). A step is kept if any rule
    keeps it, and the newest step is always kept; with no rule every step is kept. After each
    save the other steps' checkpoints are deleted, then gc removes the chunks no checkpoint uses;
    gc never touches a save in flight in any process and is retried later when one is. Retention
    runs after the commit, so its failures are logged (logger ``treestore``), never raised: the
    step is saved. A damaged checkpoint in the store is left out of ``steps()`` (and logged), and
    keeps gc from freeing space until it is deleted.

    **Preemption.** ``preemption=True`` installs a SIGTERM handler (main thread only; it calls
    any previous Python handler, and close() puts it back). After a SIGTERM, every ``save`` saves
    its step at once (unless that step is saved already) and waits until it is committed, and
    ``reached_preemption(step)`` is True once ``step`` is committed, so the loop can stop::

        for step in range(start, total):
            state = train_step(state)
            manager.save(step + 1, state)
            if manager.reached_preemption(step + 1):
                break

    **Two tiers.** ``CheckpointManager(local="/nvme/run", remote="s3://bucket/run", ...)`` (or
    ``CheckpointManager("/nvme/run", remote=...)``) saves to the fast local store as above and
    replicates committed steps to the remote store on a background thread: every committed step,
    or with ``replicate_every_steps=M`` the steps divisible by M (and any step saved after a
    SIGTERM). A replication is :func:`treestore.copy` of that step: only the chunks the remote
    lacks are sent, and the remote commit record is written after all of them, so the remote
    never shows a partial step. One replication runs at a time; while it runs, a newer step
    replaces any step still waiting (the newest wins). ``save`` never waits for an upload; local
    retention keeps the step being replicated (and the one waiting) until it is copied. An upload
    error is raised, as it was raised, by the next ``save`` (which then saves nothing), ``wait``
    or ``close``; the step stays saved locally and later replications go on. ``wait()`` and
    ``close()`` wait for the replications asked for. The remote tier has its own retention:
    ``remote_keep_last`` and ``remote_keep_every`` (the newest replicated step is always kept;
    with neither, every replicated step is kept), applied after each replication, then remote
    gc. ``steps()``, ``latest_step()``, ``info()`` and ``restore()`` see the steps of both tiers:
    ``restore()`` loads the newest step committed in either (from the local copy when it has
    one, and from the remote when the local copy is damaged), so a job whose machine was lost
    resumes from the remote store into an empty local folder. A remote that cannot be listed is
    logged and only the local tier is used. ``remote_storage_options`` apply to the remote store.

    A manager is meant for one training loop: call it from one thread.
    """

    def __init__(
        self,
        url: str | os.PathLike[str] | None = None,
        *,
        local: str | os.PathLike[str] | None = None,
        remote: str | os.PathLike[str] | None = None,
        replicate_every_steps: int | None = None,
        remote_keep_last: int | None = None,
        remote_keep_every: int | None = None,
        remote_storage_options: dict[str, Any] | None = None,
        save_every_steps: int | None = None,
        save_every_seconds: float | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: str | None = None,
        async_save: bool = True,
        preemption: bool = False,
        options: _write.SaveOptions | None = None,
        clock: Callable[[], float] = time.monotonic,
        storage_options: dict[str, Any] | None = None,
        trust_previous: bool = True,
    ) -> None:
        self._policy = _Policy(
            save_every_steps, save_every_seconds, keep_last, keep_every, keep_best, best_metric, best_mode
        )
        if preemption and threading.current_thread() is not threading.main_thread():
            raise InvalidInputError(
                "preemption=True installs a SIGTERM handler: make the manager in the main thread"
            )
        if (url is None) == (local is None):
            raise InvalidInputError("give the store's URL, or local= (with remote= for two tiers), once")
        local_url = os.fspath(url if url is not None else local)  # type: ignore[arg-type]
        self._replicate_every = _count("replicate_every_steps", replicate_every_steps)
        self._remote_policy = _Policy(keep_last=remote_keep_last, keep_every=remote_keep_every)
        if remote is None and (
            replicate_every_steps is not None
            or remote_keep_last is not None
            or remote_keep_every is not None
            or remote_storage_options is not None
        ):
            raise InvalidInputError(
                "replicate_every_steps, remote_keep_last, remote_keep_every and remote_storage_options "
                "apply only with remote= (the URL of the remote store)"
            )
        self.store = Store(local_url, storage_options=storage_options)
        self.remote: Store | None = None  # the remote tier's store
        self._replicator: _Replicator | None = None
        if remote is not None:
            self.remote = Store(remote, storage_options=remote_storage_options)
            if self.remote.url == self.store.url:
                raise InvalidInputError(f"local and remote are one store ({self.store.url})")
            self._replicator = _Replicator(
                (local_url, storage_options),
                (os.fspath(remote), remote_storage_options),
                self.remote,
                self._remote_policy,
            )
        self._options = options or _write.SaveOptions()
        self._clock = clock
        self._last_save = clock()
        self._async = bool(async_save)
        self._background = Background() if self._async else None
        self._snapshot = HostSnapshot()
        self._known = set(self._infos())  # committed steps (this manager's view)
        self._trust_previous = bool(trust_previous)
        self._last_step = max(self._known, default=None)  # the step whose chunks a save trusts
        self._pending: int | None = None  # the step of the save in flight
        self._gc_due = False
        self._preempted = False
        self._closed = False
        self.last_result: _write.SaveResult | None = None  # of the last save that committed
        self._previous_handler: Any = None
        self._preemption = bool(preemption)
        if self._preemption:
            self._previous_handler = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def __repr__(self) -> str:
        if self.remote is not None:
            return f"CheckpointManager(local={self.store.url!r}, remote={self.remote.url!r})"
        return f"CheckpointManager({self.store.url!r})"

    @property
    def last_replicated(self) -> int | None:
        """The newest step this manager copied to the remote tier (None: none yet, or one tier)."""
        return None if self._replicator is None else self._replicator.last

    @property
    def last_replication(self) -> CopyReport | None:
        """What the last replication that committed transferred (chunks and bytes copied, chunks
        the remote already held); None before the first one."""
        return None if self._replicator is None else self._replicator.report

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- saving ------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        tree: Any,
        metrics: Mapping[str, Any] | None = None,
        *,
        force: bool = False,
        user: Any = None,
    ) -> bool:
        """Save ``tree`` as ``step`` if the policy says so (see the class); True when it saved.

        ``metrics`` (names to numbers) and ``user`` (plain data) are stored with the step.
        """
        self._check_open()
        step = _step(step)
        metrics_ = _metrics(metrics)
        metadata = {"step": step, "metrics": metrics_, "user": user}
        check_metadata(metadata)
        self._collect(block=False)  # an earlier failure surfaces here
        self._raise_replication_error()  # and an upload's
        preempted = self._preempted
        if not (force or preempted or self._policy.due(step, self._clock() - self._last_save)):
            return False
        best = self._policy.best_metric
        if self._policy.keep_best is not None and best not in metrics_:
            raise InvalidInputError(
                f"keep_best ranks steps by metric {best!r}, but save({step}) got metrics "
                f"{sorted(metrics_)}; pass metrics={{{best!r}: value}}"
            )
        self._collect(block=True)  # one save in flight at most; raises the previous one's error
        if step in self._known and not force:
            if preempted:
                return False
            raise CheckpointExistsError(
                f"step {step} is already saved in {self.store.url} as {step_name(step)!r}; "
                "pass force=True to replace it",
                checkpoint=step_name(step),
            )
        if self._background is None:
            prepared = _write.prepare(tree)
            self._last_save = self._clock()
            self._commit(prepared, step, metadata, force)
            return True
        prepared = self._snapshot.take(tree)
        self._last_save = self._clock()
        self._pending = step
        self._background.submit(lambda: self._commit(prepared, step, metadata, force))
        if preempted:
            self._collect(block=True)
        return True

    def _commit(self, prepared: _write.Prepared, step: int, metadata: Any, overwrite: bool) -> None:
        name = step_name(step)
        self.last_result = _write.write(
            self.store.storage,
            prepared,
            name,
            metadata=metadata,
            options=self._options,
            overwrite=overwrite,
            previous=self._previous(),
        )
        self._known.add(step)
        self._last_step = step
        every = self._replicate_every
        if self._replicator is not None and (every is None or step % every == 0 or self._preempted):
            self._replicator.request(step)  # never waits for the upload
        self._retain()

    def _previous(self) -> str | bool:
        """The checkpoint whose chunks the next save takes as present: this manager's last step
        (the newest it knows if that one is gone), else the store's newest; False when not
        trusting any."""
        if not self._trust_previous:
            return False
        last = self._last_step if self._last_step in self._known else max(self._known, default=None)
        return True if last is None else step_name(last)

    def _retain(self) -> None:
        """Delete the steps the policy no longer keeps, then gc. This runs after the commit: the
        step is saved whatever happens here, so a failure is logged (logger ``treestore``), not
        raised, and retention and gc run again after the next save."""
        try:
            infos = self._infos()
            # The steps being replicated stay until they are copied.
            busy = set() if self._replicator is None else self._replicator.busy()
            keep = self._policy.retained(infos) | busy
            for step, info in infos.items():
                if step not in keep:
                    with contextlib.suppress(CheckpointNotFoundError):  # deleted by someone else
                        self.store.delete(info.name)
                    self._known.discard(step)
                    self._gc_due = True
            if self._gc_due:
                try:
                    report = self.store.gc(grace=0, wait=0)
                    # A damaged checkpoint keeps gc from freeing anything (it logs which): retry
                    # after the next save, in case it has been deleted or repaired by then.
                    self._gc_due = bool(report.damaged)
                except StoreBusyError:
                    pass  # a save is in flight somewhere: gc again after the next save
        except TreestoreError as exc:
            _log.warning(
                "%s: retention after a save failed (%s: %s); the step is saved, and retention "
                "runs again after the next save",
                self.store.url,
                type(exc).__name__,
                exc,
            )

    def _collect(self, *, block: bool) -> None:
        if self._background is not None and (block or self._background.done()):
            try:
                self._background.collect()
            finally:
                self._pending = None

    def _raise_replication_error(self) -> None:
        error = None if self._replicator is None else self._replicator.take_error()
        if error is not None:
            raise error

    def wait(self) -> None:
        """Wait for the save in flight and the replications asked for; raise the error of a
        save or an upload that failed."""
        self._collect(block=True)
        if self._replicator is not None:
            self._replicator.drain()
        self._raise_replication_error()

    def close(self) -> None:
        """Finish the save in flight (raising its error), stop the worker, and put back the
        SIGTERM handler this manager replaced. Closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            if self._background is not None:
                self._background.shutdown()
            if self._replicator is not None:
                self._replicator.close()
            self._snapshot.clear()
            if (
                self._preemption
                and threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) == self._on_sigterm
            ):
                signal.signal(signal.SIGTERM, self._previous_handler)

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidInputError(f"{self!r} is closed")

    # -- preemption --------------------------------------------------------------------------
    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._preempted = True
        if callable(self._previous_handler):
            self._previous_handler(signum, frame)

    def reached_preemption(self, step: int) -> bool:
        """True once a SIGTERM arrived (with ``preemption=True``) and ``step`` is committed: the
        loop may stop. While it is False after a SIGTERM, the next ``save`` saves at once."""
        step = _step(step)
        if not self._preempted:
            return False
        if self._pending == step:
            self._collect(block=True)
        return step in self._known

    # -- reading -----------------------------------------------------------------------------
    def _infos(self) -> dict[int, StepInfo]:
        """The steps committed in the local tier."""
        return _step_infos(self.store)

    def _tiers(self) -> dict[int, tuple[StepInfo, Store]]:
        """Each step committed in either tier, with the store to load it from (the local one
        when both have it). A remote that cannot be listed is logged and left out."""
        out = {step: (info, self.store) for step, info in self._infos().items()}
        if self.remote is not None:
            try:
                remote = _step_infos(self.remote)
            except TreestoreError as exc:
                _log.warning(
                    "%s: listing the remote tier failed (%s: %s); using the local tier only",
                    self.remote.url,
                    type(exc).__name__,
                    exc,
                )
                remote = {}
            for step, info in remote.items():
                out.setdefault(step, (info, self.remote))
        return out

    def steps(self) -> list[int]:
        """The committed steps (of either tier), oldest first."""
        return sorted(self._tiers())

    def latest_step(self) -> int | None:
        """The newest committed step (of either tier), or None when there is none."""
        return max(self._tiers(), default=None)

    def info(self, step: int | None = None) -> StepInfo:
        """What was stored with ``step`` (default: the newest step)."""
        return self._find(step)[0]

    def restore(
        self,
        like: Any = None,
        step: int | None = None,
        *,
        select: Any = None,
        cast: bool = False,
        partial: bool = False,
        types: Iterable[type] | None = None,
    ) -> Any:
        """The tree of ``step`` (default: the newest, of either tier), after waiting for the save
        in flight.

        With ``like`` (a tree of arrays, ``jax.ShapeDtypeStruct`` or scalars, e.g. a freshly
        initialised train state) the result has its structure and types; ``select``, ``cast``,
        ``partial`` and ``types`` are as in :meth:`Store.load` (``cast=True`` resumes a flax
        ``TrainState`` whose step was saved as a Python int into one whose step is an array, and
        back). A step whose local copy is damaged is loaded from the remote tier when it has it.
        """
        self.wait()
        info, store = self._find(step)
        kwargs: dict[str, Any] = {"like": like, "select": select, "cast": cast, "partial": partial}
        if types is not None:
            kwargs["types"] = types
        try:
            return store.load(info.name, **kwargs)
        except CorruptionError as exc:
            if store is not self.store or self.remote is None or info.step not in _step_infos(self.remote):
                raise
            _log.warning(
                "%s: %s is damaged locally (%s); loading it from the remote tier %s",
                self.store.url,
                info.name,
                exc,
                self.remote.url,
            )
            return self.remote.load(info.name, **kwargs)

    def _find(self, step: int | None) -> tuple[StepInfo, Store]:
        tiers = self._tiers()
        step = max(tiers, default=None) if step is None else _step(step)
        where = self.store.url if self.remote is None else f"{self.store.url} or {self.remote.url}"
        if step is None:
            raise CheckpointNotFoundError(f"no steps saved in {where}")
        if step not in tiers:
            shown = ", ".join(map(str, sorted(tiers)[-10:])) or "none"
            raise CheckpointNotFoundError(
                f"step {step} is not saved in {where}; saved steps: {shown}",
                checkpoint=step_name(step),
            )
        return tiers[step]


# The doctests of the methods: the classes report themselves as treestore.X (or treestore.types.X),
# which hides their methods from doctest's search of this module.
__test__ = {
    f"{cls.__name__}.{name}": getattr(cls, name)
    for cls in (CheckpointManager,)
    for name, value in vars(cls).items()
    if not name.startswith("__") and ">>>" in (getattr(value, "__doc__", None) or "")
}
