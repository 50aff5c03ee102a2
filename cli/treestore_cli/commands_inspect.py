"""Reading commands: ``ls``, ``show`` and ``diff``."""

from __future__ import annotations

from collections import Counter
from typing import Any

import click

import treestore

from . import render
from .context import echo_json, progress, settings

JSON = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")


def open_store(url: str) -> treestore.Store:
    return treestore.Store(url, storage_options=settings().storage_options)


def require_store(store: treestore.Store) -> None:
    """Raise NotFoundError unless a store exists at ``store.url`` (so a mistyped URL is an error,
    not an empty store)."""
    if not store.is_store():
        raise treestore.NotFoundError(f"no treestore store at {store.url}")


def open_checkpoint(spec: str) -> treestore.Checkpoint:
    return treestore.open(spec, storage_options=settings().storage_options)


# --- ls -------------------------------------------------------------------------------------------
@click.command("ls", short_help="List the checkpoints of a store (exit 1 if one is damaged).")
@click.argument("url")
@JSON
def ls(url: str, as_json: bool) -> int:
    """List the checkpoints of the store at URL: name, time, leaf count, raw size, stored
    size (its chunk objects), bytes shared with other checkpoints, and metadata. A checkpoint
    whose commit record or manifest cannot be read is still listed, with the problem (its
    ``problem`` field with --json); the exit status is then 1."""
    store = open_store(url)
    infos = store.list(damaged=True)
    if not infos:
        require_store(store)
    objects: dict[str, dict[bytes, int]] = {}
    problems: dict[str, str] = {}
    nonfinite: dict[str, list[str]] = {}  # the leaves whose recorded statistics say NaN/inf
    for i in infos:
        if i.problem is not None:  # its commit record: nothing it would say is known
            objects[i.name], problems[i.name] = {}, i.problem
            continue
        try:
            ckpt = store.open(i.name)
            nonfinite[i.name] = ckpt.nonfinite()
            objects[i.name] = ckpt.chunk_objects()
        except treestore.errors.CheckpointNotFoundError:
            objects[i.name] = {}  # deleted since the listing: it has no chunks of its own
        except (treestore.DamagedError, treestore.UnsupportedFormatError) as exc:
            objects[i.name] = {}
            problems[i.name] = str(exc)
    users = Counter(d for objs in objects.values() for d in objs)
    rows = [_ls_row(i, objects[i.name], users, problems.get(i.name), nonfinite.get(i.name)) for i in infos]
    unique: dict[bytes, int] = {}
    for objs in objects.values():
        unique.update(objs)
    total = {
        "checkpoints": len(rows),
        "damaged": len(problems),
        "raw_bytes": sum(r["raw_bytes"] or 0 for r in rows),
        "stored_bytes": sum(unique.values()),
    }
    status = 1 if problems else 0
    if as_json:
        echo_json({"url": store.url, "checkpoints": rows, "total": total})
        return status
    for line in _ls_lines(rows, total):
        click.echo(line)
    return status


def _ls_row(
    info: treestore.types.CheckpointInfo,
    objs: dict[bytes, int],
    users: Counter[bytes],
    problem: str | None,
    nonfinite: list[str] | None = None,
) -> dict[str, Any]:
    """One checkpoint of ``ls``; a damaged one (``problem`` set) has no stored or shared size
    (None), since its manifest, which names its chunks, cannot be read, and one whose commit
    record is damaged no time, leaf count or raw size either. ``nonfinite``: the leaves its
    manifest's statistics say hold NaN or inf."""
    unknown = info.problem is not None  # the commit record itself is damaged
    return {
        "name": info.name,
        "created": None if unknown else info.created,
        "leaves": None if unknown else info.leaves,
        "raw_bytes": None if unknown else info.nbytes,
        "stored_bytes": None if problem else sum(objs.values()),
        "shared_bytes": None if problem else sum(s for d, s in objs.items() if users[d] > 1),
        "metadata": info.metadata,
        "problem": problem,
        "nonfinite": None if problem else nonfinite,
    }


def _ls_lines(rows: list[dict[str, Any]], total: dict[str, int]) -> list[str]:
    """The human view of ``ls``: the table, the totals, then one line per damaged checkpoint."""
    header = ["name", "created", "leaves", "raw", "stored", "shared", "metadata"]
    cells = [
        [
            r["name"] + (" !" if r["nonfinite"] else ""),
            "?" if r["created"] is None else render.when(r["created"]),
            "?" if r["leaves"] is None else str(r["leaves"]),
            "?" if r["raw_bytes"] is None else render.size(r["raw_bytes"]),
            "damaged" if r["problem"] else render.size(r["stored_bytes"]),
            "?" if r["problem"] else render.size(r["shared_bytes"]),
            "" if r["metadata"] is None else render.compact(r["metadata"]),
        ]
        for r in rows
    ]
    lines = render.table(header, cells, right=[2, 3, 4, 5])
    damaged = f", {total['damaged']} damaged" if total["damaged"] else ""
    lines.append(
        f"{total['checkpoints']} checkpoint(s){damaged}, {render.size(total['raw_bytes'])} raw, "
        f"{render.size(total['stored_bytes'])} stored in chunks"
    )
    lines += [f"damaged: {r['name']}: {r['problem']}" for r in rows if r["problem"]]
    lines += [f"NaN/inf: {r['name']}: {_first(r['nonfinite'])}" for r in rows if r["nonfinite"]]
    return lines


def _first(addresses: list[str], shown: int = 5) -> str:
    """Some addresses, and how many more."""
    more = f" (and {len(addresses) - shown} more)" if len(addresses) > shown else ""
    return ", ".join(a or "(root)" for a in addresses[:shown]) + more


# --- show -----------------------------------------------------------------------------------------
def leaf_record(ckpt: treestore.Checkpoint, address: str) -> dict[str, Any]:
    leaf = ckpt[address]
    if not isinstance(leaf, treestore.LazyLeaf):
        return {"address": address, "kind": type(leaf).__name__, "value": leaf}
    return {
        "address": address,
        "kind": leaf.kind,
        "dtype": leaf.dtype.name,
        "shape": list(leaf.shape),
        "raw_bytes": leaf.nbytes,
        "stored_bytes": leaf.stored_bytes,
        "packed": leaf.packed,
        "chunks": leaf.chunks,
        "codec": leaf.codec,
    }


def header_lines(ckpt: treestore.Checkpoint, shown: int) -> list[str]:
    c = ckpt.codec
    codec = f"{c.get('name', '?')} level {c.get('level', '?')}" + (
        ", byte planes" if c.get("byte_planes") else ""
    )
    stored = ckpt.stored_bytes
    n = ckpt.num_leaves
    count = f"  ({shown} of {n} leaves shown)" if shown != n else ""
    lines = [
        f"{ckpt.url}#{ckpt.name}  created {render.when(ckpt.created)}{count}",
        f"{n} leaves, {render.size(ckpt.nbytes)} raw, {render.size(stored)} stored ({codec})",
    ]
    if ckpt.metadata is not None:
        lines.append(f"metadata: {render.compact(ckpt.metadata, 100)}")
    return lines


@click.command("show", short_help="Show the tree of a checkpoint.")
@click.argument("spec", metavar="URL[#NAME]")
@click.argument("patterns", nargs=-1)
@click.option("--flat", is_flag=True, help="One line per leaf with its full address, no tree view.")
@click.option(
    "--stats",
    is_flag=True,
    help="Each leaf's statistics recorded at save (NaN, inf, min, max, L2), from the manifest alone.",
)
@JSON
def show(spec: str, patterns: tuple[str, ...], flat: bool, stats: bool, as_json: bool) -> int:
    """Show the tree of a checkpoint (the newest when no #NAME): each leaf's address, dtype,
    shape, raw and stored size and codec, as a compact tree. PATTERNS (patterns over addresses,
    like 'encoder/*/bias') keep only the leaves that match. --stats shows instead the
    statistics each leaf's values had when saved, read from the manifest alone ("?": none
    recorded)."""
    ckpt = open_checkpoint(spec)
    addresses = ckpt.select(patterns) if patterns else list(ckpt.leaves)
    if stats:
        return _show_stats(ckpt, addresses, flat, as_json)
    records = [leaf_record(ckpt, a) for a in addresses]
    if as_json:
        echo_json(
            {
                "url": ckpt.url,
                "name": ckpt.name,
                "created": ckpt.created,
                "metadata": ckpt.metadata,
                "codec": ckpt.codec,
                "raw_bytes": ckpt.nbytes,
                "stored_bytes": ckpt.stored_bytes,
                "leaves": records,
            }
        )
        return 0
    for line in show_lines(ckpt, records, flat):
        click.echo(line)
    return 0


def show_lines(ckpt: treestore.Checkpoint, records: list[dict[str, Any]], flat: bool = False) -> list[str]:
    """The human view of ``show``: a header, then one line per node and leaf."""
    labels = (
        [(r["address"] or "(root)", i) for i, r in enumerate(records)]
        if flat
        else render.tree_labels([r["address"] for r in records])
    )
    rows = []
    for label, i in labels:
        if i is None:
            rows.append([label, "", "", "", "", ""])
            continue
        r = records[i]
        if "dtype" in r:
            stored = "packed" if r["packed"] else render.size(r["stored_bytes"])
            shape = "[" + ", ".join(map(str, r["shape"])) + "]"
            rows.append([label, r["dtype"], shape, render.size(r["raw_bytes"]), stored, r["codec"]])
        else:
            rows.append([label, r["kind"], "", "", "", f"= {render.compact(r['value'], 40)}"])
    header = ["address" if flat else "tree", "dtype", "shape", "raw", "stored", "codec"]
    return [*header_lines(ckpt, len(records)), "", *render.table(header, rows, right=[3, 4])]


def _show_stats(ckpt: treestore.Checkpoint, addresses: list[str], flat: bool, as_json: bool) -> int:
    """``show --stats``: each leaf's recorded statistics; nothing but the manifest is read."""
    found = ckpt.stats(addresses) if addresses else {}
    if as_json:
        echo_json(
            {
                "url": ckpt.url,
                "name": ckpt.name,
                "healthy": ckpt.healthy,
                "leaves": [
                    found[a].to_json() if a in found else {"address": a, "stats": None} for a in addresses
                ],
            }
        )
        return 0
    labels = [(a or "(root)", i) for i, a in enumerate(addresses)] if flat else render.tree_labels(addresses)
    rows = []
    for label, i in labels:
        s = None if i is None else found.get(addresses[i])
        if s is None:
            rows.append([label] + ([""] * 6 if i is None else ["?", "", "", "", "", ""]))
            continue
        rows.append(
            [label, s.dtype, str(s.nan), str(s.posinf + s.neginf), _num(s.min), _num(s.max), _num(s.l2)]
        )
    state = ckpt.healthy
    said = "none recorded" if state is None else "every recorded leaf finite" if state else "NaN/inf in "
    header = ["address" if flat else "tree", "dtype", "nan", "inf", "min", "max", "l2"]
    lines = [
        f"{ckpt.url}#{ckpt.name}: statistics recorded at save, from the manifest alone "
        f"({said}{_first(ckpt.nonfinite()) if state is False else ''})",
        "",
        *render.table(header, rows, [2, 3, 4, 5, 6]),
    ]
    for line in lines:
        click.echo(line)
    return 0


def _num(x: float | int | None) -> str:
    return "-" if x is None else f"{x:.6g}" if isinstance(x, float) else str(x)


# --- health ---------------------------------------------------------------------------------------
@click.command("health", short_help="Which checkpoints and leaves hold NaN/inf (exit 1 if any).")
@click.argument("url")
@click.argument("patterns", nargs=-1)
@JSON
def health(url: str, patterns: tuple[str, ...], as_json: bool) -> int:
    """Which checkpoints of the store at URL hold NaN or inf values, and in which leaves, from
    the statistics their manifests recorded at save: no chunk is read. For each leaf, the first
    checkpoint (oldest first) that held a non-finite value; each checkpoint is healthy, holds
    NaN/inf, or is unknown (saved without statistics), or is damaged (its commit record or
    manifest cannot be read: named, and the others still reported). PATTERNS (patterns over
    addresses) keep only the leaves that match. Exit status 1 when any checkpoint holds NaN/inf
    or is damaged."""
    store = open_store(url)
    infos = store.list(damaged=True)
    if not infos:
        require_store(store)
    rows: list[dict[str, Any]] = []
    first: dict[str, str] = {}
    damaged = False
    for info in infos:
        problem = info.problem
        if problem is None:
            try:
                ckpt = store.open(info.name)
                bad = ckpt.nonfinite()
            except treestore.errors.CheckpointNotFoundError:
                continue  # deleted since the listing
            except (treestore.DamagedError, treestore.UnsupportedFormatError) as exc:
                problem = str(exc)
        if problem is not None:
            damaged = True
            row = {"name": info.name, "created": info.created, "healthy": None, "nonfinite": []}
            rows.append(row | {"problem": problem})
            continue
        if patterns and bad:
            bad = [a for a in bad if a in set(_matching(ckpt, patterns))]
        healthy = False if bad else (None if ckpt.healthy is None else True)
        for a in bad:
            first.setdefault(a, info.name)
        rows.append({"name": info.name, "created": info.created, "healthy": healthy, "nonfinite": bad})
    status = 1 if first or damaged else 0
    if as_json:
        echo_json({"url": store.url, "checkpoints": rows, "first_nonfinite": first})
        return status
    state = {True: "ok", False: "NaN/inf", None: "unknown"}
    cells = [
        [
            r["name"],
            "damaged" if "problem" in r else state[r["healthy"]],
            _first(r["nonfinite"]) if r["nonfinite"] else "",
        ]
        for r in rows
    ]
    for line in render.table(["name", "values", "leaves with NaN/inf"], cells):
        click.echo(line)
    for r in rows:
        if "problem" in r:
            click.echo(f"damaged: {r['name']}: {r['problem']}")
    if first:
        click.echo("")
        click.echo("first held NaN/inf:")
        for line in render.table(["leaf", "checkpoint"], [[a or "(root)", n] for a, n in first.items()]):
            click.echo("  " + line)
    else:
        click.echo("no checkpoint's recorded statistics show NaN/inf")
    return status


def _matching(ckpt: treestore.Checkpoint, patterns: tuple[str, ...]) -> list[str]:
    """The addresses matching any pattern; none when no pattern matches in this checkpoint."""
    found: list[str] = []
    for p in patterns:
        try:
            found += ckpt.select([p])
        except treestore.errors.NoMatchError:
            continue
    return found


# --- diff -----------------------------------------------------------------------------------------
@click.command("diff", short_help="Compare two checkpoints (exit 0 same, 1 different).")
@click.argument("a", metavar="A")
@click.argument("b", metavar="B")
@click.argument("patterns", nargs=-1)
@click.option(
    "--values",
    is_flag=True,
    help="Compare the values of each changed leaf (max |a-b|, relative L2, share of elements).",
)
@click.option("--stats", "old_stats", is_flag=True, hidden=True)  # 0.2's name of --values
@JSON
def diff(a: str, b: str, patterns: tuple[str, ...], values: bool, old_stats: bool, as_json: bool) -> int:
    """Compare checkpoints A and B (each URL or URL#NAME, possibly in different stores):
    added, removed, changed, shape- and dtype-changed leaves; PATTERNS (patterns over addresses)
    limit the comparison. Exit status 0 when identical, 1 when different, 2 on error."""
    if old_stats:
        click.echo("treestore: diff --stats is deprecated: use --values", err=True)
    with progress("diff") as bar:  # reading leaves by value can take a while; manifests alone do not
        result = treestore.diff(
            a,
            b,
            values=values or old_stats,
            select=patterns or None,
            storage_options=settings().storage_options,
            progress=bar,
        )
    if as_json:
        echo_json(result.to_json())
    else:
        click.echo(result.table(ascii=not render.fancy()))
    return 1 if result else 0
