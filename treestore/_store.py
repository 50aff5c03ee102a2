"""The public entry points: :class:`Store`, :func:`save` and :func:`load`."""

from __future__ import annotations

import builtins
import dataclasses
import difflib
import fnmatch
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax

from . import _diff, _gc, _layout, _lazy, _read, _region, _save, _template
from ._codecs import Codec
from ._errors import CheckpointNotFoundError, InvalidInputError, NoMatchError
from ._leaves import restore_array
from ._manifest import LeafEntry, Manifest, check_name
from ._storage import Storage, open_storage
from ._structure import rebuild

Patterns = str | Sequence[str] | None


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint as listed by :meth:`Store.list`."""

    name: str
    created: float  # seconds since the epoch
    leaves: int
    nbytes: int  # raw bytes of its array leaves
    metadata: Any


def _patterns(select: Patterns) -> tuple[str, ...] | None:
    if select is None:
        return None
    pats = (select,) if isinstance(select, str) else tuple(select)
    if not pats or not all(isinstance(p, str) for p in pats):
        raise InvalidInputError(f"select must be a pattern or a list of patterns, got {select!r}")
    return pats


def select_entries(manifest: Manifest, select: Patterns) -> list[LeafEntry]:
    """The leaves whose addresses match any pattern (glob: ``*``, ``?``, ``[...]``); every
    pattern must match something, else NoMatchError names the nearest addresses."""
    pats = _patterns(select)
    if pats is None:
        return list(manifest.leaves)
    addresses = [e.address for e in manifest.leaves]
    for p in pats:
        if not any(fnmatch.fnmatchcase(a, p) for a in addresses):
            near = difflib.get_close_matches(p, addresses, n=5, cutoff=0.3) or addresses[:5]
            raise NoMatchError(
                f"pattern {p!r} matches no leaf of checkpoint {manifest.name!r}; "
                f"nearest addresses: {', '.join(repr(a) for a in near)}",
                checkpoint=manifest.name,
            )
    return [e for e in manifest.leaves if any(fnmatch.fnmatchcase(e.address, p) for p in pats)]


class Store:
    """A store of checkpoints at a URL (a local path or any fsspec URL).

    >>> import numpy as np, treestore
    >>> store = treestore.Store("memory://doc/store")
    >>> _ = store.save({"w": np.ones(3, np.float32), "step": 1}, "step-1")
    >>> [c.name for c in store.list()]
    ['step-1']
    >>> store.load("step-1")
    {'w': array([1., 1., 1.], dtype=float32), 'step': 1}
    """

    def __init__(self, url: str | os.PathLike[str], **storage_options: Any) -> None:
        self.storage: Storage = open_storage(os.fspath(url), storage_options)
        self.url = self.storage.url

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    # -- writing -----------------------------------------------------------------------------
    def save(
        self,
        tree: Any,
        name: str,
        *,
        metadata: Any = None,
        overwrite: bool = False,
        codec: Codec | None = None,
        options: _save.SaveOptions | None = None,
    ) -> _save.SaveResult:
        """Save ``tree`` as checkpoint ``name``; raises before writing anything if a leaf or key
        is unsupported, and leaves nothing visible if the save fails."""
        options = options or _save.SaveOptions()
        if codec is not None:
            options = dataclasses.replace(options, codec=codec)
        check_name(name)
        prepared = _save.prepare(tree)
        return _save.write(
            self.storage, prepared, name, metadata=metadata, options=options, overwrite=overwrite
        )

    def delete(self, name: str) -> None:
        """Remove checkpoint ``name`` (its commit record); :meth:`gc` frees its chunks."""
        check_name(name)
        path = _layout.ref_path(name)
        if not self.storage.exists(path):  # a damaged record can still be deleted
            raise CheckpointNotFoundError(f"no checkpoint {name!r} in {self.url}", checkpoint=name)
        self.storage.delete(path)

    def gc(
        self,
        *,
        grace: float = _gc.GRACE,
        dry_run: bool = False,
        wait: float = 0.0,
        stale_after: float = _gc.STALE_AFTER,
    ) -> _gc.GcReport:
        """Remove chunks and manifests no committed checkpoint references.

        Unreferenced chunks younger than ``grace`` seconds are kept; gc waits up to ``wait``
        seconds for saves in flight, then raises StoreBusyError.
        """
        with _gc.gc_lock(self.storage, stale_after=stale_after, wait=wait) as lock:
            live_manifests: set[bytes] = set()
            live_chunks: set[bytes] = set()
            for ref in _read.committed_refs(self.storage):
                live_manifests.add(ref.manifest)
                live_chunks |= _read.read_manifest(self.storage, ref).chunk_digests()
            return _gc.collect(
                self.storage,
                live_manifests,
                live_chunks,
                grace=grace,
                stale_after=stale_after,
                dry_run=dry_run,
                own_lock=lock.path,
            )

    # -- reading -----------------------------------------------------------------------------
    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest first."""
        refs = sorted(_read.committed_refs(self.storage), key=lambda r: (r.created, r.name))
        return [CheckpointInfo(r.name, r.created, r.leaves, r.nbytes, r.metadata) for r in refs]

    def exists(self, name: str) -> bool:
        check_name(name)
        return self.storage.exists(_layout.ref_path(name))

    def latest(self) -> str:
        """The name of the newest committed checkpoint."""
        return _read.newest_ref(self.storage).name

    def manifest(self, name: str | None = None) -> Manifest:
        """The verified manifest of checkpoint ``name`` (default: the newest)."""
        ref = _read.newest_ref(self.storage) if name is None else _read.read_ref(self.storage, name)
        return _read.read_manifest(self.storage, ref)

    def open(self, name: str | None = None) -> _lazy.Checkpoint:
        """A lazy, read-only view of checkpoint ``name`` (default: the newest)."""
        return _lazy.Checkpoint(self.storage, self.manifest(name))

    def load(
        self,
        name: str | None = None,
        *,
        like: Any = None,
        select: Patterns = None,
        prefix: str = "",
        cast: bool = False,
        threads: int | None = None,
    ) -> Any:
        """Load checkpoint ``name`` (default: the newest).

        Without ``like``, builtin containers come back exactly and other nodes as dicts keyed by
        their key entries. With ``like`` (a tree of arrays, ``jax.ShapeDtypeStruct`` or scalars)
        the result has ``like``'s structure and types, after checking that addresses, shapes and
        dtypes match — one StructureMismatchError lists every difference. ``cast=True`` converts
        to ``like``'s dtypes instead of failing. ``select`` (glob patterns over addresses) and
        ``prefix`` (the address of the subtree ``like`` describes) restore part of a checkpoint;
        only the chunks of the leaves restored are read.
        """
        manifest = self.manifest(name)
        threads = threads or _save.DEFAULT_THREADS
        if like is not None:
            return self._load_like(manifest, like, select, prefix, cast, threads)
        if prefix:
            raise InvalidInputError("prefix= only applies with like=")
        entries = select_entries(manifest, select)
        arrays = self._arrays(manifest, entries, threads)
        wanted = {e.address for e in entries}

        def leaf(i: int) -> Any:
            e = manifest.leaves[i]
            if e.is_array:
                return restore_array(e.kind, arrays[e.address], e.prng_impl, weak_type=e.weak_type)
            return e.value

        return rebuild(manifest.tree, leaf, None if select is None else wanted.__contains__)

    def _arrays(self, manifest: Manifest, entries: builtins.list[LeafEntry], threads: int) -> dict[str, Any]:
        reader = _read.ChunkReader(self.storage, manifest)
        return _region.read_arrays(reader, [e for e in entries if e.is_array], threads=threads)

    def _load_like(
        self, manifest: Manifest, like: Any, select: Patterns, prefix: str, cast: bool, threads: int
    ) -> Any:
        if select is not None:
            allowed = {e.address for e in select_entries(manifest, select)}
            manifest = Manifest(
                manifest.name,
                manifest.created,
                manifest.tree,
                tuple(e for e in manifest.leaves if e.address in allowed),
                manifest.packs,
                manifest.metadata,
                manifest.codec,
                manifest.chunk_size,
                manifest.version,
            )
        slots, treedef = _template.match(manifest, like, cast=cast, strict=True, prefix=prefix)
        shardings = [_template.target_sharding(s) for s in slots]
        whole = [s.entry for s, sharding in zip(slots, shardings, strict=True) if sharding is None]
        reader = _read.ChunkReader(self.storage, manifest)  # one reader: packs are read once
        arrays = _region.read_arrays(reader, [e for e in whole if e.is_array], threads=threads)
        leaves = []
        with ThreadPoolExecutor(threads) as pool:
            for slot, sharding in zip(slots, shardings, strict=True):
                if sharding is None:
                    leaves.append(_template.restore(slot, arrays.get(slot.address)))
                    continue

                def read(region: tuple[slice, ...], entry: LeafEntry = slot.entry) -> Any:
                    return _region.read_region(reader, entry, region, pool)

                leaves.append(_template.assemble(slot, sharding, read))
        return jax.tree_util.tree_unflatten(treedef, leaves)


def save(
    url: str | os.PathLike[str],
    tree: Any,
    name: str,
    *,
    metadata: Any = None,
    overwrite: bool = False,
    codec: Codec | None = None,
    storage_options: dict[str, Any] | None = None,
) -> _save.SaveResult:
    """Save ``tree`` as checkpoint ``name`` in the store at ``url``.

    >>> import numpy as np, treestore
    >>> r = treestore.save("memory://doc/save", {"w": np.zeros((2, 2))}, "first")
    >>> r.leaves, r.nbytes
    (1, 32)
    """
    store = Store(url, **(storage_options or {}))
    return store.save(tree, name, metadata=metadata, overwrite=overwrite, codec=codec)


def load(
    url: str | os.PathLike[str],
    name: str | None = None,
    *,
    like: Any = None,
    select: Patterns = None,
    prefix: str = "",
    cast: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> Any:
    """Load checkpoint ``name`` (default: the newest) from the store at ``url``; see
    :meth:`Store.load`.

    >>> import numpy as np, treestore
    >>> _ = treestore.save("memory://doc/load", {"a": [1, 2.5], "b": np.arange(3)}, "one")
    >>> treestore.load("memory://doc/load")
    {'a': [1, 2.5], 'b': array([0, 1, 2])}
    """
    store = Store(url, **(storage_options or {}))
    return store.load(name, like=like, select=select, prefix=prefix, cast=cast)


def open(url: str | os.PathLike[str], name: str | None = None, **storage_options: Any) -> _lazy.Checkpoint:
    """A lazy, read-only view of checkpoint ``name`` (default: the newest) at ``url``.

    Leaves are :class:`LazyLeaf` handles with ``shape``, ``dtype``, ``address`` and numpy-style
    slicing that reads only the chunks a slice touches.

    >>> import numpy as np, treestore
    >>> _ = treestore.save("memory://doc/open2", {"w": np.arange(6.0)}, "c")
    >>> treestore.open("memory://doc/open2")["w"][2:4]
    array([2., 3.])
    """
    return Store(url, **storage_options).open(name)


def diff(
    a: _lazy.Checkpoint | str | os.PathLike[str],
    b: _lazy.Checkpoint | str | os.PathLike[str],
    *,
    stats: bool = False,
    select: Patterns = None,
    storage_options: dict[str, Any] | None = None,
) -> _diff.Diff:
    """The exact difference between two checkpoints, each given as ``URL`` (its newest checkpoint),
    ``URL#NAME`` or a :class:`Checkpoint`; the stores may be on different filesystems.

    Without ``stats`` only manifests are read. With ``stats=True`` each changed array leaf gets
    max/mean |a-b|, relative L2 change, the fraction of elements changed and NaN/Inf counts.
    ``select`` (glob patterns over addresses) limits the comparison to matching leaves.

    >>> import numpy as np, treestore
    >>> url = "memory://doc/diff"
    >>> _ = treestore.save(url, {"w": np.zeros(4), "b": np.ones(2)}, "a")
    >>> _ = treestore.save(url, {"w": np.zeros(4), "b": np.full(2, 1.5), "c": 0}, "b")
    >>> d = treestore.diff(f"{url}#a", f"{url}#b")
    >>> d.changed, d.added, d.unchanged
    (('b',), ('c',), ('w',))
    >>> treestore.diff(f"{url}#a", f"{url}#a").to_json()["identical"]
    True
    """
    return _diff.diff_checkpoints(
        _lazy.resolve(a, storage_options),
        _lazy.resolve(b, storage_options),
        stats=stats,
        select=_patterns(select),
    )
