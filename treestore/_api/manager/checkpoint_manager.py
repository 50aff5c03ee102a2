"""The checkpoint manager: when to save a training loop's state, which steps to keep, async saves,
preemption, two tiers (fast local saves replicated to a remote store), and resuming (see
:class:`CheckpointManager`)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from treestore._api.copy import CopyReport
from treestore._api.manager.options import RemoteTier, Retention, read_options
from treestore._api.manager.preemption import Preemption
from treestore._api.manager.replication import Replicator, open_remote
from treestore._api.manager.retention import (
    HealthCheck,
    Policy,
    StepInfo,
    check_metrics,
    check_step,
    deleted_by_retention,
    gc_after_retention,
    step_infos,
)
from treestore._api.manager.save_queue import SaveQueue
from treestore._api.manager.tiers import Tiers
from treestore._api.store import Store
from treestore._engine import write as _write
from treestore._format.manifest.rules import check_metadata
from treestore._format.paths import step_name
from treestore._tree import prepare as _prepare
from treestore.errors import (
    CheckpointExistsError,
    InvalidInputError,
    TreestoreError,
)

_log = logging.getLogger("treestore")


class CheckpointManager:
    """Saves a training loop's state every so often, keeps the steps a retention policy names,
    and restores the newest (or a given) step.

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
    validated and its arrays are copied: big arrays on an accelerator are copied on their
    devices where they have the room beside the training step's peak
    (``SaveOptions.device_snapshot``), the rest to host, into one host copy of the last save
    that is kept to reuse (``SaveOptions.keep_host_copies=False`` drops it after each save);
    hashing, compressing, writing,
    retention and gc run on one background thread. At most one save is in flight: a save waits
    for the previous one. An error of a background save is raised, as it was raised, by the next
    ``save``, ``wait``, ``restore`` or ``close`` that finds it finished, and that call saves
    nothing; a failed save leaves no visible checkpoint. ``steps()``, ``latest_step()`` and
    ``info()`` list committed steps only (``wait()`` first to include one in flight).

    **Retention.** ``retention=treestore.Retention(keep_last=N, keep_every=K, keep_best=N,
    best_metric=..., best_mode=...)`` (see :class:`Retention`) names the steps kept: the N newest,
    every step divisible by K, the N best by a metric (which every save must then pass); a step is
    kept if any rule keeps it, and the newest step is always kept; with no rule every step is
    kept. With ``keep_healthy=True`` (the default) retention protects the newest step known
    healthy; where there is none, it protects the newest step not known unhealthy (its health
    unknown: saved without statistics, or its statistics or manifest unreadable). After each save
    the other steps' checkpoints are deleted, then gc removes the chunks no checkpoint uses; gc
    never touches a save in flight in any process and is retried later when one is. Retention
    runs after the commit, so its failures are logged (logger ``treestore``), never raised: the
    step is saved. A damaged checkpoint in the store is left out of ``steps()`` (and logged), and
    keeps gc from freeing space until it is deleted.

    **Preemption.** ``preemption=True`` installs a SIGTERM handler (main thread only; it calls
    any previous Python handler, and close() puts it back). After a SIGTERM, every ``save`` saves
    its step at once (unless that step is saved already) and waits until it is committed, and
    ``reached_preemption(step)`` is True once ``step`` is committed, so the loop can stop (see
    the training guide for a loop).

    **Two tiers.** ``CheckpointManager(local="/nvme/run", remote="s3://bucket/run", ...)`` (or
    ``CheckpointManager("/nvme/run", remote=...)``) saves to the fast local store as above and
    replicates committed steps to the remote store on a background thread: every committed step,
    or with ``remote=treestore.RemoteTier(URL, replicate_every_steps=M)`` (see
    :class:`RemoteTier`) the steps divisible by M (and any step saved after a SIGTERM). A
    replication is :func:`treestore.copy` of that step: only the chunks the remote lacks are
    sent, and the remote commit record is written after all of them, so the remote never shows a
    partial step. One replication runs at a time; while it runs, a newer step replaces any step
    still waiting (the newest wins). ``save`` never waits for an upload; local retention keeps
    the step being replicated (and the one waiting) until it is copied. An upload error is
    raised, as it was raised, by the next ``save`` (which then saves nothing), ``wait`` or
    ``close``; the step stays saved locally and later replications go on. ``wait()`` and
    ``close()`` wait for the replications asked for. The remote tier has its own retention, the
    RemoteTier's ``keep_last`` and ``keep_every`` (the newest replicated step is always kept;
    with neither, every replicated step is kept), applied after each replication, then remote
    gc. ``steps()``, ``latest_step()``, ``info()`` and ``restore()`` see the steps of both tiers:
    ``restore()`` loads the newest step committed in either (from the local copy when it has
    one, and from the remote when the local copy is damaged), so a job whose machine was lost
    resumes from the remote store into an empty local folder. A remote that cannot be listed is
    logged and only the local tier is used.

    A manager is meant for one training loop: call it from one thread.

    Args:
        url: The store (a local path or fsspec URL); or give ``local=`` instead.
        local: The local tier's store, with ``remote=`` for two tiers.
        remote: The remote tier: its store's URL, or a :class:`RemoteTier` (its URL, retention,
            which steps are replicated, fsspec options).
        retention: Which steps to keep (:class:`Retention`; default: every step).
        save_every_steps: ``save`` saves a step divisible by this.
        save_every_seconds: ``save`` saves once this many seconds passed since the last save.
        async_save: Hash, compress, write and apply retention on a background thread.
        preemption: Install a SIGTERM handler that makes the next save save at once.
        options: Chunk sizes, packing, threads and statistics of every save (:class:`SaveOptions`).
        clock: The clock ``save_every_seconds`` is measured on.
        storage_options: fsspec options of the (local) store.
        trust_previous: False checks every chunk in the store instead of trusting the newest
            checkpoint's manifest.
        keep_healthy: Never let retention delete the newest step known to be healthy (its
            statistics show no NaN/inf; a step without statistics is unknown, never healthy),
            or where no step is, the newest step not known unhealthy; in both tiers.
        healthy: ``healthy(info, stats) -> bool``, a further test of health over a step's
            :class:`StepInfo` and its statistics by address; a step it rejects counts as
            unhealthy, one it raises on as unknown.
        **deprecated: The flat keywords that ``retention=`` and ``remote=`` replace, still
            taken with a DeprecationWarning naming the replacement: ``keep_last``,
            ``keep_every``, ``keep_best``, ``best_metric`` and ``best_mode`` (the
            :class:`Retention`'s); ``replicate_every_steps``, ``remote_keep_last``,
            ``remote_keep_every`` and ``remote_storage_options`` (the :class:`RemoteTier`'s
            ``replicate_every_steps``, ``keep_last``, ``keep_every`` and ``storage_options``).

    Raises:
        InvalidInputError: Contradictory or out-of-range settings (both ``url`` and ``local``,
            tier settings without ``remote``, an option object and the flat keywords it
            replaces, a negative count, ``preemption`` off the main thread).

    Examples:
        >>> import numpy as np, treestore
        >>> keep = treestore.Retention(keep_last=2)
        >>> with treestore.CheckpointManager("memory://doc/mgr", save_every_steps=10, retention=keep) as m:
        ...     for step in range(0, 35):
        ...         w = np.full(2, step, np.float32)
        ...         saved = m.save(step, {"w": w}, metrics={"loss": 1 / (step + 1)})
        ...     m.wait()
        ...     m.steps(), m.latest_step(), m.restore()["w"], m.info(30).metrics["loss"]
        ([20, 30], 30, array([30., 30.], dtype=float32), 0.03225806451612903)
    """

    def __init__(
        self,
        url: str | os.PathLike[str] | None = None,
        *,
        local: str | os.PathLike[str] | None = None,
        remote: str | os.PathLike[str] | RemoteTier | None = None,
        retention: Retention | None = None,
        save_every_steps: int | None = None,
        save_every_seconds: float | None = None,
        async_save: bool = True,
        preemption: bool = False,
        options: _write.SaveOptions | None = None,
        clock: Callable[[], float] = time.monotonic,
        storage_options: dict[str, Any] | None = None,
        trust_previous: bool = True,
        keep_healthy: bool = True,
        healthy: HealthCheck | None = None,
        **deprecated: Any,
    ) -> None:
        rules, tier = read_options(retention, remote, deprecated)
        self._policy = Policy(
            save_every_steps=save_every_steps,
            save_every_seconds=save_every_seconds,
            keep_healthy=keep_healthy,
            healthy=healthy,
            **dataclasses.asdict(rules),
        )
        self._preemption = Preemption(preemption)  # off the main thread: refused before anything
        if (url is None) == (local is None):
            raise InvalidInputError("give the store's URL, or local= (with remote= for two tiers), once")
        local_url = os.fspath(url if url is not None else local)  # type: ignore[arg-type]
        self.store = Store(local_url, storage_options=storage_options)
        self.remote: Store | None = None  # the remote tier's store
        self._replicator: Replicator | None = None
        if tier is not None:
            self.remote, self._replicator = open_remote(
                self.store, (local_url, storage_options), tier, keep_healthy, healthy
            )
        self._tiers = Tiers(self.store, self.remote, self._policy.healthy)
        self._options = options or _write.SaveOptions()
        self._clock = clock
        self._last_save = clock()
        self._saves = SaveQueue(bool(async_save), self._options)  # the save in flight
        self._snapshot = self._saves.snapshot  # the host copy of the last async save
        self._known = set(self._infos())  # committed steps (this manager's view)
        self._trust_previous = bool(trust_previous)
        self._last_step = max(self._known, default=None)  # the step whose chunks a save trusts
        self._gc_due = False
        self._closed = False
        self.last_result: _write.SaveResult | None = None  # of the last save that committed
        self._preemption.install()  # last: a failure above leaves no handler behind

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
        """Save ``tree`` as ``step`` if the policy says so (see the class).

        Args:
            step: The training step (a non-negative int); steps only grow.
            tree: The pytree to save.
            metrics: Names to numbers stored with the step (``keep_best`` ranks by one).
            force: Save (or replace) the step whatever the intervals say.
            user: Plain data stored with the step.

        Returns:
            Whether it saved (with ``async_save``, whether a save was started).

        Raises:
            InvalidInputError: A bad step, metric or leaf, or the manager is closed (nothing
                saved).
            CheckpointExistsError: ``step`` is already saved (or in flight) and ``force`` is
                False.
            TreestoreError: The previous background save or replication failed, as it failed.
        """
        self._check_open()
        step = check_step(step)
        metrics_ = check_metrics(metrics)
        metadata = {"step": step, "metrics": metrics_, "user": user}
        check_metadata(metadata)
        self._collect(block=False)  # an earlier failure surfaces here
        self._raise_replication_error()  # and an upload's
        preempted = self._preemption.arrived
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
        # Async: the tree is copied first, so the caller may change it. Only the commit holds the
        # copy (no local of this frame), so that it is freed once written (SaveQueue.submit).
        self._saves.submit(
            step, functools.partial(self._commit, self._saves.prepare(tree), step, metadata, force)
        )
        self._last_save = self._clock()
        if preempted:
            self._collect(block=True)
        return True

    def _commit(self, prepared: _prepare.Prepared, step: int, metadata: Any, overwrite: bool) -> None:
        name = step_name(step)
        self.last_result = _write.write(
            self.store._storage,
            prepared,
            name,
            metadata=metadata,
            options=self._options,
            overwrite=overwrite,
            previous=self._previous(),
        )
        self._known.add(step)
        self._last_step = step
        if self._replicator is not None:  # a step saved after a SIGTERM is always replicated
            self._replicator.offer(step, always=self._preemption.arrived)
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
            # The steps being replicated stay until they are copied.
            busy = set() if self._replicator is None else self._replicator.busy()
            for step in deleted_by_retention(self.store, self._policy, busy):
                self._known.discard(step)
                self._gc_due = True
            if self._gc_due:
                self._gc_due = gc_after_retention(self.store)
        except TreestoreError as exc:
            _log.warning(
                "%s: retention after a save failed (%s: %s); the step is saved, and retention "
                "runs again after the next save",
                self.store.url,
                type(exc).__name__,
                exc,
            )

    def _collect(self, *, block: bool) -> None:
        self._saves.collect(block=block)

    def _raise_replication_error(self) -> None:
        error = None if self._replicator is None else self._replicator.take_error()
        if error is not None:
            raise error

    def wait(self) -> None:
        """Wait for the save in flight and the replications asked for.

        Raises:
            TreestoreError: A background save or an upload failed (the error it raised).
        """
        self._collect(block=True)
        if self._replicator is not None:
            self._replicator.drain()
        self._raise_replication_error()

    def close(self) -> None:
        """Finish the save in flight, stop the worker, and put back the SIGTERM handler this
        manager replaced. Closing twice is harmless.

        Raises:
            TreestoreError: The save in flight or an upload failed (the error it raised); the
                manager is closed all the same.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            self._saves.close()
            if self._replicator is not None:
                self._replicator.close()
            self._preemption.uninstall()

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidInputError(f"{self!r} is closed")

    # -- preemption --------------------------------------------------------------------------
    def reached_preemption(self, step: int) -> bool:
        """Whether a SIGTERM arrived (with ``preemption=True``) and ``step`` is committed: the
        loop may stop. While it is False after a SIGTERM, the next ``save`` saves at once.

        Args:
            step: The step the loop has just saved.

        Returns:
            True when a SIGTERM arrived and ``step`` is committed (after waiting for its save,
            when it is the one in flight).

        Raises:
            InvalidInputError: ``step`` is not an int of at least 0.
        """
        step = check_step(step)
        if not self._preemption.arrived:
            return False
        if self._saves.pending == step:
            self._collect(block=True)
        return step in self._known

    # -- reading -----------------------------------------------------------------------------
    def _infos(self) -> dict[int, StepInfo]:
        """The steps committed in the local tier."""
        return step_infos(self.store)

    def steps(self) -> list[int]:
        """The committed steps of either tier (a step in flight is not one until it commits).

        Returns:
            The steps, oldest first.
        """
        return sorted(self._tiers.steps())

    def latest_step(self, *, healthy: bool = False) -> int | None:
        """The newest committed step of either tier.

        Args:
            healthy: The newest known to be healthy: its recorded statistics show no NaN/inf
                and the manager's ``healthy`` check accepts it (a step whose health is unknown,
                saved without statistics or with them unreadable, is never taken for healthy);
                read from manifests alone, newest first.

        Returns:
            The step, or None when there is none.
        """
        return self._tiers.latest(healthy=healthy)

    def info(self, step: int | None = None) -> StepInfo:
        """What was stored with a step.

        Args:
            step: The step (default: the newest).

        Returns:
            StepInfo: Its :class:`StepInfo`: step, metrics, user data and creation time.

        Raises:
            CheckpointNotFoundError: No such step.
        """
        return self._tiers.find(step)[0]

    def restore(
        self,
        like: Any = None,
        step: int | None = None,
        *,
        select: Any = None,
        cast: bool = False,
        partial: bool = False,
        types: Iterable[type] | None = None,
        healthy: bool = False,
        share: bool = True,
    ) -> Any:
        """The tree of ``step`` (default: the newest, of either tier; with ``healthy=True`` the
        newest healthy one, as ``latest_step(healthy=True)`` finds it), after waiting for the save
        in flight.

        With ``like`` (a tree of arrays, ``jax.ShapeDtypeStruct`` or scalars, e.g. a freshly
        initialised train state) the result has its structure and types; ``select``, ``cast``,
        ``partial`` and ``types`` are as in :meth:`Store.load` (``cast=True`` resumes a flax
        ``TrainState`` whose step was saved as a Python int into one whose step is an array, and
        back). A step whose local copy is damaged is loaded from the remote tier when it has it.

        Args:
            like: The structure and types of the result (default: the stored tree).
            step: The step (default: the newest).
            select: Patterns over addresses: restore only the matching leaves.
            cast: With ``like``, convert to its dtypes instead of failing.
            partial: With ``like``, let it be a subset of the checkpoint.
            types: Without ``like``, the namedtuple classes and dataclasses to restore as
                themselves.
            healthy: Without ``step``, the newest step known to be healthy (as
                ``latest_step(healthy=True)``); when none is, the error names the newest step
                whose health is unknown, which retention keeps, for ``step=`` to load.
            share: In a job of several processes, read each byte ``like`` replicates across
                processes once and share it over the devices, as :meth:`Store.load` does
                (False: every process reads what its devices hold).

        Returns:
            The restored tree.

        Raises:
            CheckpointNotFoundError: No such step (or, with ``healthy``, no healthy one).
            StructureMismatchError: The step does not match ``like``.
        """
        self.wait()
        kwargs: dict[str, Any] = {"like": like, "select": select, "cast": cast, "partial": partial}
        kwargs["share"] = share
        if types is not None:
            kwargs["types"] = types
        return self._tiers.load(step, healthy=healthy, **kwargs)


# The doctests of the methods: the classes report themselves as treestore.X (or treestore.types.X),
# which hides their methods from doctest's search of this module.
__test__ = {
    f"{cls.__name__}.{name}": getattr(cls, name)
    for cls in (CheckpointManager,)
    for name, value in vars(cls).items()
    if not name.startswith("__") and ">>>" in (getattr(value, "__doc__", None) or "")
}
