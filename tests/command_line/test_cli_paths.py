"""The ``treestore`` command's less travelled paths: their exit statuses and what they print."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import msgpack
import numpy as np
import safetensors.numpy
from click.testing import CliRunner

import treestore
from tests.support.helpers import assert_tree_equal
from treestore_cli.main import cli

TREE = {"a": np.arange(6.0), "b": {"c": np.ones(3, np.int32)}, "n": 3}


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def saved(tmp_path: Path) -> str:
    url = str(tmp_path / "store")
    treestore.save(url, TREE, "base")
    return url


def test_derive_needs_a_named_base(tmp_path):
    url = saved(tmp_path)
    r = run("derive", url, "new", "--drop", "n")
    assert r.exit_code == 2, r.output
    assert f"name the base checkpoint: {url}#BASE" in r.output
    assert [c.name for c in treestore.Store(url).list()] == ["base"]


def test_derive_as_json(tmp_path):
    url = saved(tmp_path)
    r = run("derive", f"{url}#base", "new", "--drop", "n", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["base"] == "base" and out["name"] == "new" and out["leaves"] == 2, out
    assert out["url"] == treestore.Store(url).url
    back = treestore.load(url, "new")
    assert set(back) == {"a", "b"} and np.array_equal(back["a"], TREE["a"])


def test_import_as_json(tmp_path):
    file = tmp_path / "w.safetensors"
    safetensors.numpy.save_file({"x": np.arange(4, dtype=np.float32)}, str(file))
    url = str(tmp_path / "store")
    r = run("import", str(file), f"{url}#w", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["file"] == str(file) and out["name"] == "w" and out["leaves"] == 1, out
    assert np.array_equal(treestore.load(url, "w")["x"], np.arange(4, dtype=np.float32))


def test_copy_of_a_checkpoint_already_there_says_so(tmp_path):
    url = saved(tmp_path)
    dst = str(tmp_path / "dst")
    first = run("cp", f"{url}#base", dst)
    assert first.exit_code == 0 and f"copied base to {treestore.Store(dst).url}" in first.output, first.output
    again = run("cp", f"{url}#base", dst)
    assert again.exit_code == 0, again.output
    assert f"base is already in {treestore.Store(dst).url} with the same contents" in again.output
    assert "0 chunk(s) transferred" in again.output
    assert_tree_equal(treestore.load(dst, "base"), TREE)


def test_gc_names_the_stale_locks_it_removes(tmp_path):
    url = saved(tmp_path)
    old = Path(url) / "locks" / f"save-{uuid.uuid4().hex}"  # left by a process that died
    old.parent.mkdir(exist_ok=True)
    old.write_bytes(
        msgpack.packb({"kind": "save", "created": time.time() - 7200, "host": "elsewhere", "pid": 1})
    )
    past = time.time() - 7200
    os.utime(old, (past, past))
    dry = run("gc", url, "--dry-run")
    assert dry.exit_code == 0 and "would remove 1 stale lock(s)" in dry.output, dry.output
    assert old.exists()
    r = run("gc", url)
    assert r.exit_code == 0 and "removed 1 stale lock(s)" in r.output, r.output
    assert not old.exists()
    assert_tree_equal(treestore.load(url, "base"), TREE)


def test_timeline_html_does_not_go_with_norms(tmp_path):
    url = saved(tmp_path)
    page = tmp_path / "t.html"
    r = run("timeline", url, "--norms", "--html", str(page))
    assert r.exit_code == 2, r.output
    assert "--html draws changes; it does not go with --norms" in r.output
    assert not page.exists()


def test_an_error_of_several_lines_keeps_one_problem_a_line(tmp_path):
    url = str(tmp_path / "store")
    treestore.save(url, {"x": {True: np.ones(2), 3: np.ones(1)}, "s": "text"}, "c")
    r = run("export", f"{url}#c", str(tmp_path / "w.safetensors"))
    assert r.exit_code == 2, r.output  # the input is refused: a usage error
    lines = r.stderr.splitlines()
    assert lines[0] == "treestore: error: cannot export 2 leaves:", lines
    assert lines[1:] == [
        "  s: a Python str is not an array; this format holds arrays only",
        "  x/{true}: a key of this path cannot be a key name (bool or index key)",
    ], lines
    assert not (tmp_path / "w.safetensors").exists()


def test_nothing_after_a_double_dash_is_a_global_option(tmp_path):
    """``--`` ends the options: what follows is an argument even where it looks like -q."""
    url = saved(tmp_path)
    quiet = run("ls", url, "-q")
    assert quiet.exit_code == 0
    r = run("ls", "--", url)
    assert r.exit_code == 0 and "base" in r.output, r.output
    odd = run("ls", "--", "-q")
    assert odd.exit_code == 2 and "no treestore store" in odd.stderr, odd.output


def test_health_patterns_that_match_nothing_in_a_checkpoint_are_passed_over(tmp_path):
    url = str(tmp_path / "store")
    treestore.save(url, {"a": np.array([1.0, np.nan]), "c": np.ones(2)}, "bad")
    named = run("health", url, "zzz", "a", "--json")
    assert named.exit_code == 1, named.output
    out = json.loads(named.output)
    assert out["first_nonfinite"] == {"a": "bad"} and out["checkpoints"][0]["nonfinite"] == ["a"], out
    other = run("health", url, "zzz", "c", "--json")
    assert other.exit_code == 0, other.output  # the NaN is in a leaf the patterns leave out
    assert json.loads(other.output)["checkpoints"][0]["healthy"] is True
