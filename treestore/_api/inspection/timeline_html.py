"""The HTML page of a timeline: one self-contained file (inline SVG, CSS and a few lines of JS; no
external script, style sheet or font), readable in any browser offline.

Every number is in the DOM: each heatmap cell and each table cell carries its exact value in
``data-value`` (Python's ``repr`` of the float: ``nan``, ``inf`` or digits that read back to the
same float).
"""

from __future__ import annotations

import html
import itertools
import math
from typing import Any

# Viridis at five stops: readable in grey and by people with the common colour-vision deficiencies.
_STOPS = [
    (0.0, (68, 1, 84)),
    (0.25, (59, 82, 139)),
    (0.5, (33, 145, 140)),
    (0.75, (94, 201, 98)),
    (1.0, (253, 231, 37)),
]
_ZERO, _ABSENT = "#ffffff", "#d9d9d9"
_LINE_COLOURS = [
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
]

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; margin: 0 0 .3em; }
.note { color: #555; margin: 0 0 1em; }
svg text { font: 11px monospace; fill: #222; }
rect.cell { stroke: #eee; stroke-width: .5; }
rect.cell:hover { stroke: #000; stroke-width: 1.5; }
rect.nonfinite { stroke: #d62728; stroke-width: 2; }
td.nonfinite { color: #d62728; }
#detail { font-family: monospace; min-height: 1.4em; margin: .4em 0 1em; }
table { border-collapse: collapse; font: 12px monospace; }
td, th { border: 1px solid #ddd; padding: 2px 6px; text-align: right; }
td:first-child, th:first-child { text-align: left; }
.legend span { display: inline-block; margin-right: 1em; }
.legend i { display: inline-block; width: 1.5em; height: .4em; margin-right: .3em; vertical-align: middle; }
"""

_SCRIPT = """
(function () {
  var detail = document.getElementById("detail");
  var cells = document.querySelectorAll("rect.cell");
  cells.forEach(function (r) {
    r.addEventListener("mouseenter", function () {
      var odd = r.getAttribute("data-nonfinite");
      detail.textContent = r.getAttribute("data-address") + ": " + r.getAttribute("data-from") +
        " \\u2192 " + r.getAttribute("data-to") + ": " + r.getAttribute("data-value") +
        (odd !== "0" ? " (+" + odd + " non-finite)" : "");
    });
  });
  var box = document.getElementById("heatmap").getBoundingClientRect();
  document.body.setAttribute("data-heatmap-width", String(Math.round(box.width)));
  document.body.setAttribute("data-cells", String(cells.length));
  document.body.setAttribute("data-rendered", "true");
})();
"""


def colour(t: float) -> str:
    """The viridis colour of ``t`` in [0, 1]."""
    t = min(max(t, 0.0), 1.0)
    for (t0, c0), (t1, c1) in itertools.pairwise(_STOPS):
        if t <= t1:
            f = (t - t0) / (t1 - t0)
            r, g, b = (round(a + (b - a) * f) for a, b in zip(c0, c1, strict=True))
            return f"#{r:02x}{g:02x}{b:02x}"
    raise AssertionError("unreachable")  # pragma: no cover


def _fill(value: float, top: float) -> str:
    if math.isnan(value):
        return _ABSENT
    if value == 0:
        return _ZERO
    if math.isinf(value) or top <= 0:
        return colour(1.0)
    return colour(value / top)


def _text(value: float) -> str:
    if math.isnan(value):
        return "—"
    return "inf" if math.isinf(value) else f"{value:.3g}"


def _nonfinite_text(n: int) -> str:
    return f" (+{n} non-finite)" if n else ""


def _heatmap(t: Any, tops: list[float]) -> str:
    e = html.escape
    steps = t.steps
    cell = max(4, min(24, 800 // max(len(steps), 1)))
    row_h = 14
    labels = [a or "(root)" for a in t.addresses]
    left = min(400, 7 * max((len(a) for a in labels), default=4) + 10)
    top_margin = 12
    width = left + cell * len(steps) + 90  # each row's maximum to the right of its cells
    bottom = top_margin + row_h * len(labels)
    height = bottom + 20
    parts = [
        f'<svg id="heatmap" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="relative change per leaf and step">'
    ]
    for i, (address, label, row) in enumerate(zip(t.addresses, labels, t.values, strict=True)):
        y = top_margin + i * row_h
        parts.append(f'<text x="{left - 6}" y="{y + row_h - 3}" text-anchor="end">{e(label)}</text>')
        for j, ((a, b), v) in enumerate(zip(steps, row, strict=True)):
            n = t.nonfinite_at(i, j)
            parts.append(
                f'<rect class="cell{" nonfinite" if n else ""}" x="{left + j * cell}" y="{y}" '
                f'width="{cell}" height="{row_h}" '
                f'fill="{_fill(v, tops[i])}" data-address="{e(address)}" data-step="{j}" '
                f'data-from="{e(a)}" data-to="{e(b)}" data-value="{v!r}" data-nonfinite="{n}">'
                f"<title>{e(label)}: {e(a)} \u2192 {e(b)}: {_text(v)}{_nonfinite_text(n)}</title></rect>"
            )
        parts.append(
            f'<text class="top" x="{left + cell * len(steps) + 6}" y="{y + row_h - 3}">'
            f"{_text(tops[i]) if tops[i] > 0 else 'unchanged'}</text>"
        )
    if steps:  # the run's first and last checkpoint under the map's ends
        parts.append(f'<text x="{left}" y="{bottom + 14}">{e(steps[0][0])}</text>')
        parts.append(
            f'<text x="{left + cell * len(steps)}" y="{bottom + 14}" text-anchor="end">'
            f"{e(steps[-1][1])}</text>"
        )
    parts.append("</svg>")
    return "".join(parts)


def _scale(tops: list[float], scale: str) -> str:
    """The colour bar: what each colour means, from white (no change) to the brightest (the
    row's largest change, or the largest of all)."""
    steps = 10
    width, bar = 360, 300
    x0 = 30
    parts = [
        f'<svg id="scale" xmlns="http://www.w3.org/2000/svg" width="{width}" height="36" '
        f'viewBox="0 0 {width} 36" role="img" aria-label="colour scale">',
        f'<rect x="0" y="4" width="16" height="12" fill="{_ZERO}" stroke="#888"/>',
        '<text x="0" y="30">0</text>',
    ]
    for k in range(steps):
        parts.append(
            f'<rect x="{x0 + k * bar // steps}" y="4" width="{bar // steps}" height="12" '
            f'fill="{colour((k + 1) / steps)}"/>'
        )
    peak = max(tops, default=0.0)
    right = "the row's largest change" if scale == "row" else f"{_text(peak)} (the largest of all)"
    parts.append(f'<text x="{x0}" y="30">&gt; 0</text>')
    parts.append(f'<text x="{x0 + bar}" y="30" text-anchor="end">{html.escape(right)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _lines(g: Any) -> str:
    """One polyline per group over the steps (broken where a group is absent), linear in value."""
    e = html.escape
    n = len(g.steps)
    width, height, pad = 820, 240, 40
    finite = [v for row in g.values for v in row if math.isfinite(v)]
    ymax = max(finite, default=0.0) or 1.0

    def x(j: int) -> float:
        return pad + (j + 0.5) * (width - 2 * pad) / max(n, 1)

    def y(v: float) -> float:
        return height - pad + (-(min(v, ymax) / ymax) * (height - 2 * pad))

    parts = [
        f'<svg id="lines" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="relative change per group">',
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="#888"/>',
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="#888"/>',
        f'<text x="{pad - 4}" y="{pad + 4}" text-anchor="end">{_text(ymax)}</text>',
        f'<text x="{pad - 4}" y="{height - pad + 4}" text-anchor="end">0</text>',
    ]
    if n:
        parts.append(
            f'<text x="{x(0)}" y="{height - pad + 16}" text-anchor="middle">{e(g.steps[0][1])}</text>'
        )
        if n > 1:
            parts.append(
                f'<text x="{x(n - 1)}" y="{height - pad + 16}" text-anchor="middle">'
                f"{e(g.steps[-1][1])}</text>"
            )
    legend = []
    for k, (address, row) in enumerate(zip(g.addresses, g.values, strict=True)):
        colour_k = _LINE_COLOURS[k % len(_LINE_COLOURS)]
        label = address or "(root)"
        runs: list[list[str]] = [[]]
        for j, v in enumerate(row):
            if math.isnan(v):
                runs.append([])
            else:
                runs[-1].append(f"{x(j):.1f},{y(v):.1f}")
        for run in runs:
            if len(run) == 1:
                cx, cy = run[0].split(",")
                parts.append(f'<circle cx="{cx}" cy="{cy}" r="2.5" fill="{colour_k}"/>')
            elif run:
                parts.append(
                    f'<polyline class="line" data-group="{e(address)}" fill="none" stroke="{colour_k}" '
                    f'stroke-width="1.5" points="{" ".join(run)}"><title>{e(label)}</title></polyline>'
                )
        legend.append(f'<span><i style="background:{colour_k}"></i>{e(label)}</span>')
    parts.append("</svg>")
    return "".join(parts) + f'<div class="legend">{"".join(legend)}</div>'


def _value_cell(v: float, j: int, n: int) -> str:
    """One value of the table: the finite change and, apart, the non-finite elements changed."""
    odd = ' class="nonfinite"' if n else ""
    attrs = f'{odd} data-step="{j}" data-value="{v!r}" data-nonfinite="{n}"'
    return f"<td{attrs}>{_text(v)}{_nonfinite_text(n)}</td>"


def _table(t: Any) -> str:
    e = html.escape
    head = "".join(f"<th>{e(a)} \u2192 {e(b)}</th>" for a, b in t.steps)
    rows = []
    for i, (address, size, row) in enumerate(zip(t.addresses, t.sizes, t.values, strict=True)):
        cells = "".join(_value_cell(v, j, t.nonfinite_at(i, j)) for j, v in enumerate(row))
        rows.append(
            f'<tr data-address="{e(address)}"><td>{e(address or "(root)")}</td><td>{size}</td>{cells}</tr>'
        )
    return (
        f'<table id="values"><thead><tr><th>address</th><th>elements</th>{head}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


def _damaged(t: Any) -> str:
    """One line per checkpoint the timeline left out because it is damaged, with the problem."""
    e = html.escape
    items = "".join(
        f'<li data-checkpoint="{e(name)}">{e(name)}: {e(problem)}</li>' for name, problem in t.damaged
    )
    return f'<p class="note">Damaged checkpoints, left out:</p><ul id="damaged">{items}</ul>' if items else ""


def page(t: Any, groups: Any, tops: list[float], title: str, scale: str = "row") -> str:
    """The whole page of timeline ``t``; ``groups`` is its top-level grouping (the lines);
    ``tops``: what each row's colours are scaled to (``scale``: ``"row"`` or ``"global"``)."""
    e = html.escape
    what = "groups (pooled by size)" if t.depth else "leaves"
    scaled = (
        "Colours are scaled per row: each row's brightest colour is that row's own largest "
        "change, written at its right end, so rows of very different sizes look alike; compare "
        'the numbers, or draw with one scale for all (scale="global", --scale global).'
        if scale == "row"
        else "Colours are scaled to the largest change of all rows."
    )
    note = (
        f"{len(t.checkpoints)} checkpoints, {len(t.steps)} steps, {len(t.addresses)} {what}. "
        "Each cell: relative L2 change \u2016b \u2212 a\u2016 / \u2016a\u2016 from one checkpoint "
        "to the next; "
        "white: unchanged, grey: absent at that step; measured over the elements finite in both, "
        f"a red outline where elements changed to, from or between NaN and \u00b1inf. {scaled}"
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{e(title)}</title><style>{_STYLE}</style></head>"
        f'<body data-url="{e(t.url)}"><h1>{e(title)}</h1><p class="note">{e(note)}</p>{_damaged(t)}'
        f'<div>{_scale(tops, scale)}</div>{_heatmap(t, tops)}<div id="detail"></div>'
        f"<h2>By group</h2>{_lines(groups)}"
        f"<h2>Values</h2>{_table(t)}"
        f"<script>{_SCRIPT}</script></body></html>\n"
    )
