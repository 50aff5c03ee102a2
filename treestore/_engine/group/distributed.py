"""Saves by several processes of one ``jax.distributed`` job (SPEC.md, section 8).

Every process writes the chunks of the pieces it owns, then its part of the manifest as its own
part, in columns (:mod:`treestore._format.parts.part`), and sends the primary (process 0) a summary
of it through the job's runtime: the part's digest, a few counts and a fingerprint of how its
pieces cover their leaves (:mod:`treestore._format.parts.coverage`). After a barrier the primary reads
every summary with one request, checks that the pieces tile every sharded leaf from the
fingerprints alone, and commits a manifest that lists the parts (SPEC.md, section 8.4): its
work grows with the number of processes, never with the number of pieces, and it reads no part
unless the check fails (it then merges them to name the leaf and the processes). After a second
barrier the others read the outcome, and after a third the primary removes the outcome record.
If any process fails, nothing is committed and every process raises.

Synchronisation goes through the job's runtime (:mod:`treestore._engine.group.group_runtime`: JAX's
own, in a real job) and every wait has a timeout (:mod:`treestore._engine.group.group_wait`): a
process that gives up raises BarrierTimeoutError naming the processes that did not arrive,
which it learns from the mark each process sets in the runtime's key-value store as it arrives.
While it waits, a process keeps its save lock fresh, so gc never takes the chunks of a save in
flight for abandoned ones.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import msgpack
import numpy as np

from treestore._engine import locks as _locks
from treestore._engine.group import stats_gather
from treestore._engine.group.group_runtime import JaxRuntime, Runtime
from treestore._engine.group.group_wait import BARRIER_TIMEOUT, barrier_timeout, kept_fresh
from treestore._engine.reading.parts import merged, named
from treestore._format import paths as _paths
from treestore._format.limits import (
    MAX_OUTCOME_BYTES,
    MAX_PART_BYTES,
    MAX_PARTS,
    MAX_PARTS_BYTES,
    MAX_PIECES,
)
from treestore._format.manifest.codec import encode_columns
from treestore._format.manifest.columns import Columns
from treestore._format.manifest.frame import Frame, ListedPart
from treestore._format.manifest.leaf_table import LeafTable
from treestore._format.manifest.records import ChunkRef
from treestore._format.parts.coverage import Coverage, P
from treestore._format.parts.explain import process_names
from treestore._format.parts.merge import PACK_INDEX_END, FrameLeaves, frame_leaves_from_fields, frame_of
from treestore._format.parts.part import (
    Summary,
    decode_summary,
    encode_part,
    encode_summary,
    layout_digest,
    leaf_range,
    most_pieces,
    part_from_fields,
)
from treestore._kernels.digest import digest
from treestore._storage.base import Storage
from treestore._tree import jax_import
from treestore._tree.jax_import import jax
from treestore._tree.leaves import ArrayLeaf, Leaf
from treestore.errors import BarrierTimeoutError, InvalidInputError, StorageError

_log = logging.getLogger("treestore")
_joined: contextvars.ContextVar[tuple[Runtime, int, int] | None] = contextvars.ContextVar(
    "treestore_group", default=None
)


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
    # No jax.distributed job without jax, and importing jax would cost a short command most of
    # its time (docs/benchmarks.md, "Start-up").
    if not jax_import.imported():
        return None
    count = jax.process_count()
    if count == 1:
        return None
    return Group(jax.process_index(), count, JaxRuntime(), barrier_timeout())


def _layout_of(tree: object, leaves: Sequence[tuple[str, Leaf]]) -> bytes:
    return layout_digest(
        tree,
        (
            (leaf.kind, leaf.dtype, leaf.shape) if isinstance(leaf, ArrayLeaf) and leaf.sharded else None
            for _, leaf in leaves
        ),
    )


class Written(NamedTuple):
    """What a process of a multi-process save wrote: the table of its leaves (every leaf for
    the primary, the sharded ones and Python scalars for the others; a leaf in one piece kept a
    piece), with each leaf's statistics when ``measured``, and its packs."""

    table: LeafTable
    packs: list[ChunkRef]
    measured: bool

    def fields(self) -> dict[str, Any]:
        """The manifest arrays of what it wrote (see :meth:`LeafTable.fields`)."""
        return self.table.fields(self.packs)


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
            if found is None or not _paths.is_id(found):
                raise BarrierTimeoutError(
                    f"multi-process save of checkpoint {name!r}: the primary (process 0) did not start "
                    f"it within {self.timeout:g} s (every process must save the same checkpoint at once); "
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
        with kept_fresh(lock):
            why = self.runtime.wait(root, self.timeout)
        if why is None:
            return
        arrived: set[str] = set()
        with contextlib.suppress(Exception):
            arrived = {k.rsplit("/", 1)[-1] for k in self.runtime.items(f"{root}/")}
        missing = [i for i in range(self.count) if str(i) not in arrived]
        where = f"multi-process save of checkpoint {self.name!r}, barrier {step!r}"
        if not missing:
            text = f"{where}: process {self.index} arrived after the others had stopped waiting"
        else:
            late = process_names(missing)
            text = f"{where}: {late} (of {self.count}) did not arrive within {self.timeout:g} s"
        text += f" ({why}); "
        if step == "committed" and not self.primary and 0 in missing:
            text += "the primary (process 0) may still commit the checkpoint"
        else:
            text += (
                "nothing was committed"
                if step == "written"
                else "see the primary (process 0) for the outcome"
            )
        raise BarrierTimeoutError(text, missing=missing, checkpoint=self.name)

    def finish(
        self,
        storage: Storage,
        lock: _locks.Lock | None,
        tree: object,
        leaves: Sequence[tuple[str, Leaf]],
        written: Written | None,
        failure: BaseException | None,
        header: dict[str, Any],
        commit: Callable[[Columns, bytes], None],
    ) -> tuple[int, int] | None:
        """Part what this process wrote (``written``: its leaf entries and packs, None when
        ``failure`` stopped it), then commit (the primary, through ``commit(columns, manifest
        bytes)``, the write's one door: returns the committed checkpoint's number of leaves and
        bytes) or learn the outcome (the others: None). Raises unless the checkpoint was
        committed."""
        with kept_fresh(lock):  # one keeper while this process waits at any of the barriers
            layout = _layout_of(tree, leaves)
            sharded = [isinstance(leaf, ArrayLeaf) and leaf.sharded for _, leaf in leaves]
            shapes = [
                (i, leaf.shape)
                for i, (_, leaf) in enumerate(leaves)
                if isinstance(leaf, ArrayLeaf) and sharded[i]
            ]
            empty = any(0 in shape for _, shape in shapes)
            coverage = None
            if shapes:
                coverage = Coverage(bytes.fromhex(self.save_id), max(len(shape) for _, shape in shapes))
            try:
                self._publish(storage, layout, leaves, sharded, written, failure, coverage)
            except Exception as exc:
                failure = failure or exc
            kinds = stats_gather.kinds(leaves, sharded)
            mine = None  # this process's records of its pieces, when the tree has sharded leaves
            if len(kinds) and written is not None and written.measured and failure is None:
                mine = stats_gather.own(written.table, sharded, kinds)
            if len(kinds) and not self.primary:
                deadline = time.monotonic() + self.timeout / 2  # to reach the barrier in time
                with contextlib.suppress(Exception):  # the primary then finds no records
                    stats_gather.send(
                        self.runtime, self.save_id, self.index, self.count, mine, kinds, deadline
                    )
            expected = 0
            if self.primary and failure is None and coverage is not None:  # while the others write
                expected = coverage.sum((i, (0,) * len(shape), shape) for i, shape in shapes)
            try:
                self.barrier("written")
            except BarrierTimeoutError as exc:
                if failure is not None:
                    raise failure from exc
                raise
            finally:
                if self.primary:
                    with contextlib.suppress(Exception):  # everyone has it now
                        self.runtime.delete(self._key(self.name))
            if not self.primary:
                self._follow(storage, failure)
                return None
            try:
                if failure is not None:
                    raise failure
                assert written is not None
                frame_leaves = frame_leaves_from_fields(
                    tree, lambda i: leaves[i][0], written.fields(), sharded
                )
                parts, cover = self._gather(frame_leaves, layout, coverage is not None)
                if written.measured:
                    gathered = None
                    if len(kinds):
                        gathered = stats_gather.gather(self.runtime, self.save_id, self.count, mine, kinds)
                    header = {**header, "stats": stats_gather.committed(written.table, sharded, gathered)}
                frame = frame_of(frame_leaves, {**header, "created": time.time()}, layout, parts)
                if cover != expected or empty:  # a zero-size leaf's pieces weigh nothing
                    self._merge_parts(storage, frame, cover == expected)
                columns = frame.columns
                commit(columns, encode_columns(frame if parts else columns))
            except BaseException as exc:
                with contextlib.suppress(Exception):
                    self._announce(storage, exc)
                with contextlib.suppress(BarrierTimeoutError):
                    self.barrier("committed")
                    self.barrier("acknowledged")
                    self._forget()
                raise
            done = len(columns), columns.nbytes
            try:  # committed: the save has succeeded, whatever follows
                self._announce(storage, None)
                self.barrier("committed")
                self.barrier("acknowledged")  # every process has read the outcome
            except Exception as exc:
                _log.warning("%s: committed; outcome record left for gc: %s", self.name, exc)
                return done
            self._clean(storage)
            return done

    def _publish(
        self,
        storage: Storage,
        layout: bytes,
        leaves: Sequence[tuple[str, Leaf]],
        sharded: Sequence[bool],
        written: Written | None,
        failure: BaseException | None,
        coverage: Coverage | None,
    ) -> None:
        """Write this process's part (when the tree has sharded leaves) and send the primary its
        summary, or the error that stopped it; raises what stopped it here."""
        summary: Summary | str
        problem: BaseException | None = None
        if failure is not None or written is None:
            summary = f"{type(failure).__name__}: {failure}"
        elif coverage is None:  # every leaf is the primary's: no part
            summary = Summary(layout, None, 0, 0, 0, 0, 0)
        else:
            part, cover = part_from_fields(written.fields(), np.array(written.table.index), coverage)
            data = encode_part(part, layout)
            if len(data) > MAX_PART_BYTES:
                summary = (
                    f"its part takes {len(data)} bytes, over the "
                    f"{MAX_PART_BYTES} bytes a part may hold: save fewer pieces"
                )
                problem = StorageError(
                    f"multi-process save of checkpoint {self.name!r}: process {self.index}: {summary}"
                )
            else:
                found = digest(data)
                pieces, packs = len(part.piece_leaves), len(part.packs)
                most, (first, end) = most_pieces(part), leaf_range(part)
                summary = Summary(layout, found, len(data), pieces, packs, most, cover, first, end)
                try:
                    storage.write(_paths.manifest_path(found), [data])
                    storage.sync()
                except Exception as exc:
                    summary, problem = f"{type(exc).__name__}: {exc}", exc
        self.runtime.set(self._summary_key(self.index), encode_summary(summary))
        if problem is not None:
            raise problem

    def _summary_key(self, index: int) -> str:
        return f"treestore/{self.save_id}/summary/{index}"

    def _gather(
        self, frame_leaves: FrameLeaves, layout: bytes, in_parts: bool
    ) -> tuple[list[ListedPart], int]:
        """Every process's summary, with one request to the runtime: each process's part (none
        when the tree has no sharded leaf) and the sum of their coverage fingerprints.
        StorageError naming every process that failed or whose summary is missing or malformed;
        InvalidInputError when the parts together are beyond what readers accept."""
        found = self.runtime.items(f"treestore/{self.save_id}/summary/")
        problems: dict[int, str] = {}
        summaries: list[Summary] = []
        for i in range(self.count):
            text = found.get(self._summary_key(i))
            got = "it sent no summary of its part" if text is None else decode_summary(text, layout)
            if isinstance(got, str):
                problems[i] = got
            elif in_parts and got.part is None:
                problems[i] = "it wrote no part"
            elif got.end > len(frame_leaves.leaves):
                problems[i] = (
                    f"its pieces lie in leaves up to {got.end}, beyond the tree's {len(frame_leaves.leaves)}"
                )
            else:
                summaries.append(got)
        if problems:
            raise StorageError(f"multi-process save of checkpoint {self.name!r} failed: {named(problems)}")
        where = f"multi-process save of checkpoint {self.name!r}"
        if in_parts and len(summaries) > MAX_PARTS:
            raise InvalidInputError(
                f"{where}: {len(summaries)} processes hold pieces, over the {MAX_PARTS} parts a "
                "manifest may list",
                checkpoint=self.name,
            )
        if sum(s.most for s in summaries) > MAX_PIECES:
            raise InvalidInputError(
                f"{where}: a leaf may have more than the {MAX_PIECES} pieces readers accept "
                "(the processes hold that many between them): shard it in fewer pieces",
                checkpoint=self.name,
            )
        if sum(s.size for s in summaries) > MAX_PARTS_BYTES:
            raise InvalidInputError(
                f"{where}: the processes' parts of the manifest take {sum(s.size for s in summaries)} "
                f"bytes, over the {MAX_PARTS_BYTES} bytes readers accept: save fewer pieces",
                checkpoint=self.name,
            )
        if len(frame_leaves.packs) + sum(s.packs for s in summaries) >= PACK_INDEX_END:
            raise InvalidInputError(f"{where}: over 2**31 packs", checkpoint=self.name)
        parts = [
            ListedPart(s.part, s.size, s.first, s.end) for s in summaries if in_parts and s.part is not None
        ]
        return parts, sum(s.cover for s in summaries) % P

    def _merge_parts(self, storage: Storage, frame: Frame, covered: bool) -> None:
        """Read the parts and merge them as readers do: when the coverage fingerprints say the
        pieces do not tile the sharded leaves (``covered`` false), to name the leaf and the
        processes; when a sharded leaf has no elements (its pieces weigh nothing), to check it."""
        _, problems = merged(storage, frame)  # InvalidInputError naming the leaf and the processes
        if problems:
            raise StorageError(f"multi-process save of checkpoint {self.name!r} failed: {named(problems)}")
        if covered:
            return
        raise StorageError(
            f"multi-process save of checkpoint {self.name!r} failed: the processes' coverage "
            "fingerprints say their pieces do not tile the sharded leaves, yet their parts merge "
            "(a part changed after it was written?)"
        )

    def _announce(self, storage: Storage, error: BaseException | None) -> None:
        text = None if error is None else f"{type(error).__name__}: {error}"[: MAX_OUTCOME_BYTES // 8]
        data = msgpack.packb({"ok": error is None, "error": text}, use_bin_type=True)
        storage.write(_paths.outcome_path(self.save_id), [data])

    def _outcome(self, storage: Storage) -> str | None:
        """None when the primary committed, else why not."""
        try:
            data = storage.read(_paths.outcome_path(self.save_id), limit=MAX_OUTCOME_BYTES)
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

    def _follow(self, storage: Storage, failure: BaseException | None) -> None:
        """A process other than the primary, after the first barrier: learn the outcome."""
        late: BarrierTimeoutError | None = None
        try:
            self.barrier("committed")
        except BarrierTimeoutError as exc:
            late = exc
        if failure is None and (why := self._outcome(storage)) is not None:
            if late is not None:
                raise late
            failure = StorageError(f"multi-process save of checkpoint {self.name!r} failed: {why}")
        if late is None:
            try:
                self.barrier("acknowledged")  # the primary removes the outcome only after this
            except BarrierTimeoutError as exc:
                if failure is None:  # the outcome says committed: the save has succeeded
                    _log.warning("%s: committed, but %s", self.name, exc)
        if failure is not None:
            raise failure

    def _clean(self, storage: Storage) -> None:
        """Remove the outcome record (every process has read it)."""
        try:
            storage.delete_many([_paths.outcome_path(self.save_id)])
        except Exception as exc:  # committed: left for gc
            _log.warning("%s: committed; could not remove its outcome record: %s", self.name, exc)
        self._forget()

    def _forget(self) -> None:
        """Remove the marks of this save from the runtime, once every process is past them."""
        with contextlib.suppress(Exception):
            self.runtime.delete(f"treestore/{self.save_id}/")
