"""A store to attack: a pristine template saved once per session, copied fresh for each test.

The store holds two checkpoints of the same structure, ``good`` and the newer ``bad`` (the one the
tests damage), with every kind of leaf: chunked float and int arrays (byte-plane and zstd codecs),
packed small arrays, bfloat16, a numpy scalar, a jax array, a typed PRNG key, Python scalars of
every kind, None, nested lists and tuples and an empty array; with four or more jax devices also a
sharded array (saved in pieces).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import msgpack
import numpy as np
import pytest

import treestore
from treestore._format import paths as _paths

from ..support import hostile
from ._harness import check_readers

KiB = 1024
OPTIONS = treestore.SaveOptions(chunk_size=64 * KiB, small_leaf=16 * KiB, threads=4)


def make_tree(v: int) -> dict[str, Any]:
    rng = np.random.default_rng(5 + v)
    tree: dict[str, Any] = {
        "w": (rng.standard_normal((256, 128)) * 0.02 + v).astype(np.float32),  # 2 chunks, planes
        "ids": np.arange(40_000, dtype=np.int32) + v,  # 160 KiB: 3 chunks, zstd
        "small": {
            "a": np.arange(5, dtype=np.int64) + v,
            "bf": np.full(3, v, ml_dtypes.bfloat16),
            "s": np.float32(v),
        },
        "j": jnp.full(4, float(v)),
        "key": jax.random.key(v),
        "py": {"n": 3 + v, "f": 1.5, "s": "x", "b": b"y", "c": 1j, "t": True, "big": 2**80 + v},
        "list": [np.zeros(2) + v, None, (1, 2)],
        "empty": np.zeros((0, 4)),
    }
    if len(jax.devices()) >= 4:
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
        spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
        tree["sharded"] = jax.device_put(jnp.arange(64.0).reshape(8, 8) + v, spec)
    return tree


@pytest.fixture(scope="session")
def template(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("attack-template") / "store"
    store = treestore.Store(str(root))
    store.save(make_tree(1), "good", metadata={"v": 1}, options=OPTIONS)
    store.save(make_tree(0), "bad", metadata={"v": 0}, options=OPTIONS)
    # Warm up every reader path (lazy imports inside jax and numpy happen here, not under guard),
    # then make sure the pristine store passes every guard.
    for name in ("good", "bad"):
        store.load(name)
        _ = treestore.open(str(root), name).tree
    check_readers(str(root))
    return root


@dataclass
class HostileStore:
    """A fresh copy of the template store, and tools to lie in it."""

    root: Path
    outside: Path  # a folder next to the store that nothing may touch

    @property
    def url(self) -> str:
        return str(self.root)

    @property
    def storage(self) -> Any:
        return hostile.storage(self.url)

    def check(self, name: str = "bad", **kw: Any) -> dict[str, Any]:
        """Run every reader operation under the guards (see _harness.check_readers)."""
        out = check_readers(self.url, name, root=self.root, **kw)
        assert self.untouched(), "a file outside the store changed"
        return out

    def untouched(self) -> bool:
        return sorted(p.name for p in self.outside.iterdir()) == ["secret.txt"] and (
            (self.outside / "secret.txt").read_text() == "secret"
        )

    # -- manifests and commit records ---------------------------------------------------------
    def manifest_record(self, name: str = "bad") -> dict[str, Any]:
        return hostile.manifest_record(self.url, name)

    def ref_record(self, name: str = "bad") -> dict[str, Any]:
        return hostile.commit_record(self.url, name)

    def ref_bytes(self, name: str = "bad") -> bytes:
        return (self.root / _paths.record_path(name)).read_bytes()

    def write_manifest(
        self, manifest: Any, name: str = "bad", *, raw: bytes | None = None, **ref: Any
    ) -> None:
        """Replace the manifest, keeping the commit record consistent with it."""
        hostile.write_manifest(self.url, name, manifest, raw=raw, **ref)

    def mutate_manifest(self, change: Callable[[dict[str, Any]], Any], name: str = "bad") -> None:
        hostile.mutate_manifest(self.url, name, change)

    def write_ref(self, record: Any = None, name: str = "bad", *, raw: bytes | None = None) -> None:
        """Write a commit record: ``raw`` bytes as they are, or ``record`` with a consistent check
        digest (a hostile store can compute one; the tests then reach the checks behind it)."""
        if raw is None and isinstance(record, dict):
            try:
                hostile.write_commit_record(self.url, name, record)
                return
            except (TypeError, ValueError, OverflowError):  # fields msgpack cannot hold
                pass
        data = raw if raw is not None else msgpack.packb(record, use_bin_type=True)
        (self.root / _paths.record_path(name)).write_bytes(data)

    def leaf(self, address: str, name: str = "bad") -> Any:
        return next(e for e in treestore.Store(self.url).manifest(name).leaves if e.address == address)

    def chunk_file(self, address: str, index: int = 0, name: str = "bad") -> Path:
        """The object of a leaf's chunk (its pack, for a packed leaf)."""
        m = treestore.Store(self.url).manifest(name)
        entry = next(e for e in m.leaves if e.address == address)
        c = entry.chunks[index]
        d = m.packs[c.pack].digest if c.pack is not None else c.digest
        return self.root / _paths.chunk_path(d)


@pytest.fixture
def store(template, tmp_path) -> HostileStore:
    root = tmp_path / "store"
    shutil.copytree(template, root)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret")
    (tmp_path / "store-evil").mkdir()  # a sibling whose name starts like the store's
    (tmp_path / "store-evil" / "secret.txt").write_text("secret")
    return HostileStore(root, outside)
