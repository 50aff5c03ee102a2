"""Temporary files beside an export's destination, made so that no one can aim them elsewhere.

An export writes each file under a temporary name in the destination folder and renames it into
place. A predictable name that is opened with ``open(name, "wb")`` follows whatever link another
user planted there, so the export would overwrite the file the link points to. :func:`create`
makes the file itself, under a name with a random part, with ``O_CREAT | O_EXCL`` (which never
follows a link) and the permissions an ordinary new file gets. :func:`remove_abandoned` deletes
the temporary files of exports whose process no longer runs (an export that was killed).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from pathlib import Path

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)


def create(folder: Path, stem: str) -> tuple[int, Path]:
    """A new empty file in ``folder`` named for ``stem`` and this process, open for writing
    (the descriptor is the caller's to close), and its path."""
    while True:
        path = folder / f".{stem}.tmp-{os.getpid()}-{secrets.token_hex(6)}"
        try:
            return os.open(path, _FLAGS, 0o666), path
        except FileExistsError:  # taken (by chance or by someone else): another name
            continue


def remove_abandoned(folder: Path, stem: str) -> None:
    """Delete the temporary files of ``stem`` in ``folder`` left by exports whose process has
    ended (on POSIX, where a process can be asked whether it runs without being signalled)."""
    if os.name != "posix":
        return
    pattern = re.compile(re.escape(f".{stem}.tmp-") + r"(\d+)-[0-9a-f]{12}")
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        found = pattern.fullmatch(name)
        if found is not None and not _running(int(found.group(1))):
            with contextlib.suppress(OSError):  # gone already, or not ours to remove
                os.unlink(folder / name)  # a link is removed, never followed


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True  # this process's own files are its to remove
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process, or not a pid: left alone
    return True


__all__ = ["create", "remove_abandoned"]
