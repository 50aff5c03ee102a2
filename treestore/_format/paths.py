"""The grammar of store paths (SPEC.md, "Store paths"): every path of a store is built and parsed
here, and nowhere else.

Each kind of object has a builder and a parser. A parser returns what the path names, or None
for a path that is not exactly one treestore writes: gc deletes only what parses, so a near miss
(uppercase hex, a wrong length, a chunk in another chunk's folder) is kept. The names of the
checkpoints a manager saves (``step-N``) and the order of a store's checkpoints (commit order)
are here too.
"""

from __future__ import annotations

import re
from typing import Protocol

from treestore._format.manifest.rules import check_name
from treestore.errors import InvalidInputError

CHUNKS = "chunks"
MANIFESTS = "manifests"
CHECKPOINTS = "checkpoints"
LOCKS = "locks"
STAGING = "staging"
FOLDERS = (CHECKPOINTS, CHUNKS, MANIFESTS)  # a store has at least one of these
LOCK_KINDS = ("save", "gc")

# Full paths, matched whole. A chunk's folder is the first two hex digits of its name.
_CHUNK = re.compile(r"chunks/([0-9a-f]{2})/(\1[0-9a-f]{62})")
_MANIFEST = re.compile(r"manifests/([0-9a-f]{64})")
_LOCK = re.compile(r"locks/(save|gc)-([0-9a-f]{32})")
_STAGING = re.compile(r"staging/([0-9a-f]{32})/(process-[0-9]+|outcome)")
_STEP_NAME = re.compile(r"step-(\d{9,})\Z")

_ID = re.compile(r"[0-9a-f]{32}")  # the <id> of a lock's or a staging record's path

# A local disk's temporary file, in the folder of the object it becomes. A name that starts
# with the prefix is never listed as an object; only one that matches whole is deleted by gc.
TEMPORARY_PREFIX = ".tmp-"
_TEMPORARY = re.compile(r"\.tmp-[0-9a-f]{32}")


def chunk_path(digest: bytes) -> str:
    h = digest.hex()
    return f"{CHUNKS}/{h[:2]}/{h}"


def parse_chunk(path: str) -> bytes | None:
    """The digest of the chunk object at ``path``, or None if it is not a chunk's path."""
    found = _CHUNK.fullmatch(path)
    return None if found is None else bytes.fromhex(found.group(2))


def manifest_path(digest: bytes) -> str:
    return f"{MANIFESTS}/{digest.hex()}"


def parse_manifest(path: str) -> bytes | None:
    """The digest of the manifest (or part) at ``path``, or None if it is not a manifest's path."""
    found = _MANIFEST.fullmatch(path)
    return None if found is None else bytes.fromhex(found.group(1))


def record_path(name: str) -> str:
    return f"{CHECKPOINTS}/{name}"


def parse_record(path: str) -> str | None:
    """The checkpoint name of the commit record at ``path``, or None: readers ignore an object
    under ``checkpoints/`` whose path there is not a valid checkpoint name."""
    prefix = CHECKPOINTS + "/"
    try:
        return check_name(path[len(prefix) :] if path.startswith(prefix) else "")
    except InvalidInputError:
        return None


def is_id(text: str) -> bool:
    """Whether ``text`` may be the ``<id>`` of a lock's or a staging record's path: 32 lowercase
    hex digits."""
    return _ID.fullmatch(text) is not None


def lock_path(kind: str, token: str) -> str:
    """The path of a lock of ``kind`` ("save" or "gc"); ``token``: 32 lowercase hex digits."""
    return f"{LOCKS}/{kind}-{token}"


def parse_lock(path: str) -> tuple[str, str] | None:
    """The kind and token of the lock at ``path``, or None: saves and gc count, and gc deletes,
    only objects named so."""
    found = _LOCK.fullmatch(path)
    return None if found is None else (found.group(1), found.group(2))


def outcome_path(save_id: str) -> str:
    """Where the primary of multi-process save ``save_id`` (32 lowercase hex digits) writes its
    outcome record."""
    return f"{STAGING}/{save_id}/outcome"


def parse_staging(path: str) -> tuple[str, str] | None:
    """The save id and record name (``outcome``, or ``process-<i>`` of earlier versions) of the
    staging record at ``path``, or None if it is not one."""
    found = _STAGING.fullmatch(path)
    return None if found is None else (found.group(1), found.group(2))


def temporary_name(token: str) -> str:
    """The file name of a temporary file; ``token``: 32 lowercase hex digits."""
    return f"{TEMPORARY_PREFIX}{token}"


def is_temporary(name: str) -> bool:
    """Whether the file name ``name`` (no folder) is one :func:`temporary_name` makes."""
    return _TEMPORARY.fullmatch(name) is not None


def step_name(step: int) -> str:
    """The checkpoint name of a step: zero-padded, so names sort like steps.

    >>> step_name(123)
    'step-000000123'
    """
    return f"step-{step:09d}"


def parse_step_name(name: str) -> int | None:
    """The step a checkpoint name made by :func:`step_name` names, or None for any other name."""
    found = _STEP_NAME.match(name)
    return None if found is None else int(found.group(1))


class _Committed(Protocol):
    @property
    def created(self) -> float: ...

    @property
    def name(self) -> str: ...


def commit_order(record: _Committed) -> tuple[float, str]:
    """The sort key of a store's checkpoints: commit order, by creation time, ties by name."""
    return (record.created, record.name)
