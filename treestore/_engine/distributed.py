"""Saves by several processes of one ``jax.distributed`` job (SPEC.md, section 3.4).

Every process writes the chunks of the pieces it owns, then its share of the manifest as its
staging record, in columns (:mod:`treestore._format.shares`). After a barrier the primary (process
0) reads the other processes' records concurrently, merges them with numpy into one version-2
manifest, checks it as readers check a manifest and commits; after a second barrier the others
read the outcome, and after a third the primary removes the staging records. If any process fails,
nothing is committed and every process raises.

Synchronisation goes through the job's runtime (:mod:`treestore._engine.group_runtime`: JAX's
own, in a real job) and every wait has a timeout (``BARRIER_TIMEOUT``): a process that gives up
raises BarrierTimeoutError naming the processes that did not arrive, which it learns from the mark
each process sets in the runtime's key-value store as it arrives. While it waits, a process keeps
its save lock fresh, so gc never takes the chunks of a save in flight for abandoned ones.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import contextvars
import logging
import os
import re
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgpack

from treestore._engine import locks as _locks
from treestore._engine.commit import commit
from treestore._engine.group_runtime import JaxRuntime, Runtime
from treestore._format import layout as _layout
from treestore._format.columns import Columns
from treestore._format.columns_codec import encode_columns
from treestore._format.commit_record import CommitRecord
from treestore._format.encoding import Bad
from treestore._format.limits import MAX_OUTCOME_BYTES, MAX_STAGING_BYTES
from treestore._format.manifest import ChunkRef, LeafEntry
from treestore._format.shares import (
    Share,
    decode_share,
    encode_share,
    layout_digest,
    share_from_entries,
)
from treestore._format.shares_merge import Combined, Plan, combine, merge, plan_from_entries
from treestore._storage.base import Storage
from treestore._tree.lazy_jax import jax
from treestore._tree.leaves import ArrayLeaf, Leaf
from treestore.errors import BarrierTimeoutError, StorageError

STAGING = _layout.STAGING
BARRIER_TIMEOUT = 600.0  # seconds a process waits at each step; TREESTORE_BARRIER_TIMEOUT replaces it
READERS = 64  # staging records the primary reads at once
KEEP_FRESH = 30.0  # seconds between looks at the save lock while waiting (it is rewritten every 900 s)
_ID = re.compile(r"[0-9a-f]{32}")
_log = logging.getLogger("treestore")
_joined: contextvars.ContextVar[tuple[Runtime, int, int] | None] = contextvars.ContextVar(
    "treestore_group", default=None
)


def barrier_timeout() -> float:
    """``BARRIER_TIMEOUT``, or the seconds the environment variable ``TREESTORE_BARRIER_TIMEOUT``
    gives (every process of a job should see the same)."""
    text = os.environ.get("TREESTORE_BARRIER_TIMEOUT", "").strip()
    if text:
        with contextlib.suppress(ValueError):
            return max(float(text), 0.001)
    return BARRIER_TIMEOUT


@contextlib.contextmanager
def joined(runtime: Runtime, index: int, count: int) -> Iterator[None]:
    """Saves in this block, in this thread, act as process ``index`` of a job of ``count``
    processes synchronised by ``runtime`` (a job of threads: tests and benchmarks)."""
    token = _joined.set((runtime, index, count))
    try:
        yield
    finally:
        _joined.reset(token)


def group() -> Group | None:
    """This process's Group when the job has several processes (or :func:`joined` says so),
    else None."""
    found = _joined.get()
    if found is not None:
        runtime, index, count = found
        return Group(index, count, runtime, barrier_timeout())
    count = jax.process_count()
    if count == 1:
        return None
    return Group(jax.process_index(), count, JaxRuntime(), barrier_timeout())


def _names(processes: Sequence[int]) -> str:
    text = ", ".join(map(str, processes[:12])) + (
        f" and {len(processes) - 12} more" if len(processes) > 12 else ""
    )
    return f"process {text}" if len(processes) == 1 else f"processes {text}"


@contextlib.contextmanager
def _kept_fresh(lock: _locks.Lock | None) -> Iterator[None]:
    """Keep ``lock`` from going stale while this thread waits."""
    if lock is None:
        yield
        return
    stop = threading.Event()

    def keep() -> None:
        while not stop.wait(KEEP_FRESH):
            try:
                lock.refresh(_locks.STALE_AFTER)
            except Exception as exc:  # tried again at the next look; logged, as a release is
                _log.warning("%s/%s: could not rewrite this save lock (%s)", lock.storage.url, lock.path, exc)

    keeper = threading.Thread(target=keep, name=f"{threading.current_thread().name} (lock)", daemon=True)
    keeper.start()
    try:
        yield
    finally:
        stop.set()
        keeper.join()


def _layout_of(tree: object, leaves: Sequence[tuple[str, Leaf]]) -> bytes:
    return layout_digest(
        tree,
        (
            (leaf.kind, leaf.dtype, leaf.shape) if isinstance(leaf, ArrayLeaf) and leaf.sharded else None
            for _, leaf in leaves
        ),
    )


@dataclass(frozen=True)
class Group:
    """This process's place in a multi-process save; ``save_id`` and ``name`` are set by
    :meth:`begin`."""

    index: int
    count: int
    runtime: Runtime
    timeout: float = BARRIER_TIMEOUT
    save_id: str = ""
    name: str = ""

    @property
    def primary(self) -> bool:
        return self.index == 0

    def _path(self, who: str) -> str:
        return f"{STAGING}/{self.save_id}/{who}"

    def _key(self, name: str) -> str:
        return f"treestore/save/{name}"

    def begin(self, name: str) -> Group:
        """This group for a save of checkpoint ``name``: the primary draws the save's id, the
        others wait for it (BarrierTimeoutError when the primary does not start the save)."""
        if self.primary:
            save_id = os.urandom(16).hex()
            self.runtime.set(self._key(name), save_id)
        else:
            found = self.runtime.get(self._key(name), self.timeout)
            if found is None or not _ID.fullmatch(found):
                raise BarrierTimeoutError(
                    f"multi-process save of checkpoint {name!r}: process 0 did not start it within "
                    f"{self.timeout:g} s (every process must save the same checkpoint at once); "
                    f"process {self.index} committed nothing",
                    missing=(0,),
                    checkpoint=name,
                )
            save_id = found
        return replace(self, save_id=save_id, name=name)

    def barrier(self, step: str, lock: _locks.Lock | None = None) -> None:
        """Wait until every process has reached ``step`` (keeping ``lock`` fresh meanwhile);
        BarrierTimeoutError naming those that did not, after ``timeout`` seconds."""
        root = f"treestore/{self.save_id}/{step}"
        self.runtime.set(f"{root}/{self.index}", "1")
        with _kept_fresh(lock):
            why = self.runtime.wait(root, self.timeout)
        if why is None:
            return
        arrived: set[str] = set()
        with contextlib.suppress(Exception):
            arrived = {k.rsplit("/", 1)[-1] for k in self.runtime.keys(f"{root}/")}
        missing = [i for i in range(self.count) if str(i) not in arrived]
        where = f"multi-process save of checkpoint {self.name!r}, step {step!r}"
        if not missing:
            text = f"{where}: process {self.index} arrived after the others had stopped waiting"
        else:
            text = f"{where}: {_names(missing)} (of {self.count}) did not arrive within {self.timeout:g} s"
        text += f" ({why}); "
        if step == "committed" and not self.primary and 0 in missing:
            text += "process 0 may still commit the checkpoint"
        else:
            text += "nothing was committed" if step == "written" else "see process 0 for the outcome"
        raise BarrierTimeoutError(text, missing=missing, checkpoint=self.name)

    def finish(
        self,
        storage: Storage,
        lock: _locks.Lock | None,
        tree: object,
        leaves: Sequence[tuple[str, Leaf]],
        written: tuple[list[LeafEntry], list[ChunkRef]] | None,
        failure: BaseException | None,
        header: dict[str, Any],
        *,
        overwrite: bool,
    ) -> Columns | None:
        """Share what this process wrote (``written``: its leaf entries and packs, None when
        ``failure`` stopped it), then commit (the primary: returns the committed manifest) or
        learn the outcome (the others: None). Raises unless the checkpoint was committed."""
        layout = _layout_of(tree, leaves)
        own: Share | None = None
        try:
            own = self._publish(storage, layout, leaves, written, failure)
        except Exception as exc:
            failure = failure or exc
        try:
            self.barrier("written", lock)
        except BarrierTimeoutError as exc:
            if failure is not None:
                raise failure from exc
            raise
        finally:
            if self.primary:
                with contextlib.suppress(Exception):  # everyone has it now
                    self.runtime.delete(self._key(self.name))
        if not self.primary:
            self._follow(storage, lock, failure)
            return None
        try:
            if failure is not None:
                raise failure
            assert own is not None and written is not None
            sharded = [isinstance(leaf, ArrayLeaf) and leaf.sharded for _, leaf in leaves]
            plan = plan_from_entries(tree, written[0], sharded)
            combined = self._gather(storage, plan, own, layout)
            columns = merge(plan, combined, {**header, "created": time.time()})
            record = CommitRecord(
                columns.name, b"", 0, columns.created, columns.metadata, len(columns), columns.nbytes
            )
            commit(storage, encode_columns(columns), record, overwrite=overwrite)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                self._announce(storage, exc)
            with contextlib.suppress(BarrierTimeoutError):
                self.barrier("committed", lock)
                self.barrier("acknowledged", lock)
                self._forget()
            raise
        try:  # committed: the save has succeeded, whatever follows
            self._announce(storage, None)
            self.barrier("committed", lock)
            self.barrier("acknowledged", lock)  # every process has read the outcome
        except Exception as exc:
            _log.warning("%s: committed; staging records left for gc: %s", self.name, exc)
            return columns
        self._clean(storage)
        return columns

    def _publish(
        self,
        storage: Storage,
        layout: bytes,
        leaves: Sequence[tuple[str, Leaf]],
        written: tuple[list[LeafEntry], list[ChunkRef]] | None,
        failure: BaseException | None,
    ) -> Share:
        """Write this process's staging record: its share, or the error that stopped it."""
        if failure is not None or written is None:
            share = Share.failed(f"{type(failure).__name__}: {failure}"[:2000])
        else:
            where = {address: i for i, (address, _) in enumerate(leaves)}
            share = share_from_entries(where, written[0], written[1])
        data = encode_share(share, layout)
        if len(data) > MAX_STAGING_BYTES:
            share = Share.failed(
                f"its share of the manifest takes {len(data)} bytes, over the "
                f"{MAX_STAGING_BYTES} bytes a staging record may hold: save fewer pieces"
            )
            data = encode_share(share, layout)
        storage.write(self._path(f"process-{self.index}"), [data])
        if share.error is not None and failure is None:
            raise StorageError(
                f"multi-process save of checkpoint {self.name!r}: process {self.index}: {share.error}"
            )
        return share

    def _gather(self, storage: Storage, plan: Plan, own: Share, layout: bytes) -> Combined:
        """This process's share and every other's, read concurrently, combined; StorageError
        naming every process that failed or whose staging record is missing or malformed."""

        def read(i: int) -> Share | str:
            path = self._path(f"process-{i}")
            try:
                data = storage.read(path, limit=MAX_STAGING_BYTES)
            except StorageError as exc:
                return f"its staging record cannot be read ({exc.message})"
            if data is None:
                return f"it wrote no staging record ({path})"
            try:
                share = decode_share(data, layout)
            except Bad as exc:
                return f"its staging record {path} is malformed: {exc}"
            return share if share.error is None else share.error

        others = range(1, self.count)
        with cf.ThreadPoolExecutor(max(1, min(READERS, len(others)))) as pool:
            found = list(pool.map(read, others))
        problems = {i: r for i, r in zip(others, found, strict=True) if isinstance(r, str)}
        combined = None
        if not problems:
            combined, problems = combine(plan, [own, *(r for r in found if isinstance(r, Share))])
        if combined is None:
            lines = [f"process {i}: {why}" for i, why in sorted(problems.items())]
            shown = lines[:20] + ([f"(and {len(lines) - 20} more)"] if len(lines) > 20 else [])
            raise StorageError(f"multi-process save of checkpoint {self.name!r} failed: " + "; ".join(shown))
        return combined

    def _announce(self, storage: Storage, error: BaseException | None) -> None:
        text = None if error is None else f"{type(error).__name__}: {error}"[: MAX_OUTCOME_BYTES // 8]
        data = msgpack.packb({"ok": error is None, "error": text}, use_bin_type=True)
        storage.write(self._path("outcome"), [data])

    def _outcome(self, storage: Storage) -> str | None:
        """None when the primary committed, else why not."""
        try:
            data = storage.read(self._path("outcome"), limit=MAX_OUTCOME_BYTES)
        except StorageError as exc:
            return f"its outcome record cannot be read ({exc.message})"
        if data is None:
            return "the primary process wrote no outcome"
        try:
            outcome = msgpack.unpackb(data, raw=False)
            ok, error = outcome["ok"], outcome["error"]
        except Exception:
            return "the primary process's outcome record is malformed"
        return None if ok is True else str(error)[:2000]

    def _follow(self, storage: Storage, lock: _locks.Lock | None, failure: BaseException | None) -> None:
        """A process other than the primary, after the first barrier: learn the outcome."""
        late: BarrierTimeoutError | None = None
        try:
            self.barrier("committed", lock)
        except BarrierTimeoutError as exc:
            late = exc
        if failure is None and (why := self._outcome(storage)) is not None:
            if late is not None:
                raise late
            failure = StorageError(f"multi-process save of checkpoint {self.name!r} failed: {why}")
        if late is None:
            try:
                self.barrier("acknowledged", lock)  # the primary removes the outcome only after this
            except BarrierTimeoutError as exc:
                if failure is None:  # the outcome says committed: the save has succeeded
                    _log.warning("%s: committed, but %s", self.name, exc)
        if failure is not None:
            raise failure

    def _clean(self, storage: Storage) -> None:
        """Remove the staging records and the outcome record (every process has read it)."""
        try:
            storage.delete_many(
                [self._path(f"process-{i}") for i in range(self.count)] + [self._path("outcome")]
            )
        except Exception as exc:  # committed: left for gc
            _log.warning("%s: committed; could not remove its staging records: %s", self.name, exc)
        self._forget()

    def _forget(self) -> None:
        """Remove the marks of this save from the runtime, once every process is past them."""
        with contextlib.suppress(Exception):
            self.runtime.delete(f"treestore/{self.save_id}/")


def canonical(entry: LeafEntry) -> LeafEntry:
    """A leaf saved as one piece covering all of it is stored as a plain leaf."""
    if len(entry.pieces) == 1 and entry.pieces[0].shape == entry.shape:
        return replace(entry, pieces=())
    return entry
