"""Where each kind of object lives under a store root (SPEC.md, "Store paths")."""

from __future__ import annotations

CHUNKS = "chunks"
MANIFESTS = "manifests"
CHECKPOINTS = "checkpoints"
LOCKS = "locks"
STAGING = "staging"
FOLDERS = (CHECKPOINTS, CHUNKS, MANIFESTS)  # a store has at least one of these


def chunk_path(digest: bytes) -> str:
    h = digest.hex()
    return f"{CHUNKS}/{h[:2]}/{h}"


def manifest_path(digest: bytes) -> str:
    return f"{MANIFESTS}/{digest.hex()}"


def record_path(name: str) -> str:
    return f"{CHECKPOINTS}/{name}"


def digest_from_path(path: str) -> bytes | None:
    """The digest an object path names, or None for anything that is not a digest-named object."""
    name = path.rsplit("/", 1)[-1]
    if len(name) != 64:
        return None
    try:
        return bytes.fromhex(name)
    except ValueError:
        return None
