"""Damage is detected: 1,000 random single-byte changes and truncations of stored objects.

Each trial damages one object of a small store (a chunk, a pack, a manifest or a commit record),
then, for every checkpoint that depends on it:

- ``load`` raises a TreestoreError subclass that names the checkpoint (and, for a chunk, one of
  the addresses stored in it), or returns exactly the tree that was saved;
- ``verify`` reports a problem naming the checkpoint (and, for a chunk, the address);
- ``list`` raises a TreestoreError naming the checkpoint, leaves the damaged one out, or lists
  exactly what it listed before.

Nothing else may escape, and every damage must be detected by load or verify: an object whose
bytes changed but that reads as before is a byte no digest covers. The one exception is a changed
byte inside a zstd frame that still decodes to exactly the saved bytes (zstd has a few don't-care
bits; chunks are named by the digest of their raw bytes, so nothing covers the compressed ones):
such a change is harmless and counted, not failed. The object is restored after each trial.
"""

from __future__ import annotations

import collections
import random
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import treestore
from tests.support.helpers import assert_tree_equal
from treestore._engine.reading import committed as _committed
from treestore._format import paths as _paths
from treestore._format.manifest.record_views import Manifest

pytestmark = [pytest.mark.slow]

TRIALS = 1000
SEED = 8
KiB = 1024


def trees() -> dict[str, Any]:
    rng = np.random.default_rng(SEED)
    w = (rng.standard_normal((256, 256)) * 0.02).astype(np.float32)  # 256 KiB: byte planes
    w2 = w.copy()
    w2[200:] += 1.0  # "b" shares w's first three chunks
    common = {
        "i": np.arange(16 * KiB, dtype=np.int64),  # 128 KiB of compressible ints: zstd
        "r": rng.integers(0, 256, 100 * KiB, dtype=np.uint8),  # incompressible: raw
        "small": {
            "bias": np.linspace(0, 1, 50, dtype=np.float32),
            "ids": np.arange(30, dtype=np.int16),
            "half": np.ones((4, 4), np.float16),
        },
        "py": {"n": 7, "x": 0.5, "s": "text", "b": b"\x00\x01", "z": 1 + 2j, "big": 2**70, "t": True},
        "none": None,
        "empty": np.zeros((0, 3), np.float32),
    }
    return {
        "a": {"w": w, **common},
        "b": {"w": w2, **common, "extra": np.arange(5.0)},
        "c": {"only": [1, 2.5, "scalars"]},
    }


@dataclass
class Users:
    """Who depends on a stored object: (checkpoint, address or None for the whole checkpoint)."""

    kind: str  # "chunk", "manifest" or "record"
    users: list[tuple[str, str | None]]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> tuple[str, dict[str, Any], dict[str, Users], list[Any]]:
    root = tmp_path_factory.mktemp("corruption") / "store"
    url = str(root)
    s = treestore.Store(url)
    opts = treestore.SaveOptions(chunk_size=64 * KiB, small_leaf=16 * KiB, threads=4)
    for name, tree in trees().items():
        s.save(tree, name, metadata={"name": name, "steps": [1, 2]}, options=opts)
    saved = {name: s.load(name) for name in trees()}
    objects: dict[str, Users] = {}
    for name in trees():
        ref = _committed.read_commit_record(s._storage, name)
        objects[_paths.record_path(name)] = Users("record", [(name, None)])
        objects.setdefault(_paths.manifest_path(ref.manifest), Users("manifest", [])).users.append(
            (name, None)
        )
        m = Manifest(_committed.read_columns(s._storage, ref))
        for leaf in m.leaves:
            for c in leaf.chunks:
                d = m.packs[c.pack].digest if c.pack is not None else c.digest
                objects.setdefault(_paths.chunk_path(d), Users("chunk", [])).users.append(
                    (name, leaf.address)
                )
    listed = s.list()
    return url, saved, objects, listed


def _damage(data: bytes, rng: random.Random, kind: str) -> tuple[bytes, str, int | None]:
    if rng.random() < 0.3:
        keep = rng.randrange(len(data))
        return data[:keep], f"truncated to {keep} of {len(data)} bytes", None
    if kind == "chunk" and rng.random() < 0.25:
        at = rng.randrange(min(16, len(data)))  # the chunk header: magic, codec, width, mask, size
    elif kind == "chunk" and rng.random() < 0.2:
        at = rng.randrange(16, min(64, len(data)))  # the start of the body (zstd frame header)
    else:
        at = rng.randrange(len(data))
    new = rng.choice([b for b in range(256) if b != data[at]])
    damaged = data[:at] + bytes([new]) + data[at + 1 :]
    return damaged, f"byte {at} of {len(data)}: {data[at]:#04x} -> {new:#04x}", at


def _in_zstd_frame(chunk: bytes, at: int) -> bool:
    """Whether byte ``at`` of a chunk object lies inside a zstd frame (SPEC.md section 4)."""
    codec, width, mask = chunk[4], chunk[5], int.from_bytes(chunk[6:8], "little")
    if codec == 1:
        return at >= 16
    if codec == 2:
        pos = 16 + 8 * width
        for j, n in enumerate(struct.unpack_from(f"<{width}Q", chunk, 16)):
            if pos <= at < pos + n:
                return bool(mask >> j & 1)
            pos += n
    return False


def _named(exc: treestore.TreestoreError, name: str, addresses: set[str], kind: str) -> str | None:
    """Why ``exc`` fails to name the checkpoint (and the address, for chunk damage), or None."""
    if exc.checkpoint != name or repr(name) not in str(exc):
        return f"does not name checkpoint {name!r}: checkpoint={exc.checkpoint!r}, {exc}"
    if kind == "chunk" and (exc.address not in addresses or (exc.address and exc.address not in str(exc))):
        return f"does not name one of the addresses {sorted(addresses)}: address={exc.address!r}, {exc}"
    return None


def _trial(url: str, saved: dict[str, Any], listed: list[Any], target: Users) -> tuple[list[str], bool]:
    """Check every dependent checkpoint of the damaged object; (problems, detected)."""
    problems: list[str] = []
    detected = False
    by_name: dict[str, set[str]] = collections.defaultdict(set)
    for name, address in target.users:
        if address is not None:
            by_name[name].add(address)
        else:
            by_name.setdefault(name, set())
    store = treestore.Store(url)
    for name, addresses in by_name.items():
        try:
            got = store.load(name)
        except treestore.TreestoreError as exc:
            detected = True
            why = _named(exc, name, addresses, target.kind)
            if why:
                problems.append(f"load {type(exc).__name__} {why}")
        except Exception as exc:
            problems.append(f"load of {name!r} raised {type(exc).__name__}: {exc}")
        else:
            try:
                assert_tree_equal(got, saved[name])
            except AssertionError as exc:
                problems.append(f"load of {name!r} returned wrong data: {exc}")
        try:
            report = treestore.verify(f"{url}#{name}", threads=1)
        except treestore.TreestoreError as exc:  # an unreadable commit record of a named checkpoint
            detected = True
            why = _named(exc, name, addresses, "record")
            if why:
                problems.append(f"verify raised {type(exc).__name__} that {why}")
        except Exception as exc:
            problems.append(f"verify of {name!r} raised {type(exc).__name__}: {exc}")
        else:
            mine = [p for p in report.problems if p.checkpoint == name]
            detected = detected or bool(mine)
            if target.kind == "chunk" and mine and not any(p.address in addresses for p in mine):
                problems.append(f"verify does not name the address: {[p.message for p in mine]}")
    if target.kind == "record":
        try:
            now = store.list()
        except treestore.TreestoreError as exc:
            why = _named(exc, target.users[0][0], set(), "record")
            if why:
                problems.append(f"list {type(exc).__name__} {why}")
        except Exception as exc:
            problems.append(f"list raised {type(exc).__name__}: {exc}")
        else:
            damaged = target.users[0][0]
            if now == [c for c in listed if c.name != damaged]:
                detected = True  # the damaged checkpoint is left out (and named in a warning)
            elif now != listed:
                old = {c.name: c for c in listed}
                diff = [f"{c.name}: {c} (was {old.get(c.name)})" for c in now if c != old.get(c.name)]
                problems.append(f"list() shows changed information: {diff}")
    return problems, detected


@pytest.mark.timeout(240)
def test_random_single_byte_damage_is_always_detected(store):
    url, saved, objects, listed = store
    rng = random.Random(SEED)
    by_kind: dict[str, list[str]] = collections.defaultdict(list)

    def order(item: tuple[str, Users]) -> tuple[Any, ...]:  # does not depend on save times
        return ([(n, a or "") for n, a in item[1].users], item[0])

    for path, users in sorted(objects.items(), key=order):
        by_kind[users.kind].append(path)
    assert {k: len(v) >= 1 for k, v in by_kind.items()} == {"chunk": True, "manifest": True, "record": True}
    failures: list[str] = []
    counts: collections.Counter[str] = collections.Counter()
    root = Path(url)
    for trial in range(TRIALS):
        kind = rng.choices(["chunk", "manifest", "record"], weights=[2, 1, 1])[0]
        path = rng.choice(by_kind[kind])
        full = root / path
        original = full.read_bytes()
        damaged, what, at = _damage(original, rng, kind)
        full.write_bytes(damaged)
        try:
            problems, detected = _trial(url, saved, listed, objects[path])
        finally:
            full.write_bytes(original)
        if detected:
            counts[f"{kind} detected"] += 1
        elif kind == "chunk" and at is not None and _in_zstd_frame(original, at) and not problems:
            counts["chunk: harmless change inside a zstd frame"] += 1
        else:
            counts[f"{kind} undetected"] += 1
            problems.append("undetected: load returned the saved tree and verify found nothing")
        failures += [f"trial {trial}: {path} {what}: {p}" for p in problems]
    print(dict(counts))
    assert not failures, f"{len(failures)} problems in {TRIALS} trials ({dict(counts)}):\n" + "\n".join(
        failures[:60]
    )
