"""Reading commands: ``ls``, ``show`` and ``diff``."""

from __future__ import annotations

import difflib
import fnmatch
import glob
import math
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

import click

import treestore

from . import render
from .context import echo_json, settings, split_spec

CHUNK_HEADER = 16  # bytes before a chunk object's body (SPEC.md, "Chunk objects")
JSON = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")


def open_store(url: str) -> treestore.Store:
    return treestore.Store(url, storage_options=settings().storage_options)


def require_store(store: treestore.Store) -> None:
    """Raise NotFoundError unless a store exists at ``store.url`` (so a mistyped URL is an error,
    not an empty store)."""
    if not any(store.storage.exists(folder) for folder in ("checkpoints", "chunks", "manifests")):
        raise treestore.NotFoundError(f"no treestore store at {store.url}")


def open_checkpoint(spec: str) -> treestore.Checkpoint:
    url, name = split_spec(spec)
    return open_store(url).open(name)


def chunk_objects(manifest: treestore.types.Manifest) -> dict[bytes, int]:
    """Stored bytes of each chunk object a checkpoint references."""
    found = {c.digest: c.stored_size for leaf in manifest.leaves for c in leaf.chunks if c.pack is None}
    found.update((p.digest, p.stored_size) for p in manifest.packs)
    return found


_QUOTED_DIGITS = re.compile(r'(?<![^/])"([0-9]+)"(?![^/])')


def loose(address: str) -> str:
    """An address with the quotes around digit-only dict keys left out, for typing patterns:
    ``encoder/layer/"0"/w`` -> ``encoder/layer/0/w``."""
    return _QUOTED_DIGITS.sub(r"\1", address)


def matches(address: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(address, pattern) or fnmatch.fnmatchcase(loose(address), pattern)


def select(addresses: Sequence[str], patterns: Sequence[str], where: str) -> set[str]:
    """Addresses matching any glob pattern (quotes around digit keys may be left out); every
    pattern must match one."""
    for p in patterns:
        if not any(matches(a, p) for a in addresses):
            near = difflib.get_close_matches(p, list(addresses), n=3, cutoff=0.3) or list(addresses[:3])
            hint = f"; nearest addresses: {', '.join(repr(a) for a in near)}" if near else ""
            raise treestore.errors.NoMatchError(f"pattern {p!r} matches no leaf of {where}{hint}")
    return {a for a in addresses if any(matches(a, p) for p in patterns)}


# --- ls -------------------------------------------------------------------------------------------
@click.command("ls", short_help="List the checkpoints of a store.")
@click.argument("url")
@JSON
def ls(url: str, as_json: bool) -> int:
    """List the checkpoints of the store at URL: name, time, leaf count, logical size, stored
    size (its chunk objects), bytes shared with other checkpoints, and metadata."""
    if split_spec(url)[1] is not None:
        raise click.BadParameter("ls takes a store URL, without #NAME", param_hint="URL")
    store = open_store(url)
    infos = store.list()
    if not infos:
        require_store(store)
    objects = {i.name: chunk_objects(store.manifest(i.name)) for i in infos}
    users = Counter(d for objs in objects.values() for d in objs)
    rows = []
    for i in infos:
        objs = objects[i.name]
        rows.append(
            {
                "name": i.name,
                "created": i.created,
                "leaves": i.leaves,
                "logical_bytes": i.nbytes,
                "stored_bytes": sum(objs.values()),
                "shared_bytes": sum(s for d, s in objs.items() if users[d] > 1),
                "metadata": i.metadata,
            }
        )
    unique: dict[bytes, int] = {}
    for objs in objects.values():
        unique.update(objs)
    total = {
        "checkpoints": len(rows),
        "logical_bytes": sum(r["logical_bytes"] for r in rows),
        "stored_bytes": sum(unique.values()),
    }
    if as_json:
        echo_json({"url": store.url, "checkpoints": rows, "total": total})
        return 0
    header = ["name", "created", "leaves", "logical", "stored", "shared", "metadata"]
    cells = [
        [
            r["name"],
            render.when(r["created"]),
            str(r["leaves"]),
            render.size(r["logical_bytes"]),
            render.size(r["stored_bytes"]),
            render.size(r["shared_bytes"]),
            "" if r["metadata"] is None else render.compact(r["metadata"]),
        ]
        for r in rows
    ]
    for line in render.table(header, cells, right=[2, 3, 4, 5]):
        click.echo(line)
    click.echo(
        f"{total['checkpoints']} checkpoint(s), {render.size(total['logical_bytes'])} logical, "
        f"{render.size(total['stored_bytes'])} stored in chunks"
    )
    return 0


# --- show -----------------------------------------------------------------------------------------
def codec_of(leaf: Any, entry: treestore.types.LeafEntry, codec: dict[str, Any]) -> str:
    """How a leaf's chunks are stored, read from its sizes: a chunk stored at its raw size plus
    the header is raw; others are compressed as the checkpoint's codec says."""
    if not entry.chunks:
        return "-"
    if any(c.pack is not None for c in entry.chunks):
        return "-"
    raw = [c.stored_size == c.raw_size + CHUNK_HEADER for c in entry.chunks]
    if all(raw):
        return "raw"
    floating = leaf.dtype.kind in "fcV" or leaf.dtype.name.startswith(("bfloat", "float"))
    name = "zstd+planes" if codec.get("byte_planes") and floating and leaf.dtype.itemsize >= 2 else "zstd"
    return name + ("/raw" if any(raw) else "")


def leaf_record(ckpt: treestore.Checkpoint, entry: treestore.types.LeafEntry) -> dict[str, Any]:
    rec: dict[str, Any] = {"address": entry.address, "kind": entry.kind}
    if entry.is_array:
        leaf = ckpt[entry.address]
        rec.update(
            dtype=entry.dtype,
            shape=list(entry.shape or ()),
            logical_bytes=entry.nbytes,
            stored_bytes=entry.stored_bytes,
            packed=any(c.pack is not None for c in entry.chunks),
            chunks=len(entry.chunks),
            codec=codec_of(leaf, entry, ckpt.manifest.codec),
        )
    else:
        rec["value"] = entry.value
    return rec


def header_lines(ckpt: treestore.Checkpoint, shown: int) -> list[str]:
    m = ckpt.manifest
    c = m.codec
    codec = f"{c.get('name', '?')} level {c.get('level', '?')}" + (
        ", byte planes" if c.get("byte_planes") else ""
    )
    stored = sum(chunk_objects(m).values())
    count = f"  ({shown} of {len(m.leaves)} leaves shown)" if shown != len(m.leaves) else ""
    lines = [
        f"{ckpt.url}#{ckpt.name}  created {render.when(m.created)}{count}",
        f"{len(m.leaves)} leaves, {render.size(m.nbytes)} logical, {render.size(stored)} stored ({codec})",
    ]
    if m.metadata is not None:
        lines.append(f"metadata: {render.compact(m.metadata, 100)}")
    return lines


@click.command("show", short_help="Show the tree of a checkpoint.")
@click.argument("spec", metavar="URL[#NAME]")
@click.argument("patterns", nargs=-1)
@click.option("--flat", is_flag=True, help="One line per leaf with its full address, no tree view.")
@JSON
def show(spec: str, patterns: tuple[str, ...], flat: bool, as_json: bool) -> int:
    """Show the tree of a checkpoint (the newest when no #NAME): each leaf's address, dtype,
    shape, logical and stored size and codec, as a compact tree. PATTERNS (globs over addresses,
    like 'encoder/*/bias') keep only the leaves that match."""
    ckpt = open_checkpoint(spec)
    entries = list(ckpt.manifest.leaves)
    if patterns:
        keep = select([e.address for e in entries], patterns, f"checkpoint {ckpt.name!r}")
        entries = [e for e in entries if e.address in keep]
    records = [leaf_record(ckpt, e) for e in entries]
    if as_json:
        m = ckpt.manifest
        echo_json(
            {
                "url": ckpt.url,
                "name": ckpt.name,
                "created": m.created,
                "metadata": m.metadata,
                "codec": m.codec,
                "logical_bytes": m.nbytes,
                "stored_bytes": sum(chunk_objects(m).values()),
                "leaves": records,
            }
        )
        return 0
    for line in show_lines(ckpt, records, flat):
        click.echo(line)
    return 0


def show_lines(ckpt: treestore.Checkpoint, records: list[dict[str, Any]], flat: bool = False) -> list[str]:
    """The human view of ``show``: a header, then one line per folder and leaf."""
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
            rows.append([label, r["dtype"], shape, render.size(r["logical_bytes"]), stored, r["codec"]])
        else:
            rows.append([label, r["kind"], "", "", "", f"= {render.compact(r['value'], 40)}"])
    header = ["address" if flat else "tree", "dtype", "shape", "logical", "stored", "codec"]
    return [*header_lines(ckpt, len(records)), "", *render.table(header, rows, right=[3, 4])]


# --- diff -----------------------------------------------------------------------------------------
FLOATING = ("float", "bfloat", "complex")  # leaves whose change is drawn as a bar
MARKS = {"added": "+", "removed": "-", "changed": "~", "shape_changed": "!", "dtype_changed": "!"}


def _num(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3g}"


def diff_lines(d: treestore.types.Diff, stats: bool) -> list[str]:
    """The human table of a diff. With stats, each changed floating-point leaf's relative L2
    change is also drawn as a bar, scaled to the largest in the table."""
    shown = list(d)
    barred = {
        x.address: x.stats.rel_l2
        for x in shown
        if x.stats is not None and (x.a or "").startswith(FLOATING) and x.stats.rel_l2 == x.stats.rel_l2
    }
    top = max((v for v in barred.values() if math.isfinite(v)), default=0.0)
    nonfinite = any(s and (s.nan_a or s.nan_b or s.inf_a or s.inf_b) for s in (x.stats for x in shown))
    rows = []
    for x in shown:
        row = [MARKS[x.status], x.address or "(root)", x.a or "", x.b or ""]
        row.append("" if x.chunks_changed is None else f"{x.chunks_changed:.0%}")
        s = x.stats
        if stats:
            if s is None:
                row += ["", "", ""]
            else:
                row += [_num(s.max_abs), _num(s.rel_l2), f"{s.frac_changed:.1%}"]
            if nonfinite:
                row.append(f"NaN {s.nan_a}->{s.nan_b}, Inf {s.inf_a}->{s.inf_b}" if s else "")
            rel = barred.get(x.address, 0.0)
            row.append(render.bar(top if math.isinf(rel) else rel, top or 1.0) if rel else "")
        rows.append(row)
    lines = [f"--- {d.a}", f"+++ {d.b}"]
    if rows:
        header = ["", "address", "a", "b", "chunks"]
        if stats:
            header += ["max abs", "rel L2", "changed", *(["nonfinite"] if nonfinite else [])]
            header.append("relative change")
        lines += render.table(header, rows, right=[4, 5, 6, 7])
    counts = d.to_json()["counts"]
    parts = [f"{counts[k]} {k.replace('_', ' ')}" for k in MARKS if counts[k]]
    summary = ", ".join(parts) if parts else "identical"
    lines.append(f"{summary}; {counts['unchanged']} leaves unchanged")
    return lines


@click.command("diff", short_help="Compare two checkpoints (exit 0 same, 1 different).")
@click.argument("a", metavar="A")
@click.argument("b", metavar="B")
@click.argument("patterns", nargs=-1)
@click.option(
    "--stats",
    is_flag=True,
    help="Numeric change of each changed leaf (max |a-b|, relative L2, share of elements).",
)
@JSON
def diff(a: str, b: str, patterns: tuple[str, ...], stats: bool, as_json: bool) -> int:
    """Compare checkpoints A and B (each URL or URL#NAME, possibly in different stores):
    added, removed, changed, shape- and dtype-changed leaves; PATTERNS (globs over addresses)
    limit the comparison. Exit status 0 when identical, 1 when different, 2 on error."""
    ca, cb = open_checkpoint(a), open_checkpoint(b)
    chosen = None
    if patterns:  # resolved here so that the CLI's pattern conveniences apply; stats only for these
        addresses = list(dict.fromkeys(e.address for c in (ca, cb) for e in c.manifest.leaves))
        chosen = [glob.escape(x) for x in select(addresses, patterns, "either checkpoint")]
    result = treestore.diff(ca, cb, stats=stats, select=chosen)
    if as_json:
        echo_json(result.to_json())
    else:
        for line in diff_lines(result, stats):
            click.echo(line)
    return 1 if result else 0
