"""A store as an object: :class:`Store`, whose methods save, load, open, list, derive, delete and
collect the checkpoints at one URL (the one-call functions are in :mod:`treestore._api.functions`)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from treestore._api.listing import CheckpointInfo, list_checkpoints
from treestore._api.spec import Spec, split_spec, store_url
from treestore._deprecated import internal_attribute
from treestore._engine import gc as _gc
from treestore._engine.progress import Progress
from treestore._engine.reading import committed as _committed
from treestore._engine.reading import memory as _memory
from treestore._format import paths as _paths
from treestore._format import select as _select
from treestore._format.manifest.rules import check_name
from treestore._storage.base import Storage
from treestore._storage.registry import open_storage
from treestore.errors import InvalidInputError

if TYPE_CHECKING:
    from treestore._api.checkpoint import Checkpoint
    from treestore._api.inspection import norms as _norms
    from treestore._api.inspection import timeline as _timeline
    from treestore._engine import write as _write
    from treestore._format.codecs import Codec
    from treestore._format.manifest.record_views import Manifest

# Each method imports the engine it alone uses (saving, loading, opening, deriving, timelines):
# listing a store or reading one record, as the first command of a shell does, pays for none.

Patterns = _select.Patterns


class Store:
    """A store of checkpoints at a URL (a local path or any fsspec URL).

    Making a Store reads nothing; every method reads or writes the store when called.

    Args:
        url: The store's folder: a local path or an fsspec URL (``s3://bucket/run``), without
            ``#NAME``.
        storage_options: Options for the fsspec filesystem, passed on unchanged.

    Raises:
        InvalidInputError: ``url`` is not a usable URL, names a checkpoint (``URL#NAME``), or
            its filesystem is not installed.

    Examples:
        >>> import numpy as np, treestore
        >>> store = treestore.Store("memory://doc/store")
        >>> _ = store.save({"w": np.ones(3, np.float32), "step": 1}, "step-1")
        >>> [c.name for c in store.list()]
        ['step-1']
        >>> store.load("step-1")
        {'w': array([1., 1., 1.], dtype=float32), 'step': 1}
        >>> store, name = treestore.Store.split("memory://doc/store#step-1")
        >>> store.url, name
        ('memory://doc/store', 'step-1')
    """

    def __init__(self, url: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> None:
        self._storage: Storage = open_storage(store_url(url), storage_options)
        self.url = self._storage.url

    storage = internal_attribute("Store", "storage", "_storage", "Store.url and the methods of Store")

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    @classmethod
    def split(cls, spec: Spec, *, storage_options: dict[str, Any] | None = None) -> tuple[Store, str | None]:
        """Split a checkpoint spec into its store and checkpoint name, reading nothing.

        Args:
            spec: ``URL#NAME``, ``(URL, NAME)`` or ``URL``.
            storage_options: Options for the fsspec filesystem.

        Returns:
            tuple[Store, str | None]: The :class:`Store` and the checkpoint name (None for a bare URL).

        Raises:
            InvalidInputError: ``spec`` is none of those forms, or the name is not a valid
                checkpoint name.
        """
        url, name = split_spec(spec)
        return cls(url, storage_options=storage_options), name

    # -- writing -----------------------------------------------------------------------------
    def save(
        self,
        tree: Any,
        name: str,
        *,
        metadata: Any = None,
        overwrite: bool = False,
        codec: Codec | None = None,
        options: _write.SaveOptions | None = None,
        trust_previous: bool = True,
    ) -> _write.SaveResult:
        """Save ``tree`` as checkpoint ``name``.

        A save writes its chunks, then its manifest, then the commit record that makes it
        visible, so a failed save leaves nothing visible. The chunks of the store's newest
        checkpoint are referenced without a request for each (its manifest is read once the save
        holds its lock, when no gc can delete them); other chunks cost an existence check, and a
        reuse read when present (none in a local folder the save itself made).

        Args:
            tree: A pytree of arrays (numpy, jax, PRNG keys) and Python scalars.
            name: The checkpoint's name.
            metadata: Any msgpack-able value stored with the checkpoint.
            overwrite: Replace a checkpoint of that name instead of raising.
            codec: How chunks are compressed (see :class:`Codec`); overrides ``options.codec``.
            options: Chunk sizes, packing and threads (see :class:`SaveOptions`).
            trust_previous: False checks every chunk in the store instead of trusting the newest
                checkpoint's manifest.

        Returns:
            SaveResult: A :class:`treestore.types.SaveResult`: leaves, bytes, chunks written and reused.

        Raises:
            UnsupportedLeafError: A leaf has a type treestore cannot store (a ``TypeError``,
                raised before anything is written; so are the errors below).
            UnsupportedKeyError: A key cannot become an address (a ``TypeError``).
            InvalidInputError: The name, an option or the tree is refused (a cycle, a tree
                too deep, an address over its bound).
            CheckpointExistsError: ``name`` exists and ``overwrite`` is False.
        """
        from treestore._engine import write as _write
        from treestore._tree import prepare as _prepare
        from treestore._tree.collector_pause import paused_collector

        options = options or _write.SaveOptions()
        if codec is not None:
            options = dataclasses.replace(options, codec=codec)
        check_name(name)
        # one pause while the caller waits (see treestore._tree.collector_pause); the prepared
        # leaves are an argument, not a local, so they are freed before the collector resumes
        with paused_collector():
            return _write.write(
                self._storage,
                _prepare.prepare(tree, keep=options.keep),
                name,
                metadata=metadata,
                options=options,
                overwrite=overwrite,
                previous=bool(trust_previous),
            )

    def delete(self, name: str) -> None:
        """Remove checkpoint ``name`` (its commit record); :meth:`gc` frees its chunks.

        Args:
            name: The checkpoint to remove; a damaged one can be removed too.

        Raises:
            CheckpointNotFoundError: No checkpoint of that name.
            InvalidInputError: ``name`` is not a valid checkpoint name.
        """
        _committed.delete_record(self._storage, name)

    def gc(
        self,
        *,
        grace: float = _gc.GRACE,
        dry_run: bool = False,
        wait: float = 0.0,
        stale_after: float = _gc.STALE_AFTER,
    ) -> _gc.GcReport:
        """Remove chunks and manifests no committed checkpoint references.

        While a checkpoint is damaged (its commit record or manifest cannot be read) no chunk or
        manifest is removed: the report's ``damaged`` names it, and a warning is logged.

        Args:
            grace: Keep unreferenced chunks younger than this many seconds (they may belong to a
                save still running).
            dry_run: Report what would be removed, remove nothing.
            wait: Seconds to wait for saves in flight before giving up.
            stale_after: Seconds after which a lock left by a crashed process is ignored.

        Returns:
            GcReport: A :class:`treestore.types.GcReport` of what was (or would be) removed.

        Raises:
            StoreBusyError: Saves were still in flight after ``wait`` seconds.
            StorageError: A listing failed (before anything is deleted).
        """
        return _gc.collect_garbage(
            self._storage, grace=grace, dry_run=dry_run, wait=wait, stale_after=stale_after
        )

    # -- reading -----------------------------------------------------------------------------
    def list(self, *, damaged: bool = False) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest first.

        A damaged checkpoint (its commit record cannot be read) is left out and named in a
        warning of the logger ``treestore``; :func:`treestore.verify` tells what is wrong.

        Args:
            damaged: Also list damaged checkpoints and those of a newer format, after the others
                in name order, with the problem in ``problem`` (what a listing for people shows:
                nothing hidden, nothing fatal).

        Returns:
            list[CheckpointInfo]: A list of :class:`treestore.types.CheckpointInfo`.

        Raises:
            UnsupportedFormatError: A checkpoint of a newer format (without ``damaged``).
            StorageError: The listing failed.
        """
        return list_checkpoints(self._storage, damaged=damaged)

    def exists(self, name: str) -> bool:
        """Whether a checkpoint is committed.

        Only the presence of its commit record is checked; nothing is read or verified.

        Args:
            name: The checkpoint's name.

        Returns:
            True when the store holds a commit record of that name (damaged or not).

        Raises:
            InvalidInputError: ``name`` is not a valid checkpoint name.
        """
        check_name(name)
        return self._storage.exists(_paths.record_path(name))

    def is_store(self) -> bool:
        """Whether anything of a treestore store is at this URL (a mistyped URL is not).

        Returns:
            True when the URL holds a ``checkpoints``, ``chunks`` or ``manifests`` folder.
        """
        return any(self._storage.exists(folder) for folder in _paths.FOLDERS)

    def latest(self) -> str:
        """The name of the newest committed checkpoint.

        Returns:
            The name of the readable checkpoint saved last (by ``created``, then by name).

        Raises:
            CheckpointNotFoundError: The store has no checkpoint.
        """
        return _committed.newest_record(self._storage).name

    def manifest(self, name: str | None = None) -> Manifest:
        """The verified manifest of a checkpoint, as a read-only view: its leaf entries are made
        as they are read.

        Args:
            name: The checkpoint (default: the newest).

        Returns:
            Manifest: A :class:`treestore.types.Manifest`.

        Raises:
            CheckpointNotFoundError: No such checkpoint.
        """
        from treestore._format.manifest.record_views import Manifest

        record = _committed.find_record(self._storage, name)
        with _memory.memory_named(f"reading the manifest of checkpoint {record.name!r}", record.name):
            return Manifest(_committed.read_columns(self._storage, record))

    def open(self, name: str | None = None) -> Checkpoint:
        """A lazy, read-only view of a checkpoint; its leaves are made as they are asked for.

        Of a multi-process checkpoint, only the frame of its manifest is read here: the parts
        holding a sharded leaf are read (and a missing or damaged one reported) when the leaf,
        the whole tree or the manifest is first asked for.

        Args:
            name: The checkpoint (default: the newest).

        Returns:
            Checkpoint: A :class:`Checkpoint`.

        Raises:
            CheckpointNotFoundError: No checkpoint of that name (or none at all).
        """
        from treestore._api.checkpoint import Checkpoint

        record = _committed.find_record(self._storage, name)
        with _memory.memory_named(f"opening checkpoint {record.name!r}", record.name):
            return Checkpoint(self._storage, _committed.read_frame(self._storage, record))

    def load(
        self,
        name: str | None = None,
        *,
        like: Any = None,
        select: Patterns = None,
        prefix: str = "",
        cast: bool = False,
        partial: bool = False,
        threads: int | None = None,
        types: Iterable[type] | None = None,
        share: bool = True,
    ) -> Any:
        """Load a checkpoint, whole or in part, validated against a template when given.

        Without ``like``, builtin containers (dicts with their key order and int keys, lists,
        tuples, None, OrderedDict) come back exactly and other nodes as dicts keyed by their key
        entries. Nothing is ever imported or constructed that the caller did not pass.

        With ``like``, the result has ``like``'s structure and types, after checking that
        addresses, shapes and dtypes match. Callables in ``like`` (an equinox module's activation
        functions) and its Python scalars where the checkpoint holds None (what
        ``eqx.filter(model, eqx.is_array)`` leaves) come back as ``like`` has them.

        Only the chunks of the leaves restored are read.

        Args:
            name: The checkpoint (default: the newest).
            like: A tree of arrays, ``jax.ShapeDtypeStruct`` (with shardings to restore onto a
                mesh) or scalars: the structure and types of the result.
            select: Patterns over addresses (one or a list): restore only the matching
                leaves; every pattern must match one.
            prefix: With ``like``, the address of the subtree ``like`` describes.
            cast: With ``like``, convert to ``like``'s dtypes instead of failing, and a Python
                scalar to or from a 0-d array of its kind (a flax ``TrainState.create(...).step``
                of 0 and a saved ``int32[]`` step).
            partial: With ``like``, let ``like`` be a subset of the checkpoint: the other stored
                leaves are not read (a leaf of ``like`` the checkpoint lacks is still an error).
            threads: Reading threads (default: chosen from the cores).
            types: Without ``like``, the namedtuple classes and dataclasses the caller trusts: a
                node whose stored type name (``module.qualname``) is one of them comes back as
                that class when its keys are the class's fields (a namedtuple's ``_fields`` in
                order; a dataclass's fields, those a pytree keeps static, such as a flax
                ``TrainState``'s ``apply_fn`` and ``tx``, set to their default or None). Other
                names stay dicts.
            share: In a job of several processes whose template replicates leaves across
                processes (a mesh spanning them), read each replicated byte from the store once,
                by one process, and share it over the devices' interconnect (every process of
                the job must then make this load); False: every process reads what its devices
                hold, as a single process does (see the sharding guide).

        Returns:
            The restored tree.

        Raises:
            CheckpointNotFoundError: No checkpoint of that name (or none at all).
            StructureMismatchError: The checkpoint does not match ``like`` (one error lists
                every difference), or a class in ``types`` does not match its stored fields.
            NoMatchError: A ``select`` pattern matches no leaf.
            InvalidInputError: ``prefix`` or ``partial`` without ``like``, or ``types`` with it.
            DamagedError: A chunk or manifest fails its digest or is missing.
            BarrierTimeoutError: Sharing bytes, another process of the job did not take its
                part within the barrier timeout (every process raises; see the sharing guide).
        """
        if (prefix or partial) and like is None:
            raise InvalidInputError(f"{'prefix=' if prefix else 'partial='} only applies with like=")
        if types is not None and like is not None:
            raise InvalidInputError("types= applies without like=: a template gives every node its type")
        from treestore._engine.group import restore_vote as _vote
        from treestore._engine.reading import load as _load
        from treestore._tree.structure import trusted_types

        trusted = trusted_types(types)
        vote = _vote.begin(like, share)  # None: this process reads all it restores
        with _vote.voting(vote):  # an error in any process: every process raises
            record = _committed.find_record(self._storage, name)
            if vote is not None:
                vote.checkpoint = record.name
            with _memory.memory_named(f"loading checkpoint {record.name!r}", record.name):
                return _load.load(
                    self._storage,
                    record,
                    like=like,
                    select=select,
                    prefix=prefix,
                    cast=cast,
                    partial=partial,
                    threads=threads,
                    trusted=trusted,
                    agreement=vote,
                )

    # -- derived checkpoints and timelines ---------------------------------------------------
    def derive(
        self,
        base: str,
        new: str,
        *,
        set: dict[str, Any] | None = None,
        drop: Patterns = None,
        rename: dict[str, str] | None = None,
        metadata: Any = ...,  # derive's KEEP: the base's metadata
        overwrite: bool = False,
        options: _write.SaveOptions | None = None,
    ) -> _write.SaveResult:
        """Commit checkpoint ``new``: checkpoint ``base`` edited without rewriting what stays.

        The edits apply in this order: ``drop``, ``rename``, ``set``. Containers left empty are
        removed. Only the chunks of ``set``'s leaves are written, and a new manifest: every other
        leaf keeps the base's chunks, which are not read. Untouched nodes keep their types
        (custom nodes included); removing an item of a list renumbers the items after it. As in
        patterns, ``h/11`` may stand for the address ``h/"11"``. Call it from one process (it is
        not a multi-process save).

        Args:
            base: The checkpoint to start from.
            new: The name of the checkpoint to commit.
            set: ``{address: tree}``: put ``tree``'s leaves at ``address``, replacing what was
                there or adding it (under a dict; missing dicts on the way are created).
            drop: Patterns over addresses: remove each leaf or subtree whose address matches.
            rename: ``{old: new}``: move every address under ``old`` under ``new``.
            metadata: The new checkpoint's metadata (default: the base's).
            overwrite: Replace checkpoint ``new`` if it exists.
            options: Chunk sizes, packing and threads for the leaves of ``set``.

        Returns:
            SaveResult: A :class:`treestore.types.SaveResult`.

        Raises:
            CheckpointNotFoundError: ``base`` does not exist.
            NoMatchError: A ``drop`` pattern or ``rename`` source matches nothing.
            InvalidInputError: A ``set`` overlaps a ``rename`` (or sets and renames overlap each
                other).
            CheckpointExistsError: ``new`` exists and ``overwrite`` is False.

        Examples:
            >>> import numpy as np, treestore
            >>> store = treestore.Store("memory://doc/derive")
            >>> tree = {"enc": {"w": np.ones(2)}, "head": np.zeros(3), "opt": {"mu": np.zeros(2)}}
            >>> _ = store.save(tree, "base")
            >>> r = store.derive(
            ...     "base", "new", set={"head": np.ones(4)}, drop="opt/**", rename={"enc": "encoder"}
            ... )
            >>> r.chunks_written, sorted(store.load("new"))
            (1, ['encoder', 'head'])
        """
        from treestore._api import derive as _derive

        return _derive.derive(
            self._storage,
            base,
            new,
            set=set,
            drop=drop,
            rename=rename,
            metadata=metadata,
            overwrite=overwrite,
            options=options,
        )

    def timeline(
        self,
        select: Patterns = None,
        depth: int | None = None,
        progress: Progress | None = None,
    ) -> _timeline.Timeline:
        """How much each array leaf changed from each checkpoint to the next, oldest first.

        Leaves whose digests are equal cost nothing; of the others only the chunks that differ
        are compared (as ``diff(values=True)``).

        Args:
            select: Patterns over addresses: keep the matching leaves.
            depth: Pool leaves by the first ``depth`` segments of their addresses.
            progress: Called as ``progress(done, total)`` with raw bytes compared.

        Returns:
            Timeline: A :class:`treestore.types.Timeline` of relative L2 changes (0.0 unchanged, NaN
            absent), with ``heatmap()`` and ``to_html()``.

        Examples:
            >>> import numpy as np, treestore
            >>> store = treestore.Store("memory://doc/timeline")
            >>> for step in range(3):
            ...     _ = store.save({"w": np.full(4, 2.0**step), "b": np.ones(2)}, f"step-{step}")
            >>> t = store.timeline()
            >>> t.addresses, t.values
            (('b', 'w'), ((0.0, 0.0), (1.0, 1.0)))
        """
        from treestore._api.inspection import timeline as _timeline

        return _timeline.timeline(self._storage, select=select, depth=depth, progress=progress)

    def norms(self, select: Patterns = None, depth: int | None = None) -> _norms.Norms:
        """The L2 norm of each array leaf at each checkpoint, oldest first, from the statistics
        recorded at save: only manifests are read (``treestore timeline --norms``).

        Args:
            select: Patterns over addresses: keep the matching leaves.
            depth: Pool leaves by the first ``depth`` segments of their addresses.

        Returns:
            Norms: A :class:`treestore.types.Norms` (NaN where a leaf is absent or has no statistics),
            with ``heatmap()`` and ``to_json()``.
        """
        from treestore._api.inspection import norms as _norms

        return _norms.norms(self._storage, select=select, depth=depth)


# The doctests of the methods: the classes report themselves as treestore.X (or treestore.types.X),
# which hides their methods from doctest's search of this module.
__test__ = {
    f"{cls.__name__}.{name}": getattr(cls, name)
    for cls in (Store,)
    for name, value in vars(cls).items()
    if not name.startswith("__") and ">>>" in (getattr(value, "__doc__", None) or "")
}
