"""Concurrency: writers in several processes, gc and retention at the same time, racing commits.

Four processes save 20 checkpoints each into one local store (two by plain saves that also delete
some of their own, two through CheckpointManagers whose retention deletes steps and runs gc),
while this process runs gc with no grace period in a loop and keeps loading checkpoints nobody may
delete. Afterwards no committed checkpoint is lost, everything visible loads exactly, verify is
clean, and a gc leaves exactly the referenced objects. Two writers racing for one name: exactly
one wins, the other gets CheckpointExistsError.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

import pytest

import treestore
from tests.scripts import concurrent_writer as writer
from tests.support.helpers import assert_tree_equal, read_events
from treestore._engine.reading import committed as _committed
from treestore._format import paths as _paths

pytestmark = [pytest.mark.slow]

SCRIPT = Path(__file__).parent.parent / "scripts" / "concurrent_writer.py"
REPO = Path(__file__).parent.parent.parent
SAVES = 20


def _start(job: dict[str, Any]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, str(SCRIPT), json.dumps(job)], cwd=REPO)


def _wait_ready(
    outs: list[Path], word: str, procs: list[subprocess.Popen[bytes]], timeout: float = 60
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        evs = [read_events(o) for o in outs]
        errors = [rest for ev in evs for w, rest in ev if w == "error"]
        assert not errors, errors[0].replace("\\n", "\n")
        if all(any(f"{w} {rest}".strip() == word for w, rest in ev) for ev in evs):
            return
        assert all(p.poll() is None for p in procs), "a writer exited before it was ready"
        assert time.monotonic() < deadline, f"writers never became {word!r}"
        time.sleep(0.01)


def expected(name: str) -> Any:
    if name.startswith("step-"):
        return writer.step_tree(int(name.split("-")[1]))
    p, i = name[1:].split("-")
    return writer.make_tree(int(p), int(i))


def _referenced(store: treestore.Store) -> set[str]:
    paths = set()
    for name in _committed.checkpoint_names(store._storage):
        ref = _committed.read_commit_record(store._storage, name)
        paths.add(_paths.manifest_path(ref.manifest))
        paths |= {_paths.chunk_path(d) for d in _committed.read_columns(store._storage, ref).chunk_digests()}
    return paths


def _stored(root: Path, *folders: str) -> set[str]:
    return {
        str(p.relative_to(root))
        for f in folders
        for p in (root / f).rglob("*")
        if p.is_file() and not p.name.startswith(".tmp-")
    }


class Background:
    """A loop in a thread, recording every unexpected exception."""

    def __init__(self, body: Any) -> None:
        self.stop = threading.Event()
        self.failures: list[str] = []
        self.body = body
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.body()
            except Exception:
                self.failures.append(traceback.format_exc())
            time.sleep(0.01)

    def join(self) -> list[str]:
        self.stop.set()
        self.thread.join(30)
        return self.failures


@pytest.mark.timeout(120)
def test_four_writers_with_gc_and_retention(tmp_path):
    root = tmp_path / "store"
    url = str(root)
    store = treestore.Store(url)
    go = tmp_path / "go"
    outs = [tmp_path / f"w{p}.log" for p in range(4)]
    manager_steps = {p: [2 * i + (p - 2) for i in range(SAVES)] for p in (2, 3)}  # 0..39, split
    jobs = [
        {"mode": "plain", "url": url, "index": p, "out": str(outs[p]), "go": str(go), "saves": SAVES}
        for p in (0, 1)
    ] + [
        {
            "mode": "manager",
            "url": url,
            "index": p,
            "out": str(outs[p]),
            "go": str(go),
            "steps": manager_steps[p],
        }
        for p in (2, 3)
    ]
    procs = [_start(job) for job in jobs]
    try:
        _wait_ready(outs, "ready", procs)
        go.touch()
        gc_runs = {"ok": 0, "busy": 0}

        def collect() -> None:
            try:
                store.gc(grace=0, wait=0.2)
                gc_runs["ok"] += 1
            except treestore.errors.StoreBusyError:
                gc_runs["busy"] += 1

        def read() -> None:
            """Load checkpoints that no one may delete while everything else goes on."""
            committed = [rest for out in outs[:2] for w, rest in read_events(out) if w == "committed"]
            kept = [n for n in committed if int(n.split("-")[1]) % 4 != 1]  # writers delete i % 4 == 1
            for name in kept[-3:]:
                assert_tree_equal(store.load(name), expected(name))

        gc_loop, reader = Background(collect), Background(read)
        for p in procs:
            p.wait(90)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    failures = [f"gc loop: {f}" for f in gc_loop.join()] + [f"reader: {f}" for f in reader.join()]
    evs = [read_events(o) for o in outs]
    failures += [
        f"writer {p}: {rest}".replace("\\n", "\n")
        for p, ev in enumerate(evs)
        for w, rest in ev
        if w == "error"
    ]
    failures += [
        f"writer {p} exited with {proc.returncode}" for p, proc in enumerate(procs) if proc.returncode
    ]
    assert not failures, "\n".join(failures)

    # What must exist: plain saves not deleted by their writer; manager steps that retention
    # never deletes (multiples of 5, and the three newest steps of all).
    committed = {rest for ev in evs for w, rest in ev if w == "committed"}
    deleted = {rest for ev in evs[:2] for w, rest in ev if w == "deleting"}
    steps = sorted(int(n.split("-")[1]) for n in committed if n.startswith("step-"))
    assert len(committed) == 4 * SAVES
    protected = {n for n in committed if n.startswith("w")} - deleted
    protected |= {f"step-{s:09d}" for s in steps if s % 5 == 0 or s in steps[-3:]}
    names = {c.name for c in store.list()}
    assert not protected - names, f"committed checkpoints lost: {sorted(protected - names)}"
    assert names <= committed, f"never committed: {sorted(names - committed)}"
    for name in sorted(names):
        assert_tree_equal(store.load(name), expected(name))
    report = treestore.verify(url)
    assert report.ok, report.problems
    print("gc during the writes:", gc_runs)
    assert gc_runs["ok"] + gc_runs["busy"] > 0

    store.gc(grace=0)  # quiescent now: exactly what the checkpoints reference stays
    assert _stored(root, "chunks", "manifests") == _referenced(store)
    assert not _stored(root, "locks"), "locks left behind by writers that finished"
    for name in sorted(names):
        assert_tree_equal(store.load(name), expected(name))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["local", "memory"])
def test_two_threads_racing_for_one_name(tmp_path, backend):
    url = str(tmp_path / "store") if backend == "local" else f"memory://race/{uuid.uuid4().hex}"
    for r in range(15):
        barrier = threading.Barrier(2)
        results: dict[int, Any] = {}

        def save(
            p: int, r: int = r, barrier: threading.Barrier = barrier, results: dict[int, Any] = results
        ) -> None:
            s = treestore.Store(url)
            barrier.wait()
            try:
                s.save(writer.make_tree(p, r), f"race-{r}", options=writer.options())
                results[p] = "won"
            except Exception as exc:
                results[p] = exc

        threads = [threading.Thread(target=save, args=(p,)) for p in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        winners = [p for p, v in results.items() if v == "won"]
        assert len(winners) == 1, f"round {r}: {results}"
        (loser,) = {0, 1} - set(winners)
        assert isinstance(results[loser], treestore.errors.CheckpointExistsError), results[loser]
        assert f"race-{r}" in str(results[loser])
        assert_tree_equal(treestore.load(url, f"race-{r}"), writer.make_tree(winners[0], r))


@pytest.mark.timeout(90)
def test_two_processes_racing_for_one_name(tmp_path):
    root = tmp_path / "store"
    rounds = 8
    outs = [tmp_path / f"r{p}.log" for p in (0, 1)]
    go = tmp_path / "go"
    procs = [
        _start(
            {
                "mode": "race",
                "url": str(root),
                "index": p,
                "out": str(outs[p]),
                "go": str(go),
                "rounds": rounds,
            }
        )
        for p in (0, 1)
    ]
    try:
        for r in range(rounds):
            _wait_ready(outs, f"ready {r}", procs)
            Path(f"{go}.{r}").touch()
        for p in procs:
            p.wait(60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    evs = [read_events(o) for o in outs]
    errors = [rest for ev in evs for w, rest in ev if w == "error"]
    assert not errors, errors[0].replace("\\n", "\n")
    for r in range(rounds):
        name = f"race-{r}"
        won = [p for p, ev in enumerate(evs) if ("won", name) in ev]
        lost = [rest for ev in evs for w, rest in ev if w == "lost" and rest.startswith(name + " ")]
        assert len(won) == 1 and lost == [f"{name} CheckpointExistsError"], (r, evs)
        assert_tree_equal(treestore.load(str(root), name), writer.make_tree(won[0], r))
    assert treestore.verify(str(root)).ok
