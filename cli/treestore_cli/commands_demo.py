"""``treestore demo``: save, change, save, load and compare a small model, start to finish."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click
import numpy as np

import treestore

from . import render
from .commands_inspect import leaf_record, open_store, show_lines

FOLDERS = {"checkpoints", "chunks", "manifests", "locks"}
NOTE = "treestore demo"  # in the metadata of every checkpoint the demo saves
WIDTH = 512  # a 512x512 float32 layer is 1 MiB: four chunks of 256 KiB
CHUNK_SIZE = 256 * 1024


def params(step: int) -> dict[str, Any]:
    """An MLP-like tree: four dense layers, a step counter. Step 2 fine-tunes layer 2 only."""
    rng = np.random.default_rng(0)
    layers = [
        {
            "w": (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32),
            "b": (rng.standard_normal(WIDTH) * 0.1).astype(np.float32),
        }
        for _ in range(4)
    ]
    if step >= 2:
        update = np.random.default_rng(step).standard_normal((WIDTH, WIDTH)).astype(np.float32)
        layers[2]["w"] = layers[2]["w"] + np.float32(1e-3) * update
        layers[2]["b"] = layers[2]["b"] + np.float32(1e-3) * update[0]
    return {"params": {"layers": layers}, "step": np.int64(step)}


def same(a: Any, b: Any) -> bool:
    """Equal trees, leaf bytes and dtypes included."""
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    x, y = np.asarray(a), np.asarray(b)
    return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


def fresh_store(folder: Path) -> treestore.Store:
    """The demo store at ``folder``, emptied of an earlier demo's checkpoints and chunks; refuses a
    folder that holds anything else, a store with checkpoints the demo did not save included."""
    if folder.exists():
        if not folder.is_dir():
            raise treestore.InvalidInputError(f"{folder} is a file, not a folder for the demo store")
        other = sorted(p.name for p in folder.iterdir() if p.name not in FOLDERS)
        if other:
            raise treestore.InvalidInputError(
                f"{folder} is not empty and not a treestore store (it holds {', '.join(other[:3])}); "
                "give the demo a new folder: treestore demo DIR"
            )
    store = open_store(os.fspath(folder))
    infos = store.list(damaged=True)
    theirs = [i.name for i in infos if i.problem is not None or not _demo_metadata(i.metadata)]
    if theirs:
        raise treestore.InvalidInputError(
            f"{folder} is a treestore store with {len(theirs)} checkpoint(s) the demo did not save "
            f"({', '.join(theirs[:3])}{', ...' if len(theirs) > 3 else ''}); the demo deletes only its "
            "own: give it another folder: treestore demo DIR"
        )
    for info in infos:
        store.delete(info.name)
    store.gc(grace=0)
    return store


def _demo_metadata(metadata: Any) -> bool:
    return isinstance(metadata, dict) and metadata.get("note") == NOTE


def saved_line(label: str, r: treestore.types.SaveResult) -> str:
    return (
        f"saved {label}: {r.leaves} leaves, {render.size(r.nbytes)}; wrote {r.chunks_written} chunk(s) "
        f"({render.size(r.bytes_written)}), reused {r.chunks_reused}"
    )


@click.command("demo")
@click.argument("folder", metavar="[DIR]", default="treestore-demo", type=click.Path(file_okay=False))
def demo(folder: str) -> int:
    """Run a short demonstration in a local store at DIR (default ./treestore-demo): save a small
    model as step-1, change one layer and save step-2 (only the changed chunks are written), load
    step-2 back and check it bit for bit, then show and diff the two steps. Running it again
    replaces the demo's own two checkpoints; a folder holding anything else (another store's
    checkpoints included) is refused and left as it is."""
    store = fresh_store(Path(folder))
    url = store.url
    meta = {"model": "mlp-4x512", "note": NOTE}
    options = treestore.SaveOptions(chunk_size=CHUNK_SIZE)
    first = store.save(params(1), "step-1", metadata={**meta, "step": 1}, options=options)
    click.echo(saved_line("step-1", first))
    second = store.save(params(2), "step-2", metadata={**meta, "step": 2}, options=options)
    click.echo(saved_line("step-2", second) + "  <- only layer 2 changed")
    loaded = store.load("step-2")
    if not same(loaded, params(2)):
        raise treestore.DamagedError("step-2 did not load back bit-exactly")
    click.echo("loaded step-2 back: bit-exact")
    click.echo(f"\n$ treestore show {url}#step-2")
    ckpt = store.open("step-2")
    for line in show_lines(ckpt, [leaf_record(ckpt, a) for a in ckpt.leaves]):
        click.echo(line)
    click.echo(f"\n$ treestore diff {url}#step-1 {url}#step-2 --values")
    d = treestore.diff(store.open("step-1"), ckpt, values=True)
    click.echo(d.table(ascii=not render.fancy()))
    click.echo(
        f"\ndemo ok: 2 checkpoints in {url}; step-2 wrote {second.chunks_written} of "
        f"{second.chunks_written + second.chunks_reused} chunks; "
        f"{render.size(first.bytes_written + second.bytes_written)} stored for "
        f"{render.size(first.nbytes + second.nbytes)} of arrays; next: treestore ls {url}"
    )
    return 0
