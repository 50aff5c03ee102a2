"""Store.timeline and `treestore timeline`: relative change per leaf and step, from the exact diff."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import uuid
from html.parser import HTMLParser

import numpy as np
import pytest
from click.testing import CliRunner

import treestore
from tests.support.counting import CountingFileSystem
from treestore._api.inspection import heatmap as _heatmap
from treestore.errors import CheckpointNotFoundError, NoMatchError
from treestore_cli.main import cli

FROZEN = np.random.default_rng(0).standard_normal(256 * 1024).astype(np.float32)  # 1 MiB, never changes


def run_tree(step: int) -> dict:
    """A small training run: enc/w moves every step, head/w every other step, enc/b never,
    frozen never; head/extra appears at step 2; enc/w changes shape at step 4."""
    rng = np.random.default_rng(100 + step)
    enc = np.ones((32, 32), np.float32) + np.float32(0.01 * step) * rng.standard_normal((32, 32)).astype(
        np.float32
    )
    tree = {
        "enc": {"w": enc if step < 4 else np.ones((16, 16), np.float32), "b": np.zeros(8, np.float32)},
        "head": {"w": np.full((8, 4), 1.0 + step // 2, np.float32)},
        "frozen": FROZEN,
        "step": step,
    }
    if step >= 2:
        tree["head"]["extra"] = np.full(3, float(step), np.float32)
    return tree


def make_run(url: str, steps: int = 5, **kw) -> treestore.Store:
    store = treestore.Store(url, **kw)
    for step in range(steps):
        store.save(run_tree(step), f"step-{step}")
    return store


def rel_l2(url: str, a: str, b: str) -> dict[str, float]:
    d = treestore.diff(f"{url}#{a}", f"{url}#{b}", values=True)
    return {x.address: x.change.rel_l2 for x in d.leaves if x.change is not None}


def test_values_are_the_diffs_rel_l2(tmp_path):
    url = str(tmp_path / "run")
    store = make_run(url)
    t = store.timeline()
    assert t.checkpoints == tuple(f"step-{i}" for i in range(5))
    assert t.addresses == ("enc/b", "enc/w", "frozen", "head/w", "head/extra")  # arrays only
    assert t.steps[0] == ("step-0", "step-1") and len(t.steps) == 4
    m = t.to_numpy()
    assert m.shape == (5, 4)
    for j, (a, b) in enumerate(t.steps):
        expected = rel_l2(url, a, b)
        for i, address in enumerate(t.addresses):
            if address in expected:
                assert m[i, j] == expected[address], (address, a, b)
    row = dict(zip(t.addresses, t.values, strict=True))
    assert row["enc/b"] == row["frozen"] == (0.0, 0.0, 0.0, 0.0)  # unchanged: 0.0
    assert row["head/w"] == (0.0, 1.0, 0.0, 0.5)  # 1 -> 1 -> 2 -> 2 -> 3
    assert math.isnan(row["head/extra"][0]) and math.isnan(row["head/extra"][1])  # absent in step-0/1
    assert math.isnan(row["enc/w"][3])  # shape changed
    assert t.sizes == (8, 256, 256 * 1024, 32, 3)


def test_select_and_depth(tmp_path):
    store = make_run(str(tmp_path / "run"))
    full = store.timeline()
    t = store.timeline(select="head/*")
    assert t.addresses == ("head/w", "head/extra")
    assert np.array_equal(t.to_numpy(), full.to_numpy()[3:], equal_nan=True)
    g = store.timeline(depth=1)
    assert g.addresses == ("enc", "frozen", "head") and g.depth == 1 and g.sizes[0] == 8 + 256
    # A group pools its leaves' changes by size: sqrt(sum n v^2 / sum n) over the leaves present.
    enc_b, enc_w = full.values[0], full.values[1]
    assert g.values[0][0] == pytest.approx(math.sqrt((8 * enc_b[0] ** 2 + 256 * enc_w[0] ** 2) / 264))
    assert g.values[0][3] == 0.0  # enc/w absent (shape changed), enc/b unchanged
    assert g.values[2][1] == 1.0  # head/w's alone: head/extra is absent at that step
    assert store.timeline(select="head/*", depth=1).addresses == ("head",)
    with pytest.raises(NoMatchError):
        store.timeline(select="decoder/*")
    with pytest.raises(CheckpointNotFoundError):
        treestore.Store(str(tmp_path / "empty")).timeline()


def test_reads_only_changed_chunks_and_reports_progress():
    url = "counting://timeline/run"
    store = make_run(url, steps=3)
    frozen_chunks = {c.digest.hex() for c in store.manifest("step-0").leaves[2].chunks}
    assert store.manifest("step-0").leaves[2].address == "frozen" and frozen_chunks
    CountingFileSystem.reset()
    calls: list[tuple[int, int]] = []
    store.timeline(progress=lambda done, total: calls.append((done, total)))
    read = CountingFileSystem.paths_read()
    assert not [p for p in read if any(d in p for d in frozen_chunks)]  # unchanged: never read
    assert CountingFileSystem.bytes_read("/chunks/") < 64 * 1024  # only the small changed leaves
    assert calls[0][0] == 0 and calls[-1][0] == calls[-1][1] > 0
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_heatmap_text():
    t = treestore.types.Timeline(
        "memory://x", ("a", "b", "c", "d"), ("w", "v"), ((0.1, 0.2, 0.0), (4.0, math.nan, math.inf)), (4, 4)
    )
    lines = t.heatmap().splitlines()
    assert lines[1] == "   012"  # the steps, numbered
    assert lines[2] == "w  ▄█   max 0.2"
    assert lines[3] == "v  █·█  max inf"
    assert lines[4] == "steps: 0 a -> b, 1 b -> c, 2 c -> d"
    assert t.heatmap(scale="global").splitlines()[2] == "w  ▁▁   max 0.2"
    assert t.heatmap(ascii=True).splitlines()[3] == "v  @x@  max inf"
    assert json.loads(json.dumps(t.to_json()))["rows"][1]["values"] == [4.0, "nan", "inf"]
    with pytest.raises(treestore.InvalidInputError):
        t.heatmap(scale="log")


def test_cli_timeline(tmp_path):
    url = str(tmp_path / "run")
    make_run(url, steps=3)
    result = CliRunner().invoke(cli, ["timeline", url])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("3 checkpoints, 2 steps: step-0 -> step-2")
    assert lines[1].strip() == "01" and lines[2].startswith("enc/")
    assert lines[-2].startswith("unchanged at every step: ") and "frozen" in lines[-2]
    assert lines[-1] == "steps: 0 step-0 -> step-1, 1 step-1 -> step-2"
    result = CliRunner().invoke(cli, ["timeline", url, "--select", "head/*", "--depth", "1", "--json"])
    data = json.loads(result.stdout)
    assert [r["address"] for r in data["rows"]] == ["head"] and data["depth"] == 1
    page = tmp_path / "t.html"
    result = CliRunner().invoke(cli, ["timeline", url, "--html", str(page)])
    assert result.exit_code == 0 and page.read_text().startswith("<!DOCTYPE html>")
    missing = CliRunner().invoke(cli, ["timeline", str(tmp_path / "nothing")])
    assert missing.exit_code == 2 and "no treestore store" in missing.stderr


def test_a_damaged_checkpoint_is_left_out_and_named_not_fatal(tmp_path):
    """One damaged manifest used to end the whole timeline with an error (exit 2)."""
    from tests.support import hostile

    url = str(tmp_path / "run")
    store = make_run(url, steps=4)
    hostile.damage_manifest(url, "step-1")
    t = store.timeline()
    assert t.checkpoints == ("step-0", "step-2", "step-3")
    ((name, problem),) = t.damaged
    assert name == "step-1" and "manifest of checkpoint 'step-1'" in problem
    assert t.to_json()["damaged"] == [{"name": "step-1", "problem": problem}]
    assert t.grouped(1).damaged == t.damaged
    result = CliRunner().invoke(cli, ["timeline", url])
    assert result.exit_code == 1, result.output
    assert result.stdout.startswith("3 checkpoints, 2 steps: step-0 -> step-3")
    assert f"damaged, left out: step-1: {problem}" in result.stdout
    page = tmp_path / "t.html"
    result = CliRunner().invoke(cli, ["timeline", url, "--json", "--html", str(page)])
    assert result.exit_code == 1 and json.loads(result.stdout)["damaged"][0]["name"] == "step-1"
    assert '<li data-checkpoint="step-1">step-1: ' in page.read_text()


def test_a_leaf_holding_inf_or_nan_shows_its_change_and_its_nonfinite_changes(tmp_path):
    """[inf, 1, 2] -> [inf, 5, 2] used to show as unchanged (rel L2 0.0: ‖a‖ = inf), and with NaN
    as absent; a change among the non-finite elements alone showed as unchanged."""
    url = str(tmp_path / "run")
    store = treestore.Store(url)
    for k, (x, y) in enumerate([([np.inf, 1, 2], [np.nan, 1, 2]), ([np.inf, 5, 2], [np.nan, 5, 2])]):
        z = np.array([1.0, 2.0, np.inf if k == 0 else -np.inf])
        store.save({"x": np.array(x), "y": np.array(y), "z": z}, f"s{k}")
    t = store.timeline()
    row = dict(zip(t.addresses, t.values, strict=True))
    assert row["x"] == row["y"] == (pytest.approx(4 / math.sqrt(5)),)
    odd = dict(zip(t.addresses, t.nonfinite, strict=True))
    assert odd == {"x": (0,), "y": (0,), "z": (1,)}  # z: only inf -> -inf
    assert row["z"] == (0.0,)  # its finite elements did not change
    text = CliRunner().invoke(cli, ["timeline", url, "--scale", "global"])
    assert text.exit_code == 0, text.output
    lines = {line.split()[0]: line for line in text.stdout.splitlines()[1:]}
    assert "█" in lines["x"] and "█" in lines["y"] and "·" not in lines["y"]
    assert "!" in lines["z"] and "non-finite changes in 1 step(s)" in lines["z"]
    data = json.loads(CliRunner().invoke(cli, ["timeline", url, "--json"]).stdout)
    assert {r["address"]: r["nonfinite"] for r in data["rows"]} == {"x": [0], "y": [0], "z": [1]}
    assert t.grouped(1).nonfinite == t.nonfinite
    page = t.to_html()
    assert 'data-nonfinite="1">' in page and "(+1 non-finite)" in page and 'class="cell nonfinite"' in page


class _Cells(HTMLParser):
    """The value table of a timeline page: address -> [data-value of each step]."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, list[float]] = {}
        self.body: dict[str, str] = {}
        self.rects = 0
        self._row: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "body":
            self.body = {k: v or "" for k, v in a.items()}
        elif tag == "tr" and "data-address" in a:
            self._row = a["data-address"] or ""
            self.rows[self._row] = []
        elif tag == "td" and "data-value" in a and self._row is not None:
            self.rows[self._row].append(float(a["data-value"] or "nan"))
        elif tag == "rect" and "cell" in (a.get("class") or ""):
            self.rects += 1


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def test_html_renders_in_a_headless_browser_with_the_diffs_numbers(tmp_path):
    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium on PATH (apt-get install chromium; .ci/install does)")
    url = str(tmp_path / "run")
    store = make_run(url, steps=4)
    page = tmp_path / "timeline.html"
    page.write_text(store.timeline().to_html(), encoding="utf-8")
    text = page.read_text()
    assert (
        "<script src" not in text
        and "<link" not in text
        and "http" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "").replace(url, "")
    )
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    dom = subprocess.run(
        [browser, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    cells = _Cells()
    cells.feed(dom)
    assert cells.body.get("data-rendered") == "true"  # the page's script ran
    assert int(cells.body["data-heatmap-width"]) > 0  # and the SVG was laid out
    assert int(cells.body["data-cells"]) == cells.rects == 5 * 3
    # Its numbers are `treestore diff --values`'s rel L2 for the same pairs.
    steps = [(f"step-{j}", f"step-{j + 1}") for j in range(3)]
    for j, (a, b) in enumerate(steps):
        out = CliRunner().invoke(cli, ["diff", f"{url}#{a}", f"{url}#{b}", "--values", "--json"])
        for leaf in json.loads(out.stdout)["leaves"]:
            if leaf["change"] is not None:
                assert cells.rows[leaf["address"]][j] == float(leaf["change"]["rel_l2"]), (leaf["address"], j)
            elif leaf["status"] == "unchanged" and leaf["address"] in cells.rows:
                assert cells.rows[leaf["address"]][j] == 0.0
    shot = tmp_path / "shot.png"
    subprocess.run(
        [browser, *flags, "--window-size=1000,800", f"--screenshot={shot}", page.as_uri()],
        capture_output=True,
        timeout=60,
        check=True,
    )
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 5000


def test_timeline_on_s3(s3_backend):
    url = s3_backend.url("run")
    store = make_run(url, steps=3, storage_options=s3_backend.storage_options)
    t = store.timeline(select="head/*")
    assert t.values[0] == (0.0, 1.0)


def test_levels() -> None:
    assert _heatmap.level(math.nan, 1.0) == -1 and _heatmap.level(1e-9, 1.0) == 1


def test_progress_moves_within_one_pair_of_checkpoints():
    """Two checkpoints (one step) whose changed leaf has 16 chunks: the bar advances chunk by
    chunk, not once at the end (it stood at 0 B until the whole step was done)."""
    url = f"memory://timeline-progress/{uuid.uuid4().hex}"
    w = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
    options = treestore.SaveOptions(chunk_size=256 * 1024)
    treestore.save(url, {"w": w}, "a", options=options)
    treestore.save(url, {"w": w + 1}, "b", options=options)
    calls: list[tuple[int, int]] = []
    treestore.Store(url).timeline(progress=lambda done, total: calls.append((done, total)))
    inside = {d for d, t in calls if 0 < d < t}
    assert len(inside) >= 15 and calls[-1][0] == calls[-1][1] == 2 * w.nbytes
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_timeline_takes_patterns_after_the_url_as_show_and_diff_do(tmp_path):
    url = str(tmp_path / "run")
    for step in range(3):
        treestore.save(url, {"a": {"w": np.full(8, float(step))}, "b": np.full(8, float(step))}, f"s{step}")
    for args in (["a/*"], ["--select", "a/*"]):
        r = CliRunner().invoke(cli, ["timeline", url, *args, "--json"])
        assert r.exit_code == 0, r.output
        assert [row["address"] for row in json.loads(r.stdout)["rows"]] == ["a/w"], args


def test_a_long_run_draws_changed_leaves_numbered_steps_and_names_the_rest():
    """105 leaves of which 3 change over 24 steps: 3 rows, a ruler every 10 steps, a key naming
    the checkpoints at the marks, and one line for the unchanged leaves (it printed 105 rows,
    102 of them "max 0", and no checkpoint labels)."""
    frozen = {f"frozen/{k:03d}": np.ones(4) for k in range(102)}
    t = treestore.types.Timeline(
        "memory://x",
        tuple(f"ckpt-{k}" for k in range(25)),
        ("a", "b", "c", *frozen),
        tuple([(0.1,) * 24] * 3 + [(0.0,) * 24] * 102),
        (4,) * 105,
    )
    lines = t.heatmap().splitlines()
    assert len(lines) == 1 + 1 + 3 + 2
    assert lines[1] == " " * 3 + "0         10        20"
    assert (
        lines[5]
        == "unchanged at every step: frozen/000, frozen/001, frozen/002, frozen/003, frozen/004 and 97 more"
    )
    assert lines[6] == (
        "steps: 0 ckpt-0 -> ckpt-1, 10 ckpt-10 -> ckpt-11, 20 ckpt-20 -> ckpt-21, 23 ckpt-23 -> ckpt-24"
    )


def test_the_html_page_has_a_colour_scale_and_each_rows_maximum():
    """A change of 8e-5 and one of 0.29 are drawn in the same brightest colour when each row is
    scaled to itself: the page says so, shows the colour bar, and writes each row's maximum at
    its end (it had no scale and no numbers beside the map)."""
    t = treestore.types.Timeline(
        "memory://x",
        ("a", "b", "c"),
        ("tiny", "big", "still"),
        ((8e-5, 0.0), (0.29, 0.1), (0.0, 0.0)),
        (4, 4, 4),
    )
    page = t.to_html()
    assert '<svg id="scale"' in page and "the row&#x27;s largest change" in page
    assert "Colours are scaled per row" in page
    tops = re.findall(r'<text class="top"[^>]*>([^<]*)</text>', page)
    assert tops == ["8e-05", "0.29", "unchanged"]
    everything = t.to_html(scale="global")
    assert "Colours are scaled to the largest change of all rows." in everything
    assert "0.29 (the largest of all)" in everything


def test_depth_must_be_a_positive_int():
    url = f"memory://treestore-tests/{uuid.uuid4().hex}"
    treestore.save(url, {"a": {"w": np.ones(3)}}, "s0")
    treestore.save(url, {"a": {"w": np.zeros(3)}}, "s1")
    store = treestore.Store(url)
    for depth in (0, "1", 1.0):
        with pytest.raises(treestore.InvalidInputError, match=r"^depth must be an int of at least 1, got "):
            store.timeline(depth=depth)
        with pytest.raises(treestore.InvalidInputError, match=r"^depth must be an int of at least 1, got "):
            store.timeline().grouped(depth)


def test_groups_pool_nan_and_inf_changes():
    """A group of leaves whose changes are all unknown (NaN: absent or not comparable) pools to
    NaN; one whose changes include an infinite one pools to inf."""
    t = treestore.types.Timeline(
        url="memory://x",
        checkpoints=("c0", "c1"),
        addresses=("a/x", "a/y", "b/x", "b/y"),
        values=((math.nan,), (math.nan,), (math.inf,), (0.5,)),
        sizes=(4, 4, 4, 4),
    )
    pooled = t.grouped(1)
    assert pooled.addresses == ("a", "b")
    assert math.isnan(pooled.values[0][0]) and pooled.values[1][0] == math.inf


def test_a_checkpoint_of_a_newer_format_stops_the_timeline(tmp_path):
    """A damaged checkpoint is left out; one of a format this treestore does not know is not
    damage, and the timeline says so rather than leave it out."""
    from tests.support import hostile

    url = str(tmp_path / "s")
    treestore.save(url, {"w": np.ones(3)}, "s0")
    treestore.save(url, {"w": np.zeros(3)}, "s1")
    hostile.mutate_v2_manifest(url, "s1", lambda rec, arrays: rec.update(version=3))
    with pytest.raises(treestore.UnsupportedFormatError, match="version 3"):
        treestore.Store(url).timeline()


def test_select_skips_the_pairs_its_patterns_match_nothing_in(tmp_path):
    url = str(tmp_path / "s")
    treestore.save(url, {"w": np.ones(3)}, "s0")
    treestore.save(url, {"w": np.zeros(3)}, "s1")
    treestore.save(url, {"w": np.zeros(3), "late": np.ones(2)}, "s2")
    treestore.save(url, {"w": np.zeros(3), "late": np.full(2, 3.0)}, "s3")
    t = treestore.Store(url).timeline(select="late")
    assert t.addresses == ("late",)
    assert math.isnan(t.values[0][0]) and math.isnan(t.values[0][1]) and t.values[0][2] == pytest.approx(2.0)
