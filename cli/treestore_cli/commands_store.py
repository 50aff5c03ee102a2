"""Commands that check or change stores: ``verify``, ``gc``, ``rm`` and ``cp``."""

from __future__ import annotations

from dataclasses import asdict

import click

import treestore

from . import render
from .commands_inspect import JSON, open_store, require_store
from .context import echo_json, note, parse_option, progress, settings


@click.command("verify", short_help="Check every digest of a store (exit 0 ok, 1 problems).")
@click.argument("spec", metavar="URL[#NAME]")
@click.option(
    "--repair-from",
    metavar="URL",
    help="Another store holding the same data (the remote tier, a backup): rewrite each missing or "
    "damaged chunk from its intact copy there, then verify again.",
)
@JSON
def verify(spec: str, repair_from: str | None, as_json: bool) -> int:
    """Re-read and check every commit record, manifest and chunk digest of a store (URL: every
    checkpoint) or of one checkpoint (URL#NAME). Every problem is reported with its checkpoint
    and address. Exit status 0 when all is well (after repairs, with --repair-from), 1 when
    problems remain, 2 on error."""
    options = settings().storage_options
    with progress("verify") as bar:
        report = treestore.verify(
            spec,
            storage_options=options,
            progress=bar,
            repair_from=repair_from,
            repair_storage_options=options,
        )
    if as_json:
        echo_json(report.to_json())
    else:
        n = len(report.checkpoints)
        click.echo(
            f"checked {n} checkpoint{'s' if n != 1 else ''} of {report.url}: {report.chunks_checked} "
            f"chunks, {render.size(report.bytes_checked)}"
        )
        if report.repaired:
            click.echo(f"repaired {len(report.repaired)} chunk(s) from {repair_from}")
        if report.ok:
            click.echo("ok: every digest matches")
        else:
            rows = [[p.kind, p.message] for p in report.problems]
            for line in render.table(["problem", "where and what"], rows):
                click.echo(line)
            bad = len({p.checkpoint for p in report.problems})
            click.echo(f"{len(report.problems)} problem(s) in {bad} checkpoint(s)")
    return 0 if report.ok else 1


@click.command("gc", short_help="Remove chunks no checkpoint references.")
@click.argument("url")
@click.option("--dry-run", is_flag=True, help="Report what would be removed, remove nothing.")
@click.option(
    "--grace",
    type=click.FloatRange(min=0),
    default=600.0,
    show_default=True,
    metavar="SECONDS",
    help="Keep unreferenced chunks younger than this: they may belong to a save still running.",
)
@click.option(
    "--wait",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    metavar="SECONDS",
    help="Wait this long for saves in flight to finish before giving up.",
)
@JSON
def gc(url: str, dry_run: bool, grace: float, wait: float, as_json: bool) -> int:
    """Remove the chunks and manifests no checkpoint of the store at URL references, and report
    the bytes freed. Safe while saves run: gc defers to a save in flight, and keeps chunks younger
    than the grace period."""
    store = open_store(url)
    require_store(store)
    report = store.gc(grace=grace, dry_run=dry_run, wait=wait)
    if as_json:
        echo_json(asdict(report))
        return 0
    verb = "would remove" if report.dry_run else "removed"
    click.echo(
        f"{verb} {report.chunks_removed} chunk(s) and {report.manifests_removed} manifest(s): "
        f"{render.size(report.bytes_freed)} {'would be ' if report.dry_run else ''}freed"
    )
    if report.locks_removed:
        click.echo(f"{verb} {report.locks_removed} stale lock(s)")
    if report.kept_young:
        click.echo(
            f"kept {report.kept_young} unreferenced chunk(s) younger than {grace:g} s (they may belong "
            "to a save still running); when none runs, `--grace 0` removes them now"
        )
    if report.damaged:
        names = ", ".join(report.damaged)
        click.echo(
            f"kept every chunk and manifest: {len(report.damaged)} damaged checkpoint(s) ({names}) may "
            "reference them; `treestore verify` says what is wrong, `treestore rm` removes them"
        )
    return 0


@click.command("rm", short_help="Remove checkpoints.")
@click.argument("specs", metavar="URL#NAME...", nargs=-1, required=True)
@JSON
def rm(specs: tuple[str, ...], as_json: bool) -> int:
    """Remove checkpoints (their commit records). Their chunks stay until `treestore gc URL`
    frees those no other checkpoint uses."""
    removed = []
    for spec in specs:
        store, name = treestore.Store.split(spec, storage_options=settings().storage_options)
        if name is None:
            raise click.BadParameter(f"name the checkpoint to remove: {spec}#NAME", param_hint="URL#NAME")
        store.delete(name)
        removed.append({"url": store.url, "name": name})
    if as_json:
        echo_json({"removed": removed})
    else:
        for r in removed:
            click.echo(f"removed {r['url']}#{r['name']}")
        note("run `treestore gc URL` to free the chunks no other checkpoint uses")
    return 0


@click.command("cp", short_help="Copy checkpoints between stores and backends.")
@click.argument("src", metavar="SRC[#NAME]")
@click.argument("dst", metavar="DST[#NAME]")
@click.option("--all", "all_checkpoints", is_flag=True, help="Copy every checkpoint of the SRC store.")
@click.option(
    "--overwrite", is_flag=True, help="Replace a checkpoint of that name with other contents at DST."
)
@click.option(
    "-O",
    "--dst-option",
    "dst_options",
    multiple=True,
    metavar="KEY=VALUE",
    help="fsspec storage option for DST only (default: those given with -o).",
)
@JSON
def cp(
    src: str, dst: str, all_checkpoints: bool, overwrite: bool, dst_options: tuple[str, ...], as_json: bool
) -> int:
    """Copy a checkpoint (the newest when SRC has no #NAME; every one with --all) into the store
    DST, on any filesystem, transferring only the chunks DST lacks. Each chunk is checked against
    its digest before it is written. DST#NAME renames the copy."""
    dst_storage = dict(parse_option(o) for o in dst_options) if dst_options else None
    with progress("cp") as bar:
        report = treestore.copy(
            src,
            dst,
            all_checkpoints=all_checkpoints,
            overwrite=overwrite,
            storage_options=settings().storage_options,
            dst_storage_options=dst_storage,
            progress=bar,
        )
    if as_json:
        echo_json(asdict(report))
        return 0
    for name in report.copied:
        click.echo(f"copied {name} to {report.dst}")
    for name in report.unchanged:
        click.echo(f"{name} is already in {report.dst} with the same contents")
    click.echo(
        f"{report.chunks_copied} chunk(s) transferred ({render.size(report.bytes_copied)}), "
        f"{report.chunks_present} already there"
    )
    return 0
