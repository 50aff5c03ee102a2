"""Verification: re-read a store's commit records, manifests and chunks and check every digest.

:func:`verify` collects every problem it finds instead of stopping at the first, each naming the
checkpoint and the address it affects. Chunks shared by several checkpoints are read once; a
pack is read once and every leaf inside it checked against its own digest.
"""

from __future__ import annotations

import os
import threading
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from treestore._api.spec import parse_spec
from treestore._engine.objects import ChunkObject, chunk_objects
from treestore._engine.progress import Progress, counter
from treestore._engine.reading import committed as _committed
from treestore._engine.reading import memory as _memory
from treestore._engine.reading.read import fetch_chunk, member_mismatch
from treestore._engine.reading.scan import bad_members, scan
from treestore._engine.threads import default_threads
from treestore._format.manifest.records import ChunkRef
from treestore._format.manifest.rules import check_name
from treestore._storage.base import Storage
from treestore._storage.registry import open_storage
from treestore.errors import (
    CheckpointNotFoundError,
    ChunkDamagedError,
    ChunkMissingError,
    OutOfMemoryError,
    StorageError,
    TreestoreError,
    UnsupportedFormatError,
)

if TYPE_CHECKING:
    from treestore._engine.saving.writing import Writing


# Kinds of problem, as found in :attr:`VerifyProblem.kind`.
RECORD, MANIFEST, CHUNK_MISSING, CHUNK_DAMAGED, STORAGE, UNSUPPORTED = (
    "commit_record",
    "manifest",
    "chunk_missing",
    "chunk_damaged",
    "storage",
    "unsupported",
)


@dataclass(frozen=True)
class VerifyProblem:
    """One thing wrong in a store: which checkpoint, which leaf address (None when the problem
    is not a leaf's), what kind of problem, and a message that says all of it.

    Attributes:
        checkpoint: The checkpoint affected (None when the problem is not one checkpoint's).
        address: The leaf affected (None when the problem is not a leaf's).
        kind: ``"commit_record"``, ``"manifest"``, ``"chunk_missing"``, ``"chunk_damaged"``,
            ``"storage"`` (a read failed) or ``"unsupported"`` (a format, codec or dtype this
            version does not know).
        message: What is wrong, naming the checkpoint and the address.
    """

    checkpoint: str | None
    address: str | None
    kind: str
    message: str


@dataclass(frozen=True)
class VerifyReport:
    """The result of :func:`verify`: what was checked and every problem found.

    ``ok`` is True when nothing is wrong; :meth:`to_json` gives plain data.

    Attributes:
        url: The store's URL.
        checkpoints: The names of the checkpoints checked.
        chunks_checked: Chunk objects read and checked.
        bytes_checked: Raw bytes decoded and hashed.
        problems: Every problem found (empty when there is none).
        repaired: Hex digests of the chunks rewritten from ``repair_from``.
    """

    url: str
    checkpoints: tuple[str, ...]
    chunks_checked: int
    bytes_checked: int
    problems: tuple[VerifyProblem, ...] = field(default=())
    repaired: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        """Whether no problem was found."""
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        """The report as plain data, ready for :func:`json.dumps`.

        Returns:
            Its fields by name (each problem as a dict), and ``"ok"``.
        """
        out = asdict(self)
        out["checkpoints"] = list(self.checkpoints)
        out["problems"] = [asdict(p) for p in self.problems]
        out["repaired"] = list(self.repaired)
        out["ok"] = self.ok
        return out


def _kind(exc: TreestoreError, default: str) -> str:
    if isinstance(exc, ChunkMissingError):
        return CHUNK_MISSING
    if isinstance(exc, ChunkDamagedError):
        return CHUNK_DAMAGED
    if isinstance(exc, UnsupportedFormatError):
        return UNSUPPORTED
    if isinstance(exc, StorageError):
        return STORAGE
    return default


@dataclass
class _Job:
    """One chunk object to check, and each checkpoint's use of it (its refs to it, or for a
    pack the leaf slices inside it)."""

    ref: ChunkRef
    uses: list[ChunkObject] = field(default_factory=list)


class _Verifier:
    def __init__(self, storage: Storage, threads: int, progress: Progress | None) -> None:
        self.storage = storage
        self.threads = threads
        self.progress = progress
        self.problems: list[VerifyProblem] = []
        self.jobs: dict[tuple[bytes, int], _Job] = {}
        self.bad: list[ChunkRef] = []  # chunk objects missing or damaged as a whole
        self._lock = threading.Lock()
        self.total = 0

    def add(self, checkpoint: str | None, address: str | None, kind: str, message: str) -> None:
        with self._lock:
            self.problems.append(VerifyProblem(checkpoint, address, kind, message))

    def checkpoint(self, name: str, *, named: bool) -> None:
        """Check one commit record and its manifest; queue its chunks."""
        try:
            record = _committed.read_commit_record(self.storage, name)
        except CheckpointNotFoundError:
            if named:
                raise
            return  # deleted since it was listed
        except TreestoreError as exc:
            self.add(name, None, _kind(exc, RECORD), str(exc))
            return
        try:
            columns = _committed.read_columns(self.storage, record)
        except OutOfMemoryError:
            raise  # not damage: the store may be sound
        except TreestoreError as exc:
            self.add(name, None, _kind(exc, MANIFEST), str(exc))
            return
        for use in chunk_objects(columns):
            job = self.jobs.get(use.key)
            if job is None:
                job = self.jobs[use.key] = _Job(use.ref)
                self.total += use.ref.raw_size
            job.uses.append(use)

    def _report(self, use: ChunkObject, kind: str, problem: str, rows: np.ndarray | None = None) -> None:
        name = use.columns.name
        for address in use.addresses(rows):
            self.add(name, address, kind, f"{address}: {problem}, in checkpoint {name!r}")

    def run_job(self, job: _Job) -> None:
        try:
            _, raw = fetch_chunk(self.storage, job.ref)
        except TreestoreError as exc:
            for use in job.uses:
                self._report(use, _kind(exc, CHUNK_DAMAGED), str(exc))
            if isinstance(exc, (ChunkMissingError, ChunkDamagedError)):
                with self._lock:
                    self.bad.append(job.ref)
            return
        checked: dict[tuple[bytes, int, int], bool] = {}  # each slice checked once
        for use in job.uses:
            if use.packed:
                for (_, offset, size), rows in bad_members(raw, use, checked).items():
                    problem = member_mismatch(job.ref.digest, offset, size)
                    self._report(use, CHUNK_DAMAGED, problem, np.array(rows))

    def run_jobs(self) -> None:
        advance = counter(self.progress, self.total)
        jobs = list(self.jobs.values())
        scan(jobs, self.run_job, self.threads, "verify", advance)


def verify(
    spec: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    threads: int | None = None,
    progress: Progress | None = None,
    repair_from: str | os.PathLike[str] | None = None,
    repair_storage_options: dict[str, Any] | None = None,
) -> VerifyReport:
    """Re-read and check every commit record, manifest and chunk, collecting every problem.

    Damage is reported in the report's ``problems``, not raised. Damage a save cannot see (a
    body that decodes wrongly behind a sound header) is found only by such a full read.

    With ``repair_from`` it also scrubs: each chunk object found missing or damaged is fetched
    from that store, checked against its digest, and written back under its name (chunks are
    named by their raw bytes, so the same name holds the same data in every store), under a save
    lock so gc cannot run meanwhile. The store is then verified again; the report's
    ``repaired`` lists the chunks rewritten and ``problems`` what is still wrong.

    Args:
        spec: A store (``URL``: every checkpoint) or one checkpoint (``URL#NAME``).
        storage_options: Options for the fsspec filesystem.
        threads: Reading threads.
        progress: Called as ``progress(done, total)`` with raw bytes checked.
        repair_from: Another store holding the same data (the remote tier, a backup, a copy).
        repair_storage_options: Options for the filesystem of ``repair_from``.

    Returns:
        VerifyReport: A :class:`treestore.types.VerifyReport`.

    Raises:
        CheckpointNotFoundError: No such checkpoint, or no checkpoints at all.
        InvalidInputError: The URL is unusable.

    Examples:
        >>> import numpy as np, treestore
        >>> _ = treestore.save("memory://doc/verify", {"w": np.arange(4.0)}, "a")
        >>> report = treestore.verify("memory://doc/verify")
        >>> report.ok, report.checkpoints, report.chunks_checked
        (True, ('a',), 1)
    """
    url, name = parse_spec(spec)
    storage = open_storage(url, storage_options)
    if name is not None:
        names = [check_name(name)]
    else:
        names = _committed.checkpoint_names(storage)
        if not names:
            raise _committed.not_found(storage, None)
    v = _checked(storage, names, name is not None, threads or default_threads(), progress)
    repaired: list[str] = []
    if repair_from is not None and v.bad:
        source = open_storage(repair_from, repair_storage_options)
        from treestore._engine.saving.writing import writing  # here: checking a store writes nothing

        with writing(storage, None, previous=False) as w:  # a save lock: no gc meanwhile
            repaired = [ref.digest.hex() for ref in v.bad if _repair(w, source, ref)]
        if repaired:
            v = _checked(storage, names, name is not None, threads or default_threads(), progress)
    problems = sorted(v.problems, key=lambda p: (p.checkpoint or "", p.address or "", p.kind, p.message))
    return VerifyReport(storage.url, tuple(names), len(v.jobs), v.total, tuple(problems), tuple(repaired))


def _checked(
    storage: Storage, names: list[str], named: bool, threads: int, progress: Progress | None
) -> _Verifier:
    v = _Verifier(storage, threads, progress)
    for n in names:
        with _memory.memory_named(f"verifying checkpoint {n!r}", n):
            v.checkpoint(n, named=named)
    with _memory.memory_named(f"verifying the chunks of {storage.url}"):
        v.run_jobs()
    return v


def _repair(w: Writing, source: Storage, ref: ChunkRef) -> bool:
    """Write chunk ``ref``'s object from ``source`` into the store of ``w`` if the source holds it intact
    (decoded and checked against its digest first); False if it does not, or if what stands
    under the chunk's name there cannot be read (a link, a FIFO, a failing read): the chunk stays
    reported and the other chunks are still repaired."""
    try:
        data, _ = fetch_chunk(source, ref)
    except (ChunkMissingError, ChunkDamagedError, StorageError):
        return False
    w.replace_object(ref.digest, data)
    return True
