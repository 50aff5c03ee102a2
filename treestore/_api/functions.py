"""The one-call entry points: :func:`save`, :func:`load`, :func:`open` and :func:`diff` of a
checkpoint named by a URL spec (``url#name``), each through a :class:`Store`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from treestore._api.checkpoint import Checkpoint
from treestore._api.inspection import diff as _diff
from treestore._api.spec import Spec, parse_spec
from treestore._api.store import Store
from treestore._deprecated import warn_renamed
from treestore._engine.progress import Progress
from treestore._engine.reading import memory as _memory
from treestore._format import select as _select
from treestore.errors import InvalidInputError

if TYPE_CHECKING:
    from treestore._engine import write as _write
    from treestore._format.codecs import Codec

Patterns = _select.Patterns


def save(
    url: Spec,
    tree: Any,
    name: str | None = None,
    *,
    metadata: Any = None,
    overwrite: bool = False,
    codec: Codec | None = None,
    options: _write.SaveOptions | None = None,
    storage_options: dict[str, Any] | None = None,
    trust_previous: bool = True,
) -> _write.SaveResult:
    """Save ``tree`` as checkpoint ``name`` in the store at ``url``.

    A failed save leaves nothing visible and never touches an earlier checkpoint; see
    :meth:`Store.save` for what a save reads and writes.

    Args:
        url: The store (a local path or an fsspec URL), or the checkpoint as ``URL#NAME`` or
            ``(URL, NAME)``, as :func:`load` takes it.
        tree: A pytree of arrays (numpy, jax, PRNG keys) and Python scalars.
        name: The checkpoint's name, unless ``url`` names it.
        metadata: Any msgpack-able value stored with the checkpoint.
        overwrite: Replace a checkpoint of that name instead of raising.
        codec: How chunks are compressed (see :class:`Codec`).
        options: Chunk sizes, packing and threads (see :class:`SaveOptions`).
        storage_options: Options for the fsspec filesystem.
        trust_previous: False checks every chunk in the store instead of trusting the newest
            checkpoint's manifest.

    Returns:
        SaveResult: A :class:`treestore.types.SaveResult`.

    Raises:
        UnsupportedLeafError: A leaf has a type treestore cannot store (a ``TypeError``,
            raised before anything is written; so are the errors below).
        UnsupportedKeyError: A key cannot become an address (a ``TypeError``).
        InvalidInputError: The name, an option or the tree is refused (a cycle, a tree too
            deep, an address over its bound), no name is given, or two different ones are.
        CheckpointExistsError: ``name`` exists and ``overwrite`` is False.

    Examples:
        >>> import numpy as np, treestore
        >>> r = treestore.save("memory://doc/save", {"w": np.zeros((2, 2))}, "first")
        >>> r.leaves, r.nbytes
        (1, 32)
        >>> _ = treestore.save("memory://doc/save#second", {"w": np.ones((2, 2))})
        >>> treestore.load("memory://doc/save#second")["w"].sum()
        np.float64(4.0)
    """
    url, name = parse_spec(url, name)
    if name is None:
        raise InvalidInputError(
            f"save needs a checkpoint name: save({url!r}, tree, NAME) or save('{url}#NAME', tree)"
        )
    store = Store(url, storage_options=storage_options)
    return store.save(
        tree,
        name,
        metadata=metadata,
        overwrite=overwrite,
        codec=codec,
        options=options,
        trust_previous=trust_previous,
    )


def load(
    spec: Spec,
    name: str | None = None,
    *,
    like: Any = None,
    select: Patterns = None,
    prefix: str = "",
    cast: bool = False,
    partial: bool = False,
    threads: int | None = None,
    storage_options: dict[str, Any] | None = None,
    types: Iterable[type] | None = None,
    share: bool = True,
) -> Any:
    """Load a checkpoint, whole or in part, validated against a template when given.

    Every argument but ``spec`` and ``storage_options`` is that of :meth:`Store.load`, which
    says what each does.

    Args:
        spec: ``URL`` (its newest checkpoint), ``URL#NAME`` or ``(URL, NAME)``.
        name: The checkpoint, when ``spec`` is a bare URL.
        like: A template: the structure and types of the result.
        select: Patterns over addresses: restore only the matching leaves.
        prefix: With ``like``, the address of the subtree ``like`` describes.
        cast: With ``like``, convert to its dtypes instead of failing.
        partial: With ``like``, let it be a subset of the checkpoint.
        threads: Reading threads.
        storage_options: Options for the fsspec filesystem.
        types: Without ``like``, the namedtuple classes and dataclasses to restore as
            themselves.
        share: In a job of several processes, read each byte the template replicates across
            processes once and share it over the devices (False: every process reads its own).

    Returns:
        The restored tree.

    Raises:
        CheckpointNotFoundError: No such checkpoint.
        StructureMismatchError: The checkpoint does not match ``like``.
        NoMatchError: A ``select`` pattern matches no leaf.
        InvalidInputError: ``spec`` is not a checkpoint spec, or an argument is refused as by
            :meth:`Store.load`.
        DamagedError: A chunk or manifest fails its digest or is missing.

    Examples:
        >>> import numpy as np, treestore
        >>> _ = treestore.save("memory://doc/load", {"a": [1, 2.5], "b": np.arange(3)}, "one")
        >>> treestore.load("memory://doc/load#one")
        {'a': [1, 2.5], 'b': array([0, 1, 2])}
        >>> from typing import NamedTuple
        >>> class Point(NamedTuple):
        ...     x: float
        ...     y: float
        >>> _ = treestore.save("memory://doc/load", {"p": Point(1.0, 2.0)}, "typed")
        >>> treestore.load("memory://doc/load#typed")
        {'p': {'x': 1.0, 'y': 2.0}}
        >>> treestore.load("memory://doc/load#typed", types=[Point])
        {'p': Point(x=1.0, y=2.0)}
    """
    url, name = parse_spec(spec, name)
    store = Store(url, storage_options=storage_options)
    return store.load(
        name,
        like=like,
        select=select,
        prefix=prefix,
        cast=cast,
        partial=partial,
        threads=threads,
        types=types,
        share=share,
    )


def open(spec: Spec, name: str | None = None, *, storage_options: dict[str, Any] | None = None) -> Checkpoint:
    """A lazy, read-only view of a checkpoint; only its manifest is read.

    Leaves are :class:`LazyLeaf` handles with ``shape``, ``dtype``, ``address`` and numpy-style
    slicing that reads only the chunks a slice touches.

    Args:
        spec: ``URL`` (its newest checkpoint), ``URL#NAME`` or ``(URL, NAME)``.
        name: The checkpoint, when ``spec`` is a bare URL.
        storage_options: Options for the fsspec filesystem.

    Returns:
        Checkpoint: A :class:`Checkpoint`.

    Raises:
        CheckpointNotFoundError: No such checkpoint.
        InvalidInputError: ``spec`` is not a checkpoint spec.

    Examples:
        >>> import numpy as np, treestore
        >>> _ = treestore.save("memory://doc/open2", {"w": np.arange(6.0)}, "c")
        >>> treestore.open("memory://doc/open2#c")["w"][2:4]
        array([2., 3.])
    """
    url, name = parse_spec(spec, name)
    return Store(url, storage_options=storage_options).open(name)


def resolve(spec: Checkpoint | Spec, storage_options: dict[str, Any] | None = None) -> Checkpoint:
    """A Checkpoint from a Checkpoint, or from ``URL`` (newest) / ``URL#NAME`` / ``(URL, NAME)``."""
    if isinstance(spec, Checkpoint):
        return spec
    return open(spec, storage_options=storage_options)


def diff(
    a: Checkpoint | Spec,
    b: Checkpoint | Spec,
    *,
    values: bool = False,
    select: Patterns = None,
    storage_options: dict[str, Any] | None = None,
    stats: bool | None = None,
    progress: Progress | None = None,
) -> _diff.Diff:
    """The exact difference between two checkpoints, possibly in stores on different filesystems.

    Without ``values`` only manifests are read: leaves whose digests are equal are unchanged.

    Args:
        a: The first checkpoint: ``URL`` (its newest), ``URL#NAME``, ``(URL, NAME)`` or a
            :class:`Checkpoint`.
        b: The second checkpoint, given the same ways.
        values: Compare the values of each changed array leaf: its max and mean absolute
            change, relative L2 change, the fraction of elements changed and NaN/Inf counts (only
            changed chunks are read).
        select: Patterns over addresses: compare only the matching leaves; every pattern must
            match a leaf of either checkpoint.
        storage_options: Options for the fsspec filesystem of both.
        stats: Deprecated: ``values`` (statistics are what a save records, SPEC.md section 6.8).
        progress: With ``values``, called as ``progress(bytes_done, bytes_total)`` as the
            leaves compared by value are read (raw bytes of both sides).

    Returns:
        Diff: A :class:`treestore.types.Diff`.

    Raises:
        CheckpointNotFoundError: Either checkpoint does not exist.
        NoMatchError: A ``select`` pattern matches no leaf.

    Examples:
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
    if stats is not None:
        warn_renamed("diff(stats=...)", "diff(values=...)")
        values = values or stats
    left, right = resolve(a, storage_options), resolve(b, storage_options)
    with _memory.memory_named(f"comparing checkpoints {left.name!r} and {right.name!r}", right.name):
        return _diff.diff_checkpoints(left, right, values=values, select=select, progress=progress)
