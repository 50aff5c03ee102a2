"""The one door into the engine for writes. Every save (by one process or by every process of a
job), derive, copy, import and repair writes through a :class:`Writing`, which owns, in order:

* the new checkpoint's name and metadata checked, and the check that no checkpoint of that name
  exists unless it is to be replaced (:func:`check_absent`; a copy's :func:`unchanged`);
* the store's save lock, held until the commit, so that no gc runs meanwhile
  (:mod:`treestore._engine.locks`), and kept fresh while chunks are written;
* the chunks the write may take as present, learned under that lock
  (:mod:`treestore._engine.saving.trusted`);
* the chunk writer (:mod:`treestore._engine.saving.chunking`, :mod:`treestore._engine.saving.chunk_writer`);
* the manifest's header (name, creation time, metadata, codec, chunk size), its columns built
  and checked as readers check them, and the one commit (:mod:`treestore._engine.commit`).

The public layer never takes a lock, learns trusted chunks, builds a manifest or commits by
itself: an import contract in ``pyproject.toml`` keeps it so.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from treestore._engine import locks as _locks
from treestore._engine.commit import commit
from treestore._engine.reading import committed as _committed
from treestore._engine.saving import chunking as _chunking
from treestore._engine.saving import trusted as _trusted
from treestore._engine.saving.chunk_writer import ChunkWriter, SaveResult, reusable_size
from treestore._engine.saving.save_options import SaveOptions
from treestore._format import paths as _paths
from treestore._format.encoding import FORMAT_VERSION
from treestore._format.manifest.codec import columns_from_fields, encode
from treestore._format.manifest.columns import Columns
from treestore._format.manifest.leaf_table import LeafTable
from treestore._format.manifest.records import ChunkRef
from treestore._format.manifest.rules import check_metadata, check_name
from treestore._storage.base import Storage
from treestore._tree.prepare import Prepared
from treestore.errors import CheckpointExistsError, TreestoreError


def _exists(storage: Storage, name: str, other_contents: bool = False) -> CheckpointExistsError:
    """The one error of a write that finds its checkpoint already committed."""
    if other_contents:  # a copy: the same contents count as done
        what, fix = " with other contents", "overwrite=True (--overwrite)"
    else:
        what, fix = "", "overwrite=True"
    return CheckpointExistsError(
        f"checkpoint {name!r} already exists in {storage.url}{what}; pass {fix} to replace it",
        checkpoint=name,
    )


def check_absent(storage: Storage, name: str, overwrite: bool) -> None:
    """CheckpointExistsError when ``storage`` holds checkpoint ``name`` and ``overwrite`` is False."""
    if not overwrite and storage.exists(_paths.record_path(name)):
        raise _exists(storage, name)


def unchanged(storage: Storage, name: str, manifest_digest: bytes, overwrite: bool) -> bool:
    """A copy's check: True when ``storage`` holds checkpoint ``name`` with this manifest;
    CheckpointExistsError when it holds other contents and ``overwrite`` is False."""
    if not storage.exists(_paths.record_path(name)):
        return False
    try:
        if _committed.read_commit_record(storage, name).manifest == manifest_digest:
            return True
    except TreestoreError:
        pass  # an unreadable record: overwrite it only when asked
    if overwrite:
        return False
    raise _exists(storage, name, other_contents=True)


def renamed(columns: Columns, name: str) -> tuple[Columns, bytes]:
    """Committed checkpoint ``columns`` under another name, and its manifest's bytes in its own
    format version (a manifest stored in parts comes out merged)."""
    columns = replace(columns, name=name)
    return columns, encode(columns, columns.version)


class Writing:
    """A write into ``storage``: the checks of :func:`writing` done when made, the save lock
    held from :meth:`hold` until :meth:`release` (or the end of a ``with`` block).

    ``name`` is the checkpoint the write commits (None: a copy, whose checkpoints are checked
    with :func:`unchanged`, or a repair, which commits none).
    """

    def __init__(
        self,
        storage: Storage,
        name: str | None,
        *,
        options: SaveOptions | None = None,
        overwrite: bool = False,
        metadata: Any = None,
        on_chunk: Callable[[int], None] | None = None,
    ) -> None:
        if name is not None:
            check_name(name)
            check_metadata(metadata)
            check_absent(storage, name, overwrite)
        self.storage = storage
        self.name = name
        self.options = options = options or SaveOptions()
        self.overwrite = overwrite
        self.metadata = metadata  # a derive that keeps its base's sets it under the lock
        self.writer = ChunkWriter(storage, options.codec, on_chunk)
        self.lock: _locks.Lock | None = None
        self._trusting = False  # whether chunks a copy has committed are taken as present
        self._committed: set[bytes] = set()  # those chunks

    def hold(self, previous: _trusted.Previous) -> Writing:
        """Take the store's save lock (waiting for any gc to finish), then learn the chunks of
        checkpoint ``previous`` (:func:`treestore._engine.saving.trusted.learn`): under the lock, which
        is what makes trusting them safe."""
        lock = _locks.save_lock(self.storage)
        try:
            trusted = _trusted.learn(self.storage, previous)  # under the lock, after any gc: safe
        except BaseException:
            lock.release_quietly()
            raise
        self.lock = lock
        self.writer.trusted = trusted
        self._trusting = previous is not False
        return self

    def release(self) -> None:
        """Give the save lock back (a failure to remove it is logged: see
        :meth:`treestore._engine.locks.Lock.release_quietly`)."""
        if self.lock is not None:
            lock, self.lock = self.lock, None
            lock.release_quietly()

    def __enter__(self) -> Writing:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.release()

    def keep_fresh(self) -> None:
        """Rewrite the save lock when it is due, so that no gc takes it for a dead one."""
        assert self.lock is not None
        self.lock.refresh(_locks.STALE_AFTER)

    def trust(self, name: str, columns: Columns) -> None:
        """Take the chunks of committed checkpoint ``name`` (``columns``, read under this write's
        lock) as present, with no request for them."""
        assert self.lock is not None
        self.writer.trusted = _trusted.TrustedChunks(name, columns.chunk_objects())

    # -- saves and derives: leaves, then one checkpoint -------------------------------------------
    def write_leaves(
        self, prepared: Prepared, *, primary: bool = True, pieces_kept: bool = False
    ) -> tuple[LeafTable, list[ChunkRef]]:
        """Write the chunks of ``prepared``'s leaves (:func:`treestore._engine.saving.chunking.write_leaves`);
        returns the leaves' columns and the pack chunks."""
        assert self.lock is not None
        table = LeafTable(pieces_kept=pieces_kept)
        packs = _chunking.write_leaves(prepared, self.options, self.writer, self.lock, table, primary=primary)
        return table, packs

    def header(self) -> dict[str, Any]:
        """The manifest's fields that are not its leaves' (but its creation time)."""
        return {
            "name": self.name,
            "metadata": self.metadata,
            "codec": self.options.codec.to_record(),
            "chunk_size": self.options.chunk_size,
        }

    def columns(self, fields: dict[str, Any], nodes: object) -> Columns:
        """The manifest of ``fields`` (its leaves' columns) and ``nodes`` under this write's
        header, created now, checked as readers check it before anything refers to it."""
        return columns_from_fields({**fields, **self.header(), "created": time.time()}, nodes)

    def commit(self, columns: Columns) -> SaveResult:
        """Commit checkpoint ``columns``, encoded here (:meth:`commit_manifest`); what this
        write did."""
        self.commit_manifest(columns, encode(columns))
        return self.writer.result(columns.name, len(columns), columns.nbytes)

    # -- copies: stored objects, then their checkpoints ---------------------------------------
    def put_object(self, chunk: bytes, raw_size: int, fetch: Callable[[], bytes]) -> int:
        """Chunk object ``chunk`` (its digest; ``raw_size`` raw bytes) present in the store:
        taken as present when trusted (returns -1), kept when the object under its name passes
        the check a save applies before reusing one (returns 0), written from ``fetch()``
        otherwise, over a bad one (returns the stored bytes written); in a folder made for this
        copy, written with no check."""
        trusted = self.writer.trusted
        if (trusted is not None and chunk in trusted.stored) or chunk in self._committed:
            return -1
        if not self.writer.in_new_folder(chunk) and reusable_size(self.storage, chunk, raw_size) is not None:
            return 0
        data = fetch()
        self.replace_object(chunk, data)
        return len(data)

    def replace_object(self, chunk: bytes, data: bytes) -> None:
        """Write ``data`` (checked against digest ``chunk`` by the caller) as chunk object
        ``chunk``, over whatever stands under its name."""
        assert self.lock is not None
        self.storage.write(_paths.chunk_path(chunk), [data])

    def put_part(self, part: bytes, data: bytes) -> None:
        """Write ``data`` (checked by the caller) as the manifest part of digest ``part``."""
        assert self.lock is not None
        self.storage.write(_paths.manifest_path(part), [data])

    def commit_manifest(
        self,
        columns: Columns,
        manifest: bytes,
        version: int = FORMAT_VERSION,
        chunks: Sequence[bytes] = (),
    ) -> None:
        """Commit checkpoint ``columns`` as ``manifest`` (its bytes, in format ``version``: a
        copy keeps its source's), through :func:`treestore._engine.commit.commit`, the one
        commit step: a save's encoded columns, a multi-process save's frame, a copied manifest.
        ``chunks`` (digests) are in the store; a write that trusts chunks then trusts those."""
        assert self.lock is not None
        record = commit(self.storage, manifest, columns, overwrite=self.overwrite, version=version)
        _trusted.remember(record, columns)  # the next save here learns it undecoded
        if self._trusting:  # written or checked under this lock, and now referenced
            self._committed.update(chunks)


def writing(
    storage: Storage,
    name: str | None,
    *,
    options: SaveOptions | None = None,
    overwrite: bool = False,
    metadata: Any = None,
    previous: _trusted.Previous = True,
    on_chunk: Callable[[int], None] | None = None,
) -> Writing:
    """Begin a write of checkpoint ``name`` into ``storage``: the name and ``metadata`` checked,
    CheckpointExistsError when it exists and ``overwrite`` is False, then the save lock taken and
    the chunks of ``previous`` learned (True: the store's newest checkpoint; False: none). Use it
    as a context manager: the lock is released on leaving."""
    return Writing(
        storage, name, options=options, overwrite=overwrite, metadata=metadata, on_chunk=on_chunk
    ).hold(previous)
