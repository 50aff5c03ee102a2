"""``derive``: a new checkpoint from an existing one, with subtrees dropped, renamed or set from a
file, writing only the new leaves' chunks."""

from __future__ import annotations

import uuid
from dataclasses import asdict
from typing import Any

import click

import treestore

from . import render
from .commands_inspect import JSON
from .context import echo_json, settings


def _pair(text: str, what: str) -> tuple[str, str]:
    left, sep, right = text.partition("=")
    if not sep or not right:
        raise click.BadParameter(f"expected {what}, got {text!r}")
    return left, right


def _read_tree(path: str) -> Any:
    """The tree of a .safetensors/.npz/.msgpack file or orbax folder, nested as import does:
    imported into a private in-memory store, loaded, and removed again."""
    url = f"memory://treestore-cli-derive/{uuid.uuid4().hex}"
    treestore.import_file(path, f"{url}#set")
    store = treestore.Store(url)
    tree = store.load("set")
    store.delete("set")
    store.gc(grace=0)
    return tree


@click.command("derive", short_help="Derive a checkpoint: drop, rename or set subtrees, no rewrite.")
@click.argument("base", metavar="URL#BASE")
@click.argument("new", metavar="NEWNAME")
@click.option(
    "--drop", "drops", multiple=True, metavar="PATTERN", help="Drop the leaves and subtrees matching PATTERN."
)
@click.option(
    "--rename", "renames", multiple=True, metavar="OLD=NEW", help="Move every address under OLD under NEW."
)
@click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="ADDRESS=FILE",
    help="Put the tensors of FILE (.safetensors, .npz, flax .msgpack) at ADDRESS, nested as `import` does.",
)
@click.option("--overwrite", is_flag=True, help="Replace checkpoint NEWNAME if it exists.")
@JSON
def derive(
    base: str,
    new: str,
    drops: tuple[str, ...],
    renames: tuple[str, ...],
    sets: tuple[str, ...],
    overwrite: bool,
    as_json: bool,
) -> int:
    """Commit checkpoint NEWNAME in the store of URL#BASE: BASE with the subtrees matching each
    --drop removed, then each --rename applied, then each --set in place. Only the chunks of the
    new leaves are written, and a new manifest; everything else is shared with BASE, not read."""
    store, name = treestore.Store.split(base, storage_options=settings().storage_options)
    if name is None:
        raise click.BadParameter(f"name the base checkpoint: {base}#BASE", param_hint="URL#BASE")
    rename = dict(_pair(r, "OLD=NEW") for r in renames)
    subtrees = {address: _read_tree(path) for address, path in (_pair(s, "ADDRESS=FILE") for s in sets)}
    result = store.derive(
        name, new, set=subtrees or None, drop=list(drops) or None, rename=rename or None, overwrite=overwrite
    )
    if as_json:
        echo_json({"url": store.url, "base": name, **asdict(result)})
        return 0
    click.echo(
        f"derived {store.url}#{result.name} from {name}: {result.leaves} leaves, "
        f"{render.size(result.nbytes)} raw; {result.chunks_written} chunk(s) written "
        f"({render.size(result.bytes_written)})"
    )
    return 0
