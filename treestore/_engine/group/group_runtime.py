"""What a multi-process save synchronises through: a key-value store and named barriers.

In a ``jax.distributed`` job that is JAX's own runtime (:class:`JaxRuntime`: the coordination
service's client, whose barriers take a timeout). :class:`LocalRuntime` gives the same to threads
of one process standing in for a job's processes, so a whole multi-process save runs in one test
or benchmark (:func:`treestore._engine.group.distributed.joined`).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

from treestore._tree.jax_import import jax
from treestore.errors import StorageError


class Runtime(Protocol):
    """The job's synchronisation, as one process of it sees it."""

    @property
    def job(self) -> int:
        """Which job this is, for this process: the same for every runtime of one job (its
        restores are numbered per job, :mod:`treestore._engine.group.restore_vote`)."""

    def set(self, key: str, value: str) -> None:
        """Set ``key`` (replacing any value)."""

    def get(self, key: str, timeout: float) -> str | None:
        """The value of ``key``, waiting up to ``timeout`` seconds for it to be set; None after."""

    def items(self, prefix: str) -> dict[str, str]:
        """Every key set under ``prefix`` (a folder: it ends with ``/``), with its value: one
        request, whatever the number of keys."""

    def delete(self, prefix: str) -> None:
        """Delete ``prefix`` and every key under it."""

    def wait(self, barrier: str, timeout: float) -> str | None:
        """Wait until every process of the job has reached ``barrier`` (each name used once):
        None then; else, once ``timeout`` seconds have passed since the first process reached it,
        why not. A process reaching a barrier that has failed learns so at once."""


def _ms(seconds: float) -> int:
    return max(1, min(int(seconds * 1000), 2**31 - 1))


class JaxRuntime:
    """JAX's distributed runtime: the client ``jax.distributed.initialize`` connected."""

    def __init__(self) -> None:
        client = jax._src.distributed.global_state.client
        if client is None:
            raise StorageError(
                f"this is process {jax.process_index()} of {jax.process_count()}, but "
                "jax.distributed is not initialized: a multi-process save synchronises through "
                "it (call jax.distributed.initialize() first)"
            )
        self._client: Any = client

    @property
    def job(self) -> int:
        return id(self._client)  # jax.distributed.initialize makes a new client for a new job

    def set(self, key: str, value: str) -> None:
        self._client.key_value_set(key, value, allow_overwrite=True)

    def get(self, key: str, timeout: float) -> str | None:
        try:
            return str(self._client.blocking_key_value_get(key, _ms(timeout)))
        except Exception:  # JaxRuntimeError DEADLINE_EXCEEDED, or the service is gone
            return None

    def items(self, prefix: str) -> dict[str, str]:
        return {str(k): str(v) for k, v in self._client.key_value_dir_get(prefix)}

    def delete(self, prefix: str) -> None:
        self._client.key_value_delete(prefix)

    def wait(self, barrier: str, timeout: float) -> str | None:
        try:
            self._client.wait_at_barrier(barrier, _ms(timeout))
        except Exception as exc:  # JaxRuntimeError: the barrier timed out (or the service failed)
            return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        return None


class LocalRuntime:
    """A job of ``count`` threads of this process (each saving as one process, see
    :func:`treestore._engine.group.distributed.joined`), synchronised as JAX's runtime would."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._cond = threading.Condition()
        self._values: dict[str, str] = {}
        self._arrived: dict[str, int] = {}
        self._first: dict[str, float] = {}
        self._failed: set[str] = set()

    @property
    def job(self) -> int:
        return id(self)

    def set(self, key: str, value: str) -> None:
        with self._cond:
            self._values[key] = value
            self._cond.notify_all()

    def get(self, key: str, timeout: float) -> str | None:
        with self._cond:
            self._cond.wait_for(lambda: key in self._values, timeout)
            return self._values.get(key)

    def items(self, prefix: str) -> dict[str, str]:
        with self._cond:
            return {k: v for k, v in self._values.items() if k.startswith(prefix)}

    def delete(self, prefix: str) -> None:
        with self._cond:
            for k in [k for k in self._values if k.startswith(prefix)]:
                del self._values[k]

    def wait(self, barrier: str, timeout: float) -> str | None:
        with self._cond:
            if barrier in self._failed:
                return "the barrier had already timed out"
            self._arrived[barrier] = self._arrived.get(barrier, 0) + 1
            deadline = self._first.setdefault(barrier, time.monotonic()) + timeout
            self._cond.notify_all()

            def done() -> bool:
                return self._arrived[barrier] >= self.count or barrier in self._failed

            while not done() and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            if self._arrived[barrier] >= self.count and barrier not in self._failed:
                return None
            self._failed.add(barrier)
            self._cond.notify_all()
            return f"timed out: {self._arrived[barrier]} of {self.count} processes reached the barrier"
