"""Following a store while it is written: each checkpoint once it is committed, in commit order.

A poll is one listing of ``checkpoints/`` (one LIST request on an object store) and one read of
each commit record not yet yielded (a damaged one is read again at each poll, so that a repair is
seen); the manifest of a new checkpoint is read, verified, just before it is yielded. Polls back
off exponentially while nothing new appears.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from treestore._api.checkpoint import Checkpoint
from treestore._api.spec import parse_spec
from treestore._engine.reading import committed as _committed
from treestore._format import paths as _paths
from treestore._format.commit_record import CommitRecord
from treestore._storage.base import Storage
from treestore._storage.registry import open_storage
from treestore.errors import (
    CheckpointNotFoundError,
    DamagedError,
    InvalidInputError,
    StorageError,
    TreestoreError,
    UnsupportedFormatError,
)

log = logging.getLogger("treestore.watch")


class _Poller:
    """What a watcher has seen: the names of checkpoints yielded (or older than ``since``), and
    the damaged ones, each with what identifies its damage: the manifest digest its commit
    record names (None while the record itself cannot be read) and the problem.

    A damaged checkpoint is read again at each poll (its commit record, then the manifest it
    names), not only when its record's listed size or time changes: a manifest repaired in place
    (the same bytes written back to its content address) changes neither, and is reported as
    soon as it verifies. The warning is logged once per damage (digest and problem)."""

    def __init__(self, storage: Storage, after: tuple[float, str] | None) -> None:
        self.storage = storage
        self.after = after
        self.seen: set[str] = set()
        self.damaged: dict[str, tuple[bytes | None, str]] = {}

    def _skip(self, name: str, manifest: bytes | None, exc: TreestoreError) -> None:
        damage = (manifest, str(exc))
        if self.damaged.get(name) != damage:
            log.warning("watch %s: skipping checkpoint %r: %s", self.storage.url, name, exc)
        self.damaged[name] = damage

    def poll(self) -> list[CommitRecord]:
        """The commit records of checkpoints not yet yielded, in commit order."""
        try:
            listing = self.storage.list(_paths.CHECKPOINTS)
        except StorageError as exc:  # a network blip must not end a watch: retry at the next poll
            log.warning("watch %s: listing failed, retrying: %s", self.storage.url, exc)
            return []
        found = []
        for obj in listing:
            name = _paths.parse_record(obj.path)
            if name is None or name in self.seen:
                continue  # not a commit record (SPEC.md, section 3.1), or yielded already
            try:
                record = _committed.read_commit_record(self.storage, name)
            except CheckpointNotFoundError:
                continue  # deleted since the listing
            except (DamagedError, UnsupportedFormatError) as exc:
                self._skip(name, None, exc)
                continue
            except StorageError as exc:
                log.warning("watch %s: reading %r failed, retrying: %s", self.storage.url, name, exc)
                continue
            if self.after is not None and _paths.commit_order(record) <= self.after:
                self.seen.add(name)
                continue
            found.append(record)
        return sorted(found, key=_paths.commit_order)

    def open(self, record: CommitRecord) -> Checkpoint | None:
        """The verified view of a new checkpoint, or None (with a warning) when it is damaged."""
        try:
            columns = _committed.read_columns(self.storage, record)
        except (DamagedError, UnsupportedFormatError) as exc:
            self._skip(record.name, record.manifest, exc)
            return None
        except StorageError as exc:
            log.warning("watch %s: reading %r failed, retrying: %s", self.storage.url, record.name, exc)
            return None
        self.seen.add(record.name)
        self.damaged.pop(record.name, None)
        return Checkpoint(self.storage, columns)


def watch(
    url: str | os.PathLike[str],
    *,
    since: str | None = None,
    timeout: float | None = None,
    min_poll: float = 0.1,
    max_poll: float = 5.0,
    stop: threading.Event | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Iterator[Checkpoint]:
    """Yield each checkpoint of a store once it is committed, never a partial one.

    Each name is yielded once, in commit order (commit record ``created``, then name, among the
    checkpoints one poll finds; one committed after a poll comes after everything that poll
    found), until ``timeout`` seconds pass without a new one, ``stop`` is set or the generator
    is closed. A store that does not exist yet is waited for; each poll lists the store once. A
    damaged commit record or manifest is skipped with a warning on the ``treestore.watch``
    logger, once, and read again at each poll: once it is repaired it is yielded, once; a failed
    listing is retried at the next poll. A checkpoint overwritten under a name already yielded
    is not yielded again.

    Args:
        url: The store: a local path or an fsspec URL.
        since: Yield only the checkpoints committed after this one (which must exist); without
            it the checkpoints already in the store come first.
        timeout: Stop after this many seconds without a new checkpoint (default: never).
        min_poll: Seconds between the first polls.
        max_poll: The longest wait between polls, reached by doubling while nothing new appears.
        stop: An event that ends the watch when set.
        storage_options: Options for the fsspec filesystem.

    Yields:
        Checkpoint: A :class:`Checkpoint` view of each new checkpoint.

    Raises:
        CheckpointNotFoundError: ``since`` names no checkpoint.
        InvalidInputError: ``url`` names a checkpoint (``URL#NAME``), or the poll intervals or
            ``timeout`` are out of range (``0 < min_poll <= max_poll``, ``timeout >= 0``).

    Examples:
        >>> import numpy as np, treestore
        >>> url = "memory://doc/watch"
        >>> _ = treestore.save(url, {"w": np.zeros(2)}, "step-1")
        >>> _ = treestore.save(url, {"w": np.ones(2)}, "step-2")
        >>> [c.name for c in treestore.watch(url, timeout=0)]
        ['step-1', 'step-2']
        >>> [c.name for c in treestore.watch(url, since="step-1", timeout=0)]
        ['step-2']
    """
    if not 0 < min_poll <= max_poll:
        raise InvalidInputError(
            f"poll intervals need 0 < min_poll <= max_poll, got {min_poll} and {max_poll}"
        )
    if timeout is not None and timeout < 0:
        raise InvalidInputError(f"timeout must be at least 0 seconds, got {timeout}")
    base, name = parse_spec(url)
    if name is not None:
        raise InvalidInputError(f"watch a store (its URL without #NAME), not checkpoint {name!r}")
    storage = open_storage(base, storage_options)
    after = None
    if since is not None:
        record = _committed.read_commit_record(storage, since)
        after = _paths.commit_order(record)
    return _follow(_Poller(storage, after), timeout, min_poll, max_poll, stop)


def _follow(
    poller: _Poller, timeout: float | None, min_poll: float, max_poll: float, stop: threading.Event | None
) -> Iterator[Checkpoint]:
    delay = min_poll
    quiet_since = time.monotonic()
    while stop is None or not stop.is_set():
        new = False
        for record in poller.poll():
            ckpt = poller.open(record)
            if ckpt is None:
                continue
            new = True
            yield ckpt
            if stop is not None and stop.is_set():
                return
        if new:
            delay = min_poll
            quiet_since = time.monotonic()  # the time the consumer took does not count
            continue
        wait = delay
        if timeout is not None:
            left = timeout - (time.monotonic() - quiet_since)
            if left <= 0:
                return
            wait = min(wait, left)
        if stop is not None:
            if stop.wait(wait):
                return
        else:
            time.sleep(wait)
        delay = min(delay * 2, max_poll)
