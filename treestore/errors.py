"""The exception tree, grouped by what a caller does about the error.

Every class derives from :class:`TreestoreError` and from the builtin that matches it, so
``except KeyError`` or ``except ValueError`` keep working for callers who do not know treestore.
Messages name the checkpoint and the address, what was expected and what was found.

Every class takes the arguments of :class:`TreestoreError` (``message``, ``checkpoint``,
``address``), except :class:`StructureMismatchError` and :class:`BarrierTimeoutError`, whose
docstrings list theirs.
"""

from __future__ import annotations

from collections.abc import Sequence


class TreestoreError(Exception):
    """Base class of every error treestore raises.

    Each argument is kept as the attribute of the same name, so a handler can tell which
    checkpoint and which leaf an error concerns without parsing its message.

    Args:
        message: What went wrong, as ``str()`` of the error gives it.
        checkpoint: The name of the checkpoint the error concerns; None when it concerns no one
            checkpoint (or the name is not known where it is raised).
        address: The address of the leaf the error concerns (such as ``params/0/.w``), or
            ``"the root"`` for the tree's root; None when it concerns no one leaf.

    Examples:
        >>> import numpy as np, treestore
        >>> _ = treestore.save("memory://doc/errors", {"w": np.zeros(2)}, "a")
        >>> try:
        ...     treestore.open("memory://doc/errors#a")["w"][5]
        ... except IndexError as e:  # OutOfBoundsError is an IndexError too
        ...     print(type(e).__name__, e.address, "|", e)
        OutOfBoundsError w | w: index 5 is out of bounds for axis 0 with size 2
        >>> try:
        ...     treestore.load("memory://doc/errors#b")
        ... except treestore.NotFoundError as e:
        ...     print(type(e).__name__, e.checkpoint)
        CheckpointNotFoundError b
    """

    def __init__(self, message: str, *, checkpoint: str | None = None, address: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.checkpoint = checkpoint
        self.address = address

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return self.message


# --- not found: the caller asked for something that is not there -------------------------------
class NotFoundError(TreestoreError, KeyError):
    """Something named by the caller does not exist."""


class CheckpointNotFoundError(NotFoundError):
    """No committed checkpoint of that name (or no checkpoint at all) in the store."""


class NoMatchError(NotFoundError):
    """An address pattern matched no leaf of the checkpoint."""


# --- the caller's input is wrong ------------------------------------------------------------------
class InvalidInputError(TreestoreError, ValueError):
    """An argument is invalid (a bad name, pattern, option, URL)."""


class OutOfBoundsError(TreestoreError, IndexError):
    """An index into a leaf lies outside its shape."""


class CheckpointExistsError(TreestoreError, FileExistsError):
    """A checkpoint of that name is already committed and overwriting was not asked for."""


class UnsupportedLeafError(TreestoreError, TypeError):
    """A leaf of the tree has a type treestore cannot store."""


class UnsupportedKeyError(TreestoreError, TypeError):
    """A key of the tree (a dict key, a custom node's key entry) cannot become an address."""


class StructureMismatchError(TreestoreError, ValueError):
    """The stored tree does not match the structure the caller expected (``like=``).

    The message counts the mismatches and lists them, one line each, at most
    :attr:`SHOWN` of each kind (missing, unexpected, other) with a count of the rest, then the
    ``hints`` (what to do, said once); ``problems`` holds every line. There is no ``address``:
    each line starts with the address it concerns.

    Args:
        problems: Every mismatch found, one line each (kept as a tuple in ``problems``).
        checkpoint: The name of the checkpoint compared with the template; None when unknown.
        hints: What to do about them, one line each (kept in ``hints``).

    Examples:
        >>> import numpy as np, treestore
        >>> _ = treestore.save("memory://doc/mismatch", {"w": np.zeros(2)}, "a")
        >>> try:
        ...     treestore.load("memory://doc/mismatch#a", like={"w": np.zeros(3)})
        ... except treestore.StructureMismatchError as e:
        ...     print(e.checkpoint, e.problems)
        a ('w: expected shape (3,), found (2,)',)
    """

    SHOWN = 10  # lines of each kind of mismatch the message shows

    def __init__(
        self, problems: Sequence[str], *, checkpoint: str | None = None, hints: Sequence[str] = ()
    ) -> None:
        self.problems = tuple(problems)
        self.hints = tuple(hints)
        where = f" in checkpoint {checkpoint!r}" if checkpoint else ""
        kinds: dict[str, list[str]] = {}
        for line in self.problems:
            kind = next((k for k in (": missing:", ": unexpected:") if k in line), "other")
            kinds.setdefault(kind, []).append(line)
        lines = []
        for kind, found in kinds.items():
            lines += found[: self.SHOWN]
            if len(found) > self.SHOWN:
                what = kind.strip(": ") if kind != "other" else "other mismatches"
                lines.append(f"... and {len(found) - self.SHOWN} more {what}")
        lines += [f"hint: {h}" for h in self.hints]
        text = "\n  ".join(lines)
        super().__init__(
            f"{len(self.problems)} structure mismatch(es){where}:\n  {text}", checkpoint=checkpoint
        )


# --- the store is damaged: data cannot be trusted -------------------------------------------------
class DamagedError(TreestoreError):
    """Stored bytes do not match what the checkpoint promises."""


class ChunkDamagedError(DamagedError):
    """A chunk's bytes do not hash to its digest, or do not decode to its declared size."""


class ChunkMissingError(DamagedError, NotFoundError):
    """A chunk the checkpoint references is not in the store."""


class ManifestDamagedError(DamagedError):
    """A manifest or commit record is truncated, garbage, or breaks the schema or its bounds."""


# --- the store is fine but this version cannot read it --------------------------------------------
class UnsupportedFormatError(TreestoreError):
    """The store uses a format version, codec or dtype this version of treestore does not know."""


class OutOfMemoryError(TreestoreError, MemoryError):
    """The host cannot hold what a load asks for (the leaf is named)."""


class DeviceError(TreestoreError, RuntimeError):
    """An accelerator failed to hand a leaf's bytes to the host during a save (the leaf is
    named; nothing was committed), or the collective that shares a restore's replicated leaves
    between processes failed (another process died in it; every process raises). Retrying may
    succeed once the device, or the job, recovers."""


# --- the storage underneath failed --------------------------------------------------------------
class StorageError(TreestoreError, OSError):
    """The filesystem failed (permission, network, a killed server). Retrying may succeed."""


class StoreBusyError(StorageError):
    """Another process holds the store for a conflicting operation (a save during gc)."""


class BarrierTimeoutError(StorageError, TimeoutError):
    """A multi-process save or restore gave up waiting for other processes of its job (SPEC.md,
    section 8).

    ``missing`` holds the indices of the processes that did not arrive (empty when this process
    was the late one, or when a restore's collective did not finish). The primary commits only
    after every process has arrived, so nothing is committed, except when a process stops
    waiting for the primary's outcome: the message then says that the primary may still commit.
    A restore that shares bytes between processes returns nothing on any process.

    Args:
        message: What the process waited for, for how long, and whether anything was committed.
        missing: The indices of the processes that did not arrive (kept as a tuple in
            ``missing``).
        checkpoint: The name of the checkpoint being saved or restored.
    """

    def __init__(self, message: str, *, missing: Sequence[int] = (), checkpoint: str | None = None) -> None:
        self.missing = tuple(missing)
        super().__init__(message, checkpoint=checkpoint)


# Names of 0.2, kept for code that catches them: each is the class that replaced it.
_RENAMED = {
    "CorruptionError": "DamagedError",
    "ChunkCorruptError": "ChunkDamagedError",
    "ManifestCorruptError": "ManifestDamagedError",
}


def __getattr__(name: str) -> type[TreestoreError]:
    new = _RENAMED.get(name)
    if new is None:
        raise AttributeError(f"module 'treestore.errors' has no attribute {name!r}")
    from treestore._deprecated import warn_renamed

    warn_renamed(f"treestore.errors.{name}", new)
    cls: type[TreestoreError] = globals()[new]
    return cls
