"""Import and export of other formats: ``import`` and ``export``."""

from __future__ import annotations

import json
from dataclasses import asdict

import click

import treestore

from . import render
from .commands_inspect import JSON
from .context import echo_json, progress, settings

FORMAT = click.option(
    "--format",
    "fmt",
    type=click.Choice(["safetensors", "npz", "msgpack", "orbax"]),
    help="The file's format (default: from its suffix; a folder is an orbax checkpoint).",
)


@click.command("import", short_help="Import a .safetensors/.npz/.msgpack file, orbax or HF folder.")
@click.argument("file", metavar="FILE")
@click.argument("dst", metavar="URL#NAME")
@FORMAT
@click.option("--flat", is_flag=True, help="Keep keys as they are instead of nesting them at '.' and '/'.")
@click.option("--metadata", "metadata", metavar="JSON", help="User metadata to store with the checkpoint.")
@click.option("--overwrite", is_flag=True, help="Replace a checkpoint of that name.")
@JSON
def import_(
    file: str, dst: str, fmt: str | None, flat: bool, metadata: str | None, overwrite: bool, as_json: bool
) -> int:
    """Import a .safetensors, .npz or flax .msgpack FILE, or an orbax checkpoint folder, as
    checkpoint URL#NAME (NAME defaults to the file's stem). Keys with dots or slashes
    ('encoder.layer.0.w') become nested addresses (encoder/layer/"0"/w); `treestore export`
    joins them back, so a safetensors file comes back bit-exact.

    An orbax CheckpointManager step folder (mgr/5 or mgr/5/default) becomes step-000000005,
    its step and metrics kept in the metadata; the manager's folder (mgr) imports its newest
    step. To import every step: for d in mgr/*/; do treestore import "$d" URL; done

    A Hugging Face shard set is imported from its folder (the one holding
    model.safetensors.index.json, such as a Hub download) or from the index file; the whole
    shard set is checked before anything is saved.

    FILE may be an fsspec URL (s3://bucket/model, https://...) of a file or of a shard
    set: it is copied to a temporary folder first; -o options apply to it and to URL."""
    meta = None
    if metadata is not None:
        try:
            meta = json.loads(metadata)
        except ValueError as exc:
            raise click.BadParameter(f"not JSON: {exc}", param_hint="--metadata") from None
    with progress("import") as bar:
        result = treestore.import_file(
            file,
            dst,
            format=fmt,
            nest_keys=not flat,
            metadata=meta,
            overwrite=overwrite,
            storage_options=settings().storage_options,
            progress=bar,
            source_storage_options=settings().storage_options,
        )
    url = treestore.Store.split(dst, storage_options=settings().storage_options)[0].url
    if as_json:
        echo_json({"file": file, "url": url, **asdict(result)})
        return 0
    click.echo(
        f"imported {file} as {url}#{result.name}: {result.leaves} leaves, {render.size(result.nbytes)}; "
        f"{result.chunks_written} chunk(s) written ({render.size(result.bytes_written)}), "
        f"{result.chunks_reused} reused"
    )
    return 0


@click.command("export", short_help="Export a checkpoint as .safetensors/.npz/.msgpack or orbax.")
@click.argument("src", metavar="URL[#NAME]")
@click.argument("file", type=click.Path(), metavar="FILE")
@FORMAT
@click.option(
    "--separator",
    type=click.Choice([".", "/"]),
    help="Joins key paths into key names (default: the one found on import, else '.').",
)
@click.option(
    "--max-shard-size",
    metavar="SIZE",
    help="Write Hugging Face's shard set: shards of at most SIZE bytes of "
    "tensors (e.g. 5GB, 500MB; decimal units). A FOLDER/ with --format safetensors gets 5GB.",
)
@click.option("--overwrite", is_flag=True, help="Replace FILE if it exists.")
@JSON
def export(
    src: str,
    file: str,
    fmt: str | None,
    separator: str | None,
    max_shard_size: str | None,
    overwrite: bool,
    as_json: bool,
) -> int:
    """Export a checkpoint (the newest when no #NAME) as a .safetensors, .npz or flax .msgpack
    FILE, or as an orbax checkpoint folder (--format orbax, or FILE an existing folder) that
    orbax's StandardCheckpointer restores. Every leaf must be an array (msgpack also holds Python
    scalars, orbax Python int, float and bool) under dict keys or list indices; one error lists
    every leaf that cannot be written.

    Hugging Face's shard set (model-00001-of-0000N.safetensors + model.safetensors.index.json, or
    one model.safetensors when the tensors fit in one shard): give a FOLDER/ and
    --max-shard-size, or --format safetensors for 5GB shards."""
    with progress("export") as bar:
        result = treestore.export_file(
            src,
            file,
            format=fmt,
            separator=separator,
            overwrite=overwrite,
            storage_options=settings().storage_options,
            progress=bar,
            max_shard_size=_size(max_shard_size),
        )
    if as_json:
        echo_json(asdict(result))
        return 0
    size = render.size(result.nbytes)
    shards = f" in {result.shards} shards" if result.shards > 1 else ""
    click.echo(f"exported {src} to {result.path} ({result.format}): {result.tensors} tensors, {size}{shards}")
    return 0


def _size(text: str | None) -> int | str | None:
    """--max-shard-size as export_file takes it: plain digits are bytes."""
    return int(text) if text is not None and text.isascii() and text.isdigit() and len(text) <= 20 else text
