"""Crash consistency of overwrites and copies: a process that saves with ``overwrite=True``, or
copies checkpoints over existing ones, in a loop is killed with SIGKILL at random moments.

After every kill: each checkpoint committed before stays visible and loads bit-exact, holding
either the tree it held or the one the killed process was writing to it; verify finds nothing
wrong; gc then leaves exactly the referenced objects and no temporary files, and everything
still loads. The worker is tests/scripts/crash_overwriter.py (crash_saver.py's zygote with
two more modes); the zygote, kill and gc checks are test_crash.py's.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import treestore
from tests.scripts import crash_saver as worker
from tests.support.helpers import assert_tree_equal, read_events
from tests.system import test_crash as crash

pytestmark = [pytest.mark.slow]

SCRIPT = Path(__file__).parent.parent / "scripts" / "crash_overwriter.py"
TRIALS = 16  # per mode
SOURCES = 6  # checkpoints of the copy source
SEED = 20250112


@pytest.fixture(scope="module")
def zygote() -> Iterator[crash.Zygote]:
    with pytest.MonkeyPatch.context() as m:
        m.setattr(crash, "SCRIPT", SCRIPT)
        z = crash.Zygote()
    yield z
    z.close()


def tree_index(mode: str, i: int) -> int:
    """Which crash_saver tree iteration ``i`` of ``mode`` writes."""
    return i if mode == "overwrite" else i % SOURCES


def check(
    store: treestore.Store, mode: str, held: dict[str, set[int]], committed: set[str]
) -> tuple[list[str], dict[str, int]]:
    """Each visible checkpoint must load bit-exact as one of the iterations ``held`` allows it,
    and every ``committed`` one be visible; returns the problems and what each one holds."""
    problems: list[str] = []
    found: dict[str, int] = {}
    try:
        infos = store.list()
    except treestore.TreestoreError as exc:
        return [f"list() fails: {exc}"], found
    for info in infos:
        allowed = held.get(info.name, set())
        if not allowed:
            problems.append(f"{info.name} is visible but was never written")
            continue
        try:
            loaded = store.load(info.name)
        except treestore.TreestoreError as exc:
            problems.append(f"{info.name} does not load: {type(exc).__name__}: {exc}")
            continue
        match = [i for i in allowed if info.metadata == {"i": tree_index(mode, i)}]
        if not match:
            problems.append(f"{info.name} holds metadata {info.metadata}, expected one of {sorted(allowed)}")
            continue
        try:
            assert_tree_equal(loaded, worker.make_tree(tree_index(mode, match[0])))
        except AssertionError as exc:
            problems.append(f"{info.name} does not load as saved: {exc}")
        found[info.name] = match[0]
    lost = sorted(committed - {i.name for i in infos})
    if lost:
        problems.append(f"committed checkpoints lost: {lost}")
    report = treestore.verify(store.url) if infos else None
    if report is not None:
        problems += [f"verify: {p.message}" for p in report.problems]
    return problems, found


def after_kill(
    store: treestore.Store, mode: str, holds: dict[str, int], events: list[tuple[str, str]]
) -> tuple[list[str], int]:
    """Fold a trial's events into ``holds`` (name -> iteration) and check the store; returns the
    problems and the next iteration to run."""
    problems = [f"the worker failed: {rest}" for word, rest in events if word == "error"]
    in_flight: tuple[str, int] | None = None
    last = max(holds.values(), default=-1)
    for word, rest in events:
        if word in ("saving", "committed"):
            name, i = rest.split()
            last = max(last, int(i))
            in_flight = (name, int(i)) if word == "saving" else None
            if word == "committed":
                holds[name] = int(i)
    held = {name: {i} for name, i in holds.items()}
    if in_flight is not None:
        held.setdefault(in_flight[0], set()).add(in_flight[1])
    found_problems, found = check(store, mode, held, set(holds))
    holds.clear()
    holds.update(found)
    return problems + found_problems, last + 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["overwrite", "copy"])
def test_sigkill_during_overwrites_and_copies(zygote: crash.Zygote, tmp_path: Path, mode: str):
    rng = random.Random(f"{SEED}-{mode}")
    root = tmp_path / "store"
    store = treestore.Store(str(root))
    job: dict[str, Any] = {"mode": mode, "url": str(root)}
    if mode == "copy":
        src = treestore.Store(str(tmp_path / "src"))
        for i in range(SOURCES):
            src.save(worker.make_tree(i), worker.name_of(i), metadata={"i": i}, options=worker.save_options())
        job |= {"src": src.url, "sources": SOURCES}
    holds: dict[str, int] = {}
    next_i = 0
    failures: list[str] = []
    for trial in range(3 * TRIALS):  # at least TRIALS, and until every slot has committed
        if trial >= TRIALS and len(holds) == 3:
            break
        out = tmp_path / f"trial-{trial}.log"
        delay = rng.uniform(0.0, 0.5)
        pid = zygote.start({**job, "start": next_i, "out": str(out)})
        time.sleep(delay)
        crash.kill(zygote, pid)
        problems, next_i = after_kill(store, mode, holds, read_events(out))
        problems += crash.collect_garbage(store, root)  # the dead writer's leftovers go
        problems += check(store, mode, {n: {i} for n, i in holds.items()}, set(holds))[0]
        failures += [f"trial {trial} ({mode}, killed after {delay:.2f} s): {p}" for p in problems]
    assert not failures, f"{len(failures)} problems:\n" + "\n".join(failures)
    assert len(holds) == 3, f"the trials never committed every slot: {holds}"
