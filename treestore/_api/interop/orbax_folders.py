"""orbax checkpoint folders: finding the item a path names, checking every file under it before
orbax opens one, reading what orbax says about the step, and reading and writing the tree with
orbax itself (an optional dependency, imported only here). Every failure is an
UnsupportedFormatError naming the folder.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from treestore._api.interop.file_formats import check_kind, check_size
from treestore._format.limits import MAX_MANIFEST_BYTES, MAX_METADATA_BYTES, MiB
from treestore._format.manifest.rules import check_metadata
from treestore._tree.jax_import import jax
from treestore.errors import InvalidInputError, TreestoreError, UnsupportedFormatError

# The most an orbax JSON file may hold before anything reads it: _METADATA describes the tree, as
# a manifest does; the others hold a step's record (with the saver's custom metadata) or metrics.
ORBAX_JSON_BYTES = {"_METADATA": MAX_MANIFEST_BYTES, "_CHECKPOINT_METADATA": 16 * MiB, "metrics": 16 * MiB}


@contextlib.contextmanager
def quiet_orbax() -> Iterator[None]:
    """orbax's logging (absl's logger) held at ERROR while treestore drives orbax: it warns about
    files a StandardCheckpointer never writes. The previous level comes back afterwards."""
    global _quiet_depth, _absl_level
    absl = logging.getLogger("absl")
    with _quiet_lock:
        if _quiet_depth == 0:
            _absl_level = absl.level
            absl.setLevel(max(logging.ERROR, absl.getEffectiveLevel()))
        _quiet_depth += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_depth -= 1
            if _quiet_depth == 0:
                absl.setLevel(_absl_level)


_quiet_lock = threading.Lock()
_quiet_depth = 0
_absl_level = logging.NOTSET


def _steps(path: Path) -> list[Path]:
    """The step folders of an orbax CheckpointManager folder (named by their step), oldest first;
    unfinished ones (``7.orbax-checkpoint-tmp-…``) are not steps."""
    return sorted((p for p in path.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))


def orbax_item(path: Path) -> Path:
    """The orbax checkpoint folder ``path`` names: itself, the one item of a step folder, or the
    item of the newest step of a CheckpointManager folder."""
    if (path / "_METADATA").exists() or (path / "checkpoint").exists():
        return path
    subdirs = sorted(p for p in path.iterdir() if p.is_dir())
    items = [p for p in subdirs if (p / "_METADATA").exists() and not p.name.isdigit()]
    if len(items) == 1:
        return items[0]
    if items:
        names = ", ".join(p.name for p in items)
        raise InvalidInputError(f"{path} holds several orbax items ({names}); import one: {items[0]}")
    steps = _steps(path)
    if steps:
        return orbax_item(steps[-1])
    raise UnsupportedFormatError(f"{path} is not an orbax checkpoint folder (no _METADATA)")


def orbax_step(item: Path, given: Path) -> Path | None:
    """The step folder of a CheckpointManager that holds checkpoint ``item``, found from the
    folder ``given`` by the caller, or None. A step folder is named by its step: ``item`` itself
    (saved straight into it), or its parent when ``given`` is that parent or the manager's
    folder, or when the parent holds the step's ``_CHECKPOINT_METADATA``."""
    if item.name.isdigit():
        return item
    parent = item.parent
    if parent.name.isdigit() and (item != given or (parent / "_CHECKPOINT_METADATA").is_file()):
        return parent
    return None


def _json_file(path: Path) -> Any:
    """The JSON value in ``path`` (at most 1 MiB), or None when it is missing or not JSON; a FIFO,
    a device or a file over its cap in ORBAX_JSON_BYTES is refused before it is opened."""
    if not os.path.lexists(path):
        return None
    check_size(path, check_kind(path, "a regular file"), ORBAX_JSON_BYTES.get(path.name, MAX_METADATA_BYTES))
    try:
        with open(path, "rb") as f:
            return json.loads(f.read(MAX_METADATA_BYTES + 1))
    except (OSError, ValueError, RecursionError):
        return None


def check_orbax_files(item: Path) -> None:
    """Every entry under the orbax folder ``item`` a folder or a regular file (symlinks followed)
    and its JSON files within ORBAX_JSON_BYTES, checked before orbax opens any: orbax would block
    forever on a FIFO and read a link to /dev/zero until memory ran out."""
    seen: set[tuple[int, int]] = set()
    todo = [item]
    while todo:
        folder = todo.pop()
        st = check_kind(folder, "a folder")
        if (st.st_dev, st.st_ino) in seen:  # a link back up the tree
            continue
        seen.add((st.st_dev, st.st_ino))
        try:
            entries = sorted(folder.iterdir())
        except OSError as exc:
            raise UnsupportedFormatError(f"{folder}: cannot list it: {exc.strerror or exc}") from None
        for entry in entries:
            if entry.is_dir():  # a symlink followed; a link loop is caught by ``seen``
                todo.append(entry)
                continue
            st = check_kind(entry, "a regular file")
            if entry.name in ORBAX_JSON_BYTES:
                check_size(entry, st, ORBAX_JSON_BYTES[entry.name])


def orbax_metadata(item: Path, given: Path) -> dict[str, Any]:
    """What an orbax checkpoint says about itself besides its tree: the step and metrics of a
    CheckpointManager's step (see :func:`orbax_step`), and the ``custom_metadata`` the saver
    passed."""
    found: dict[str, Any] = {}
    step = orbax_step(item, given)
    if step is not None:
        found["step"] = int(step.name)
        metrics = _json_file(step / "metrics" / "metrics")
        if isinstance(metrics, dict):
            kept = {
                k: float(v)
                for k, v in metrics.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            }
            if kept:
                found["metrics"] = kept
    for folder in (item, *([step] if step is not None else [])):
        custom = _json_file(folder / "_CHECKPOINT_METADATA")
        custom = custom.get("custom_metadata") if isinstance(custom, dict) else None
        if isinstance(custom, dict) and custom:
            try:
                check_metadata(custom)
            except TreestoreError:
                continue
            found["custom_metadata"] = custom
            break
    return found


def _orbax(what: str) -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        raise UnsupportedFormatError(
            f"{what} needs the orbax-checkpoint package, which is not installed: "
            "pip install 'treestore-jax[orbax]'"
        ) from None
    return ocp


def read_orbax(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    ocp = _orbax(f"importing the orbax checkpoint {path}")
    from orbax.checkpoint import metadata as ocp_metadata

    given = Path(os.path.abspath(path))  # orbax refuses relative paths
    item = orbax_item(given)
    check_orbax_files(item)
    try:
        with quiet_orbax():
            checkpointer = ocp.PyTreeCheckpointer()
            meta = checkpointer.metadata(item)
            meta = getattr(meta, "item_metadata", meta)
            meta = getattr(meta, "tree", meta)

            def args(m: Any) -> Any:  # arrays come back as host numpy arrays, whatever their sharding
                if isinstance(m, ocp_metadata.ArrayMetadata):
                    return ocp.RestoreArgs(restore_type=np.ndarray)
                return ocp.RestoreArgs()

            tree = checkpointer.restore(item, restore_args=jax.tree.map(args, meta))
    except TreestoreError:
        raise
    except Exception as exc:
        raise UnsupportedFormatError(f"orbax could not restore {item}: {type(exc).__name__}: {exc}") from None
    return tree, {"item": str(item), **orbax_metadata(item, given)}


def write_orbax(tmp: str, tree: Any, custom_metadata: dict[str, Any] | None) -> None:
    """Save ``tree`` as an orbax StandardCheckpointer checkpoint in the new folder ``tmp``."""
    ocp = _orbax("writing orbax checkpoints")
    try:
        with quiet_orbax(), ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(os.path.abspath(tmp), tree, custom_metadata=custom_metadata or None)
    except Exception as exc:
        raise UnsupportedFormatError(
            f"orbax cannot write this checkpoint: {type(exc).__name__}: {exc}"
        ) from None
