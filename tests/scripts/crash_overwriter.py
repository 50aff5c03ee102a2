"""Overwrite checkpoints, or copy them, in a loop until killed: the worker of
tests/system/test_crash_overwrite.py (tests only).

It is crash_saver.py (same zygote, same trees, same event lines) with two more modes:

- ``overwrite``: save ``make_tree(i)`` as ``ow-<i % 3>`` with ``overwrite=True`` and metadata
  ``{"i": i}``, for i = start, start + 1, ...;
- ``copy``: copy checkpoint ``c-<i % sources>`` of the store ``src`` (saved by the test, with
  metadata ``{"i": ...}``) to ``cp-<i % 3>`` of ``url`` with ``overwrite=True``.

Events: ``saving NAME I`` just before a save or copy of iteration I starts, ``committed NAME I``
once it returned.
"""

from __future__ import annotations

import itertools
import json
import sys
from typing import Any

try:
    import crash_saver  # run as a script: this folder is on sys.path
except ModuleNotFoundError:  # imported as a module (pytest's doctest collection)
    from tests.scripts import crash_saver

SLOTS = 3


def slot(mode: str, i: int) -> str:
    return f"{'ow' if mode == 'overwrite' else 'cp'}-{i % SLOTS}"


def run(job: dict[str, Any]) -> None:
    mode = job["mode"]
    if mode not in ("overwrite", "copy"):
        return _run_saver(job)
    import treestore

    url, start = job["url"], int(job["start"])
    out = crash_saver._Out(job["out"])
    store = treestore.Store(url)
    for i in itertools.count(start):
        name = slot(mode, i)
        out(f"saving {name} {i}")
        if mode == "overwrite":
            tree = crash_saver.make_tree(i)
            store.save(tree, name, metadata={"i": i}, overwrite=True, options=crash_saver.save_options())
        else:
            source = crash_saver.name_of(i % int(job["sources"]))
            treestore.copy(f"{job['src']}#{source}", f"{url}#{name}", overwrite=True, threads=4)
        out(f"committed {name} {i}")


_run_saver = crash_saver.run

if __name__ == "__main__":
    crash_saver.run = run  # the zygote's workers run these modes, and crash_saver's
    if sys.argv[1] == "zygote":
        crash_saver.zygote()
    else:
        sys.exit(crash_saver._run_logged(json.loads(sys.argv[2])))
