"""How many threads a save, load, verify or copy uses, and the pools they run in.

The pools are kept between calls, one per role and size: a thread started per call waits for
the scheduler to run it on cores the threads started before it keep busy, which cost a one-leaf
read of MiniLM a large share of its time, and a new thread faulted its scratch buffers in again. A
process forked from one that has used them starts with none (its copies of the threads do not
run).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from treestore.errors import OutOfMemoryError

T = TypeVar("T")
K = TypeVar("K")


def default_threads() -> int:
    """Hashing, compression and I/O overlap: twice the cores, at least 4."""
    return max(4, 2 * (os.cpu_count() or 2))


def compute_threads(threads: int, waits_elsewhere: bool) -> int:
    """How many of ``threads`` hash and compress a save's chunks. Where their writes block (an
    object store's PUT) they need all of them, to overlap; where the waiting for the disk is done
    by threads of its own (:meth:`Storage.stage` on a local disk), one per core keeps every core
    busy without the switching and scratch memory of more."""
    return min(threads, os.cpu_count() or 1) if waits_elsewhere else threads


def once(table: dict[K, cf.Future[T]], key: K, lock: threading.Lock, compute: Callable[[], T]) -> T:
    """``compute()`` for ``key``, run by the first thread that asks: the others, and later calls,
    wait for its result (or get its error) from ``table``, which ``lock`` guards."""
    with lock:
        done = table.get(key)
        first = done is None
        if done is None:
            done = table[key] = cf.Future()
    if first:
        try:
            done.set_result(compute())
        except BaseException as exc:
            done.set_exception(exc)
            raise
    return done.result()


_pools: dict[tuple[str, int], cf.ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def shared_pool(threads: int, role: str) -> cf.ThreadPoolExecutor:
    """The process's pool of ``threads`` threads for ``role`` ("read", "save", "publish"). Jobs
    in it never wait for jobs of the same role that have not started, so callers sharing it
    cannot deadlock it; never shut it down."""
    key = (role, threads)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = cf.ThreadPoolExecutor(threads, thread_name_prefix=f"treestore-{role}")
            # Start every thread now: the executor starts one only when a job finds none idle,
            # which a call that runs its jobs on a few threads of its own may not.
            started = threading.Barrier(threads)
            try:
                for _ in range(threads):
                    pool.submit(started.wait, 10.0)
            except RuntimeError as exc:  # no thread could be made: out of memory or of threads
                del _pools[key]
                started.abort()
                pool.shutdown(wait=False)
                raise _no_threads(exc, threads, role) from None
        return pool


def _no_threads(exc: RuntimeError, threads: int, role: str) -> OutOfMemoryError:
    return OutOfMemoryError(
        f"cannot start {threads} {role} thread(s) ({exc}): this process is out of memory or of threads"
    )


def _forget_pools() -> None:
    global _pools_lock
    _pools.clear()  # a forked child has none of the parent's threads
    _pools_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


class Batch:
    """The jobs one call submits to a shared pool, to be cancelled and waited for together."""

    def __init__(self, pool: cf.Executor) -> None:
        self._pool = pool
        self._futures: list[cf.Future[Any]] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> cf.Future[T]:
        future = self._pool.submit(fn, *args, **kwargs)
        with self._lock:
            self._futures.append(future)
        return future

    def cancel(self) -> None:
        """Cancel the jobs not started and wait for those running (their outcomes are dropped)."""
        with self._lock:
            futures = list(self._futures)
        for f in futures:
            f.cancel()
        cf.wait(futures)


def run_all(jobs: Sequence[Callable[[], object]], threads: int, role: str) -> None:
    """Run ``jobs`` on up to ``threads`` threads of the ``role`` pool, each thread taking the
    next job not yet taken, so a call costs a handful of hand-offs rather than one per job (a
    load's 50 chunk futures cost more than the waiting they saved). The first error propagates
    once the running jobs end; jobs not yet taken are skipped."""
    if threads <= 1 or len(jobs) <= 1:
        for job in jobs:
            job()
        return
    todo = iter(jobs)
    take = threading.Lock()
    failed = threading.Event()

    def drain() -> None:
        while not failed.is_set():
            with take:
                job = next(todo, None)
            if job is None:
                return
            try:
                job()
            except BaseException:
                failed.set()
                raise

    pool = shared_pool(threads, role)
    futures = []
    try:
        for _ in range(min(threads, len(jobs))):
            futures.append(pool.submit(drain))
    except RuntimeError as exc:  # the executor replaces a thread that ended: that can fail too
        failed.set()
        cf.wait(futures)
        raise _no_threads(exc, threads, role) from None
    try:
        cf.wait(futures)
    except BaseException:  # interrupted: the threads stop after the jobs they are running
        failed.set()
        cf.wait(futures)
        raise
    for f in futures:
        f.result()  # a failure, if any: the first thread's to fail in the order they started
