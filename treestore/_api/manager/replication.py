"""The remote tier of a checkpoint manager: a thread that copies committed local steps to a remote
store, newest first, and applies the remote retention policy after each copy."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from treestore._api.copy import CopyReport
from treestore._api.copy import copy as _copy
from treestore._api.manager.options import RemoteTier
from treestore._api.manager.retention import HealthCheck, Policy, apply_retention, gc_after_retention
from treestore._api.store import Store
from treestore._format.paths import step_name
from treestore.errors import InvalidInputError, TreestoreError

_log = logging.getLogger("treestore")


def open_remote(
    local: Store,
    src: tuple[str, dict[str, Any] | None],
    tier: RemoteTier,
    keep_healthy: bool,
    healthy: HealthCheck | None,
) -> tuple[Store, Replicator]:
    """The remote tier of the manager whose local store is ``local`` (opened from ``src``, its
    URL and fsspec options): the store of ``tier`` and the replicator that copies steps there,
    under the tier's retention and the manager's rule of health.

    Raises:
        InvalidInputError: The two stores are one, or one lies inside the other (each tier's
            retention would delete the other's steps).
    """
    options = None if tier.storage_options is None else dict(tier.storage_options)
    dst = (os.fspath(tier.url), options)
    policy = Policy(
        keep_last=tier.keep_last, keep_every=tier.keep_every, keep_healthy=keep_healthy, healthy=healthy
    )
    remote = Store(dst[0], storage_options=dst[1])
    if remote._storage.overlaps(local._storage):
        raise InvalidInputError(
            f"local={local.url!r} and remote={remote.url!r} are one store, or one "
            "lies inside the other: each tier's retention would delete the other's steps"
        )
    return remote, Replicator(src, dst, remote, policy, tier.replicate_every_steps)


class Replicator:
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
        policy: Policy,
        every: int | None = None,
    ) -> None:
        self._src, self._dst, self._remote, self._policy = src, dst, remote, policy
        self._every = every  # replicate only the steps divisible by this
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

    def offer(self, step: int, *, always: bool = False) -> None:
        """Replicate committed ``step`` if it is one the tier copies (every step, or the steps
        divisible by its ``replicate_every_steps``), or ``always``; never waits for the upload."""
        if always or self._every is None or step % self._every == 0:
            self.request(step)

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
            self._gc_due |= apply_retention(self._remote, self._policy)
            if self._gc_due:  # still due after a save in flight: after the next copy
                self._gc_due = gc_after_retention(self._remote)
        except TreestoreError as exc:
            _log.warning(
                "%s: retention after replicating %s failed (%s: %s); it runs again after the next one",
                self._remote.url,
                step_name(step),
                type(exc).__name__,
                exc,
            )
