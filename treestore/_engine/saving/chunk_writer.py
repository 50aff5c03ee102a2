"""Writing chunk objects: each chunk hashed and encoded from one copy of its bytes, taken as
trusted or reused when the store already holds it under its name, written otherwise, and named
once its bytes are durable (SPEC.md §4, §5.2). Saves, derive and copy write through it.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from treestore._deprecated import renamed_attribute
from treestore._engine.saving import trusted as _trusted
from treestore._engine.threads import Batch, once, shared_pool
from treestore._format import paths as _paths
from treestore._format import stats as _stats
from treestore._format.codecs import PACK_PAYS_OFF, PROBE_BYTES, Codec, encode, sound
from treestore._format.manifest.records import ChunkRef
from treestore._kernels.digest import ALL_CORES_FROM, digest
from treestore._kernels.scratch import scratch
from treestore._storage.base import PUBLISHED, Staged, Storage


@dataclass(frozen=True)
class SaveResult:
    """What a save did: how much it stored, how much it found already in the store, and the
    requests it sent for chunks.

    Every chunk is written (``chunks_written``), or reused (``chunks_reused``): trusted as
    present because the checkpoint the save learned them from references them
    (``chunks_trusted``, ``trusted_from``; no request at all), or found in the store by an
    existence check (a HEAD on object stores) and a reuse read of its first bytes.
    ``chunk_requests`` adds those up; learning the trusted chunks took up
    to three more (a listing, the commit record, the manifest).

    In a save by every process of a jax.distributed job, each process reports the chunks it
    stored itself; ``leaves`` and ``nbytes`` are the checkpoint's on the process that committed
    it, 0 on the others.

    Attributes:
        name: The checkpoint's name.
        leaves: The checkpoint's number of leaves.
        nbytes: Raw bytes of all array leaves (Python scalars count 0).
        chunks_written: Chunk objects (packs included) the save wrote, one write request each.
        bytes_written: Stored bytes (headers and compressed bodies) of the chunk objects the save
            wrote.
        chunks_reused: Chunk objects the store already held, referenced instead of written
            (``chunks_trusted`` included). A chunk the save met more than once counts once, in
            this count or in ``chunks_written``.
        chunks_trusted: Of ``chunks_reused``, those taken as present because checkpoint
            ``trusted_from`` references them, with no request.
        existence_checks: Requests for the size of a chunk object (a HEAD each on object
            stores).
        reuse_reads: Reads of the first bytes of an existing chunk object, checking it before
            reusing it.
        trusted_from: The committed checkpoint whose chunks the save took as present (by default
            the store's newest); None when it took none (a save told not to trust one, a store
            with no checkpoint, or one whose records could not be read).

    Examples:
        >>> import numpy as np, treestore
        >>> store = treestore.Store("memory://doc/save-result")
        >>> _ = store.save({"w": np.zeros(9000), "b": np.ones(9000)}, "a")
        >>> r = store.save({"w": np.zeros(9000), "b": np.full(9000, 2.0)}, "b")
        >>> r.chunks_written, r.chunks_trusted, r.trusted_from, r.existence_checks, r.reuse_reads
        (1, 1, 'a', 1, 0)
    """

    name: str
    leaves: int
    nbytes: int
    chunks_written: int
    bytes_written: int
    chunks_reused: int
    chunks_trusted: int = 0
    existence_checks: int = 0
    reuse_reads: int = 0
    trusted_from: str | None = None

    chunks_known = renamed_attribute("SaveResult", "chunks_known", "chunks_trusted")
    known_from = renamed_attribute("SaveResult", "known_from", "trusted_from")

    @property
    def chunk_requests(self) -> int:
        """The requests this save sent for chunks: existence checks, reuse reads and writes."""
        return self.existence_checks + self.reuse_reads + self.chunks_written


class ChunkRequests:
    """The requests a save or copy sent to learn whether the store holds its chunks (see
    :class:`SaveResult`); safe to count from many threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.existence_checks = 0
        self.reuse_reads = 0

    def count(self, existence_checks: int, reuse_reads: int) -> None:
        with self._lock:
            self.existence_checks += existence_checks
            self.reuse_reads += reuse_reads


def reusable_size(
    storage: Storage, chunk_digest: bytes, raw_size: int, requests: ChunkRequests | None = None
) -> int | None:
    """The stored size of the object under the name of chunk ``chunk_digest`` (``raw_size`` raw
    bytes) if a save or copy may reference it without writing it again; None when there is no
    object or it fails the codec's reuse check (:func:`treestore._format.codecs.sound`, reading
    the object's size and at most its first 80 bytes), and the caller must (re)write it.
    ``requests`` counts the requests sent.
    """
    path = _paths.chunk_path(chunk_digest)
    stored = storage.object_size(path)
    if requests is not None:
        requests.count(1, int(stored is not None))
    if stored is None:
        return None
    head = storage.read_range(path, 0, PROBE_BYTES)
    return stored if head is not None and sound(head, stored, raw_size) else None


def _private_copy(raw: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A copy of ``raw`` in this thread's reusable buffer (valid until this thread's next call).

    A save hashes and encodes the one copy: an array the caller changes during the save can then
    make it store any state the array went through, but never an object whose bytes differ from
    its name.
    """
    out = scratch(raw.nbytes, "copy")
    np.copyto(out, raw)
    return out


class ChunkWriter:
    """Hashes, deduplicates, encodes and writes chunks; safe to call from many threads.

    A chunk is hashed and encoded from one copy of its bytes. One that ``trusted`` holds (the
    chunks of a checkpoint committed in the store, learned under this save's lock: see
    :mod:`treestore._engine.saving.trusted`) is referenced with the stored size that checkpoint records,
    with no request; an object already under its name is referenced only if it passes
    :func:`reusable_size`; otherwise it is written (over a bad object, replacing it). A chunk
    whose folder was made for this writer (:meth:`Storage.new_folder`) is written with no
    request: on a network file system each is a round trip.
    """

    def __init__(
        self,
        storage: Storage,
        codec: Codec,
        on_chunk: Callable[[int], None] | None,
        trusted: _trusted.TrustedChunks | None = None,
    ) -> None:
        self.storage = storage
        self.codec = codec
        self.on_chunk = on_chunk
        self.trusted = trusted  # set it only while holding the save lock it was learned under
        self.requests = ChunkRequests()
        self._lock = threading.Lock()
        self._claimed: dict[bytes, cf.Future[int]] = {}
        self._folders: dict[str, cf.Future[bool]] = {}  # chunk folder: whether it was made for this writer
        self.written = self.written_bytes = self.reused = self.trusted_hits = 0
        self._publisher: Batch | None = None
        self._staged: list[tuple[Staged, cf.Future[None]]] = []
        self._failed: BaseException | None = None
        self._running = 0  # chunks being stored now, by any thread

    @contextlib.contextmanager
    def publishing(self, threads: int) -> Iterator[None]:
        """Give the chunks :meth:`put` stages their names on ``threads`` threads that do nothing
        else, so the threads that hash and compress never wait for the disk
        (:meth:`Storage.stage`), and wait for all of them on leaving. On an error, theirs
        included, every chunk not yet published is discarded."""
        self._publisher = Batch(shared_pool(threads, "publish"))
        try:
            yield
            self.published()  # every chunk has its name before the caller commits
        except BaseException:
            self._publisher.cancel()
            with self._lock:
                staged, self._staged = self._staged, []
            for chunk, fut in staged:
                if fut.cancelled() or fut.exception() is not None:
                    chunk.discard()
            raise
        finally:
            self._publisher = None

    def published(self) -> None:
        """Wait until every chunk staged so far has its name; raises the first failure (the
        chunks still waiting stay listed, for :meth:`publishing` to discard)."""
        with self._lock:
            staged = list(self._staged)
        for _, fut in staged:
            fut.result()
        with self._lock:
            del self._staged[: len(staged)]  # only appended to meanwhile

    def _publish(self, chunk: Staged) -> None:
        if chunk is PUBLISHED:
            return
        if self._publisher is None:
            chunk.publish()
            return
        fut = self._publisher.submit(chunk.publish)
        fut.add_done_callback(self._note_failure)
        with self._lock:
            self._staged.append((chunk, fut))

    def _note_failure(self, fut: cf.Future[None]) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            self._failed = fut.exception()

    def result(self, name: str, leaves: int, nbytes: int) -> SaveResult:
        """The :class:`SaveResult` of a save of ``leaves`` leaves (``nbytes`` raw bytes) by this writer."""
        return SaveResult(
            name,
            leaves,
            nbytes,
            self.written,
            self.written_bytes,
            self.reused,
            self.trusted_hits,
            self.requests.existence_checks,
            self.requests.reuse_reads,
            self.trusted.checkpoint if self.trusted is not None else None,
        )

    def _stored(self, d: bytes, raw_size: int) -> int | None:
        """The stored size of the chunk ``d`` if the store holds it (trusted, or found sound)."""
        if self.trusted is not None:
            stored = self.trusted.stored.get(d)
            if stored is not None:
                with self._lock:
                    self.trusted_hits += 1
                return stored
        if self.in_new_folder(d):
            return None
        return reusable_size(self.storage, d, raw_size, self.requests)

    def in_new_folder(self, d: bytes) -> bool:
        """Whether chunk ``d``'s folder was made for this writer (:meth:`Storage.new_folder`,
        made now if it is missing): then no object is under its name but one this writer put
        there, and the store need not be asked."""
        path = _paths.chunk_path(d)
        folder = path.rpartition("/")[0]
        # one thread asks for each folder; the others wait for its answer
        return once(self._folders, folder, self._lock, lambda: self.storage.new_folder(path))

    def put(
        self, raw: np.ndarray[Any, Any], width: int, *, private: bool = False, pack: bool = False
    ) -> ChunkRef:
        """Store the chunk ``raw`` (1-D uint8); ``private`` says nothing else can change it
        meanwhile (a pack this save assembled, a leaf's host copy: ``ArrayLeaf.private``), so
        it needs no copy; ``pack``: it is a pack, compressed only when that pays
        (:data:`~treestore._format.codecs.PACK_PAYS_OFF`)."""
        return self.put_measured(raw, width, None, private=private, pack=pack)[0]

    def put_measured(
        self,
        raw: np.ndarray[Any, Any],
        width: int,
        dtype: np.dtype[Any] | None,
        *,
        private: bool = False,
        pack: bool = False,
    ) -> tuple[ChunkRef, _stats.Record | None]:
        """:meth:`put`, and with ``dtype`` the statistics of the chunk's elements of that dtype,
        measured from the copy that is hashed (so they describe exactly the bytes stored) while
        it is in this core's cache."""
        if self._failed is not None:  # a chunk could not be published: the save has failed
            raise self._failed
        with self._lock:
            self._running += 1
        try:
            return self._put(raw, width, private, dtype, PACK_PAYS_OFF if pack else None)
        finally:
            with self._lock:
                self._running -= 1

    def _alone(self, raw: np.ndarray[Any, Any]) -> bool:
        """Whether chunk ``raw`` is big and no other chunk is being stored meanwhile: then its
        hash and compression use every core (a big leaf in one chunk, the last of a few)."""
        return raw.nbytes >= ALL_CORES_FROM and self._running == 1

    def _put(
        self,
        raw: np.ndarray[Any, Any],
        width: int,
        private: bool,
        dtype: np.dtype[Any] | None,
        pays_off: float | None,
    ) -> tuple[ChunkRef, _stats.Record | None]:
        if not private:
            raw = _private_copy(raw)
        record = None if dtype is None else _stats.measure(raw.view(dtype))
        d = digest(raw, spread=self._alone(raw))

        def store() -> int:  # once per chunk of this save: its stored size
            stored = self._stored(d, raw.nbytes)
            if stored is None:
                # (written before this thread encodes the next)
                buffers = encode(
                    raw, width, self.codec, reuse=True, spread=self._alone(raw), pays_off=pays_off
                )
                self._publish(self.storage.stage(_paths.chunk_path(d), buffers))
                stored = sum(len(b) for b in buffers)
                with self._lock:
                    self.written += 1
                    self.written_bytes += stored
            else:
                with self._lock:
                    self.reused += 1
            if self.on_chunk is not None:
                self.on_chunk(raw.nbytes)
            return stored

        return ChunkRef(d, raw.nbytes, once(self._claimed, d, self._lock, store)), record


Measured = tuple[ChunkRef, "_stats.Record | None"]
