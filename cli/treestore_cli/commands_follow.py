"""Commands that follow a training run: ``watch`` (each new checkpoint as it is committed) and
``timeline`` (how much each leaf changed from one checkpoint to the next)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

import treestore

from . import render
from .commands_inspect import JSON, open_store, require_store
from .context import echo_json, note, plain, progress, settings


def _record(ckpt: treestore.Checkpoint) -> dict[str, Any]:
    return {
        "url": ckpt.url,
        "name": ckpt.name,
        "created": ckpt.created,
        "leaves": ckpt.num_leaves,
        "raw_bytes": ckpt.nbytes,
        "metadata": ckpt.metadata,
    }


@click.command("watch", short_help="Print each checkpoint of a store once it is committed.")
@click.argument("url")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0),
    default=None,
    metavar="SECONDS",
    help="Stop after this many seconds without a new checkpoint (default: watch until interrupted).",
)
@click.option(
    "--since",
    metavar="NAME",
    default=None,
    help="Only checkpoints committed after checkpoint NAME (default: the existing ones first).",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def watch(url: str, timeout: float | None, since: str | None, as_json: bool) -> int:
    """Print one line per checkpoint of the store at URL, in commit order, as each is committed
    (never a partial one): name, time, leaves, raw size and metadata. The store need not
    exist yet. A damaged checkpoint is skipped with a warning on stderr."""
    for ckpt in treestore.watch(
        url, since=since, timeout=timeout, storage_options=settings().storage_options
    ):
        r = _record(ckpt)
        if as_json:
            click.echo(json.dumps(plain(r), allow_nan=False))
            continue
        meta = "" if r["metadata"] is None else "  " + render.compact(r["metadata"])
        click.echo(
            f"{r['name']}  {render.when(r['created'])}  {r['leaves']} leaves  "
            f"{render.size(r['raw_bytes'])}{meta}"
        )
    return 0


@click.command("timeline", short_help="Show how much each leaf changed from checkpoint to checkpoint.")
@click.argument("url")
@click.argument("patterns", nargs=-1)
@click.option(
    "--select",
    "selected",
    multiple=True,
    metavar="PATTERN",
    help="Only leaves matching PATTERN (repeatable); the same as giving PATTERNS after URL.",
)
@click.option(
    "--depth",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Pool leaves by the first N segments of their addresses.",
)
@click.option(
    "--scale",
    type=click.Choice(["row", "global"]),
    default="row",
    show_default=True,
    help="Scale each row to its own largest change, or all rows to the largest of all.",
)
@click.option(
    "--html",
    "html_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    metavar="FILE",
    help="Also write a self-contained HTML page (heatmap, lines per group, every value).",
)
@click.option(
    "--norms",
    is_flag=True,
    help="Show each leaf's L2 norm at each checkpoint instead, from the statistics recorded at save "
    "(manifests only, no chunk read).",
)
@JSON
def timeline(
    url: str,
    patterns: tuple[str, ...],
    selected: tuple[str, ...],
    depth: int | None,
    scale: str,
    html_file: Path | None,
    norms: bool,
    as_json: bool,
) -> int:
    """For the checkpoints of the store at URL, oldest first, show the relative L2 change
    ||b - a|| / ||a|| of each array leaf matching PATTERNS (all without; or of each group, with
    --depth) from one checkpoint to the next: one row per leaf, one character per step, blank
    where unchanged, '·' where the leaf is absent. Only the chunks that changed are read.
    With --norms, each leaf's L2 norm at each checkpoint instead, '!' where it holds NaN/inf,
    from the statistics recorded at save: nothing but manifests is read. A damaged checkpoint
    is left out and named with its problem (``damaged`` with --json); the exit status is
    then 1."""
    patterns = patterns + selected
    store = open_store(url)
    require_store(store)
    if norms:
        if html_file is not None:
            raise click.UsageError("--html draws changes; it does not go with --norms")
        table = store.norms(select=patterns or None, depth=depth)
        if as_json:
            echo_json(table.to_json())
        else:
            click.echo(table.heatmap(scale=scale, ascii=not render.fancy()))
        return 1 if table.damaged else 0
    with progress("timeline") as bar:
        result = store.timeline(select=patterns or None, depth=depth, progress=bar)
    if html_file is not None:
        html_file.write_text(result.to_html(scale=scale), encoding="utf-8")
        note(f"wrote {html_file}")
    if as_json:
        echo_json(result.to_json())
    else:
        click.echo(result.heatmap(scale=scale, ascii=not render.fancy()))
    return 1 if result.damaged else 0
