"""The ``treestore`` command: every subcommand in-process (click's runner) and as a real process."""

from __future__ import annotations

import doctest
import json
import os
import subprocess
import sys
from pathlib import Path

import click
import numpy as np
import pytest
from click.testing import CliRunner

import treestore
from tests.support import hostile
from treestore_cli import context, render
from treestore_cli.main import cli, main

ROOT = Path(__file__).resolve().parent.parent.parent
W = (np.random.default_rng(11).standard_normal((256, 512)) * 0.02).astype(np.float32)  # 512 KiB


def tree(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {
        "params": {
            "layers": [
                {"w": W, "b": np.zeros(8, np.float32)},
                {"w": W + np.float32(step - 1) * rng.standard_normal(W.shape).astype(np.float32) * 0.01},
            ]
        },
        "step": step,
    }


@pytest.fixture
def store(tmp_path) -> str:
    url = str(tmp_path / "store")
    treestore.save(url, tree(1), "step-1", metadata={"step": 1})
    treestore.save(url, tree(2), "step-2", metadata={"step": 2})
    return url


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def error_line(result) -> str:
    """The one line an error prints on stderr."""
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("treestore: error: "), result.stderr
    return lines[0]


COMMANDS = [
    "ls",
    "show",
    "diff",
    "verify",
    "gc",
    "rm",
    "cp",
    "import",
    "export",
    "demo",
    "watch",
    "timeline",
    "derive",
]


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help(command):
    result = run(*([command] if command else []), "--help")
    assert result.exit_code == 0 and "Usage: treestore" in result.stdout
    if not command:
        assert all(c in result.stdout for c in COMMANDS) and "URL#NAME" in result.stdout


def test_ls(store):
    result = run("ls", store)
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["name", "created", "leaves", "raw", "stored", "shared", "metadata"]
    assert lines[1].startswith("step-1 ") and '{"step": 1}' in lines[1] and "1.0 MiB" in lines[1]
    assert lines[-1].startswith("2 checkpoint(s)")
    data = json.loads(run("ls", store, "--json").stdout)
    one, two = data["checkpoints"]
    assert one["name"] == "step-1" and one["leaves"] == 4 and one["metadata"] == {"step": 1}
    assert one["shared_bytes"] == two["shared_bytes"] > 0  # layer 0's w is in both
    assert data["total"]["stored_bytes"] < one["stored_bytes"] + two["stored_bytes"]


def test_show(store):
    result = run("show", f"{store}#step-1")
    assert result.exit_code == 0
    out = result.stdout
    assert "step-1" in out and "4 leaves" in out and 'metadata: {"step": 1}' in out
    assert "params/layers/\n" in out and "\n  0/\n" in out
    w = next(line for line in out.splitlines() if line.strip().startswith("w ") and "[256, 512]" in line)
    assert "float32" in w and "512.0 KiB" in w and "zstd" in w
    assert "= 1" in out  # the step counter's value
    flat = run("show", store, "params/layers/*/w", "--flat").stdout
    assert "params/layers/1/w" in flat and "/b" not in flat and "2 of 4 leaves shown" in flat
    data = json.loads(run("show", store, "--json").stdout)
    assert data["name"] == "step-2"  # the newest
    leaves = {x["address"]: x for x in data["leaves"]}
    assert leaves["params/layers/0/b"]["packed"] and leaves["step"]["value"] == 2
    assert (
        leaves["params/layers/0/w"]["shape"] == [256, 512] and leaves["params/layers/0/w"]["stored_bytes"] > 0
    )
    assert "nearest addresses" in error_line(run("show", store, "params/nope"))


def test_diff(store):
    same = run("diff", f"{store}#step-1", f"{store}#step-1")
    assert same.exit_code == 0 and "identical; 4 leaves unchanged" in same.stdout
    changed = run("diff", f"{store}#step-1", store)
    assert changed.exit_code == 1
    assert "~  params/layers/1/w" in changed.stdout and "1 changed, 1 leaves unchanged" not in changed.stdout
    assert changed.stdout.splitlines()[-1] == "2 changed; 2 leaves unchanged"
    stats = run("diff", f"{store}#step-1", f"{store}#step-2", "--values")
    assert stats.exit_code == 1 and "rel L2" in stats.stdout and "█" in stats.stdout
    row = next(line for line in stats.stdout.splitlines() if "params/layers/1/w" in line)
    assert row.rstrip().endswith("█" * 20)  # the largest change gets the full bar
    data = json.loads(run("diff", f"{store}#step-1", store, "--values", "--json").stdout)
    assert data["identical"] is False and data["counts"]["changed"] == 2
    (w,) = [x for x in data["leaves"] if x["address"] == "params/layers/1/w"]
    assert w["change"]["rel_l2"] > 0
    only = run("diff", f"{store}#step-1", store, "params/layers/0/*")
    assert only.exit_code == 0 and "identical" in only.stdout
    assert "missing" in error_line(run("diff", f"{store}#step-1", f"{store}#missing"))


def test_verify(store):
    ok = run("verify", store)
    assert ok.exit_code == 0 and "ok: every digest matches" in ok.stdout
    (path,) = hostile.chunk_paths(store, "step-2")["params/layers/1/w"]
    hostile.flip_byte(store, path, -1)
    bad = run("verify", store)
    assert bad.exit_code == 1
    assert "chunk_damaged" in bad.stdout and "params/layers/1/w" in bad.stdout
    data = json.loads(run("verify", store, "--json").stdout)
    assert data["ok"] is False
    assert [(p["checkpoint"], p["address"]) for p in data["problems"]] == [("step-2", "params/layers/1/w")]
    assert run("verify", f"{store}#step-1").exit_code == 0


def test_rm_gc_cp(store, tmp_path):
    assert "would remove 0 chunk(s)" in run("gc", store, "--dry-run").stdout
    removed = run("rm", f"{store}#step-2")
    assert removed.exit_code == 0 and f"removed {store}#step-2" in removed.stdout
    assert "treestore gc" in removed.stderr
    assert run("-q", "rm", f"{store}#step-1", "--json").stderr == ""
    treestore.save(store, tree(1), "step-1")
    young = json.loads(run("gc", store, "--json").stdout)
    assert young["chunks_removed"] == 0 and young["kept_young"] == 1
    freed = run("gc", store, "--grace", "0", "--wait", "1")
    assert freed.exit_code == 0 and "removed 1 chunk(s)" in freed.stdout
    dst = str(tmp_path / "copy")
    copied = run("cp", store, dst)
    assert copied.exit_code == 0 and f"copied step-1 to {dst}" in copied.stdout
    data = json.loads(run("cp", f"{store}#step-1", f"{dst}#renamed", "--json").stdout)
    assert data["copied"] == ["renamed"] and data["chunks_copied"] == 0
    assert "destination name" in error_line(run("cp", store, f"{dst}#renamed", "--all"))
    treestore.save(store, tree(2), "step-2")
    assert "already exists" in error_line(run("cp", f"{store}#step-2", f"{dst}#renamed"))


def test_import_export(tmp_path):
    f = tmp_path / "model.npz"
    np.savez(f, **{"encoder.layer.0.w": np.ones((2, 2), np.float32), "encoder.layer.0.b": np.zeros(2)})
    url = str(tmp_path / "store")
    imported = run("import", str(f), f"{url}#m", "--metadata", '{"run": 1}')
    assert imported.exit_code == 0 and "imported" in imported.stdout and "2 leaves" in imported.stdout
    assert 'encoder/layer/"0"/w' in run("show", url, "encoder/layer/0/*", "--flat").stdout  # quotes optional
    out = tmp_path / "out.safetensors"
    data = json.loads(run("export", f"{url}#m", str(out), "--json").stdout)
    assert data["tensors"] == 2 and out.exists()
    assert "exists" in error_line(run("export", url, str(out)))
    assert run("export", url, str(out), "--overwrite").exit_code == 0
    assert "no file or folder" in error_line(run("import", str(tmp_path / "nope.npz"), f"{url}#x"))
    assert "not JSON" in error_line(run("import", str(f), f"{url}#y", "--metadata", "{"))


def test_demo_is_rerunnable(tmp_path):
    folder = tmp_path / "demo"
    for _ in range(2):
        result = run("demo", str(folder))
        assert result.exit_code == 0, result.output
        out = result.stdout
        assert "wrote 17 chunk(s)" in out and "wrote 5 chunk(s)" in out and "reused 12" in out
        assert "bit-exact" in out and "$ treestore show" in out and "█" in out
        assert out.strip().splitlines()[-1].startswith("demo ok:")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert "not empty" in error_line(run("demo", str(tmp_path / "other")))


def test_demo_never_deletes_checkpoints_it_did_not_save(tmp_path):
    """A store of the user's own is refused, whatever it holds, and left exactly as it was; so is
    a demo store into which the user saved a checkpoint of their own."""
    mine = tmp_path / "mine"
    treestore.save(str(mine), {"w": np.arange(3.0)}, "run-7")
    before = sorted(p.relative_to(mine) for p in mine.rglob("*"))
    line = error_line(run("demo", str(mine)))
    assert "1 checkpoint(s) the demo did not save (run-7)" in line and "treestore demo DIR" in line
    assert sorted(p.relative_to(mine) for p in mine.rglob("*")) == before
    demo = tmp_path / "demo"
    assert run("demo", str(demo)).exit_code == 0
    treestore.save(str(demo), {"w": np.arange(3.0)}, "mine", metadata={"note": "mine"})
    assert "(mine)" in error_line(run("demo", str(demo)))
    assert [c.name for c in treestore.Store(str(demo)).list()] == ["step-1", "step-2", "mine"]


def test_a_folder_that_is_no_store_is_named_so_by_every_command(tmp_path):
    """Reading commands say there is no store at a path that is not one, in one wording, and
    never that an absent folder has "no checkpoints in it"."""
    (tmp_path / "empty").mkdir()
    for where in (tmp_path / "missing", tmp_path / "empty"):
        for command in (["show"], ["ls"], ["health"], ["timeline"], ["verify"], ["diff", str(where)]):
            line = error_line(run(*command, str(where)))
            assert line == f"treestore: error: no treestore store at {where}", (command, line)


def test_global_options_go_anywhere(tmp_path):
    """-q, --debug and -o work after the subcommand and its arguments too."""
    assert run("demo", str(tmp_path / "d"), "-q").exit_code == 0
    result = run("ls", str(tmp_path / "d"), "-q", "--debug", "-o", "auto_mkdir=true", "--json")
    assert result.exit_code == 0, result.output
    assert [c["name"] for c in json.loads(result.stdout)["checkpoints"]] == ["step-1", "step-2"]
    assert "no treestore store" in error_line(run("ls", str(tmp_path / "nope"), "-q"))


def test_gc_right_after_rm_names_the_grace_option(tmp_path):
    folder = str(tmp_path / "d")
    assert run("demo", folder).exit_code == 0
    assert run("rm", f"{folder}#step-2").exit_code == 0
    out = run("gc", folder).stdout
    assert "removed 0 chunk(s)" in out and "younger than 600 s" in out and "`--grace 0`" in out
    out = run("gc", folder, "--grace", "0").stdout
    assert "removed 5 chunk(s) and 1 manifest(s)" in out and "younger" not in out


def test_help_texts_print_no_rst_markup():
    for name in cli.commands:
        text = run(name, "--help").output
        assert "``" not in text and ":class:" not in text and ":meth:" not in text, name


def test_errors_name_the_flags_not_the_library_arguments(tmp_path):
    folder = str(tmp_path / "d")
    assert run("demo", folder).exit_code == 0
    assert run("export", folder, str(tmp_path / "w.npz")).exit_code == 0
    line = error_line(run("export", folder, str(tmp_path / "w.npz")))
    assert "pass --overwrite to replace it" in line and "overwrite=True" not in line
    line = error_line(run("export", folder, str(tmp_path / "w.bin")))
    assert "say which with --format" in line and "format=" not in line
    line = error_line(run("derive", f"{folder}#step-1", "step-2"))
    assert "pass --overwrite" in line and "overwrite=True" not in line, line


def test_errors(tmp_path):
    assert "no treestore store" in error_line(run("ls", str(tmp_path / "missing")))
    assert "no treestore store" in error_line(run("gc", str(tmp_path / "missing")))
    assert not (tmp_path / "missing").exists()
    assert "no treestore store at" in error_line(run("show", str(tmp_path / "missing")))
    assert "nosuchproto" in error_line(run("ls", "nosuchproto://x"))
    assert "No such command" in error_line(run("frobnicate"))
    assert "KEY=VALUE" in error_line(run("-o", "bad", "ls", str(tmp_path)))
    assert "name the checkpoint" in error_line(run("rm", str(tmp_path)))
    debug = run("--debug", "show", str(tmp_path / "missing"))
    assert debug.exit_code == 2 and "Traceback" in debug.stderr
    assert main(["show", str(tmp_path / "missing")]) == 2
    assert main(["--version"]) == 0


def test_storage_options_reach_the_filesystem(store, monkeypatch):
    """What -o gives arrives, unchanged, where fsspec builds the filesystem (the real one is
    built from it: LocalFileSystem takes auto_mkdir)."""
    import fsspec.core

    seen = []
    real = fsspec.core.url_to_fs

    def recording(url, **options):
        fs, root = real(url, **options)
        seen.append((options, fs))
        return fs, root

    monkeypatch.setattr(fsspec.core, "url_to_fs", recording)
    assert run("-o", "auto_mkdir=true", "ls", store).exit_code == 0
    assert seen and all(options == {"auto_mkdir": True} for options, _ in seen)
    assert all(fs.auto_mkdir is True for _, fs in seen)


def test_progress_bar_only_on_a_terminal(monkeypatch, capsys):
    with context.progress("x") as bar:
        assert bar is None  # pytest's stderr is not a terminal
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    with context.progress("x") as bar:
        assert bar is not None
        bar(5, 10)
        bar(10, 10)
    assert "x" in capsys.readouterr().err


def test_render_doctests():
    assert doctest.testmod(render).failed == 0


# --- as real processes ---------------------------------------------------------------------------
def command() -> list[str]:
    installed = Path(sys.executable).parent / "treestore"
    return [str(installed)] if installed.exists() else [sys.executable, "-m", "treestore"]


def proc(*args: str, entry: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "error::DeprecationWarning:cli"}
    return subprocess.run(
        [*(entry or command()), *args], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env
    )


def test_process_demo_verify_and_diff(tmp_path):
    folder = tmp_path / "demo"
    demo = proc("demo", str(folder), entry=[sys.executable, "-m", "treestore"])
    assert demo.returncode == 0, demo.stderr
    assert "bit-exact" in demo.stdout and demo.stdout.strip().splitlines()[-1].startswith("demo ok:")
    url = str(folder)
    (path,) = hostile.chunk_paths(url, "step-2")["params/layers/2/w"][:1]
    hostile.flip_byte(url, path, 40)
    verify = proc("verify", url, "--json")
    assert verify.returncode == 1, verify.stderr
    problems = json.loads(verify.stdout)["problems"]
    assert {(p["checkpoint"], p["address"], p["kind"]) for p in problems} == {
        ("step-2", "params/layers/2/w", "chunk_damaged")
    }
    diff = proc("diff", f"{url}#step-1", f"{url}#step-1")
    assert diff.returncode == 0 and "identical" in diff.stdout


def test_process_errors():
    bad = proc("ls", "nosuchproto://x")
    assert bad.returncode == 2 and bad.stdout == ""
    (line,) = bad.stderr.strip().splitlines()
    assert line.startswith("treestore: error: not a usable store URL 'nosuchproto://x'")


def test_gc_with_a_damaged_checkpoint_keeps_everything_and_says_why(store):
    import pathlib

    manifests = sorted(pathlib.Path(store, "manifests").iterdir())
    manifests[0].write_bytes(b"damaged")
    before = sorted(p for p in pathlib.Path(store).rglob("*") if p.is_file())
    result = run("gc", "--grace", "0", store)
    assert result.exit_code == 0, result.output
    assert "damaged checkpoint(s)" in result.stdout and "step-" in result.stdout
    assert sorted(p for p in pathlib.Path(store).rglob("*") if p.is_file()) == before


def test_ls_lists_every_readable_checkpoint_and_marks_a_damaged_one(store):
    """One damaged manifest used to end ls with an error and list nothing (exit 2)."""
    hostile.damage_manifest(store, "step-1")
    result = run("ls", store)
    assert result.exit_code == 1, result.output
    lines = result.stdout.splitlines()
    one = next(line for line in lines if line.startswith("step-1 "))
    two = next(line for line in lines if line.startswith("step-2 "))
    assert "damaged" in one and '{"step": 1}' in one
    assert "damaged" not in two and "1.0 MiB" in two
    assert "2 checkpoint(s), 1 damaged" in result.stdout
    assert lines[-1].startswith("damaged: step-1: manifest of checkpoint 'step-1'")
    listed = run("ls", store, "--json")
    assert listed.exit_code == 1
    data = json.loads(listed.stdout)
    bad, good = data["checkpoints"]
    assert bad["name"] == "step-1" and "manifest" in bad["problem"] and bad["stored_bytes"] is None
    assert good["name"] == "step-2" and good["problem"] is None and good["stored_bytes"] > 0
    assert data["total"]["damaged"] == 1
    (Path(store) / "checkpoints" / "step-2").write_bytes(b"\x93garbage")  # a damaged commit record
    result = run("ls", store)
    assert result.exit_code == 1 and "2 checkpoint(s), 2 damaged" in result.stdout
    assert "damaged: step-2: commit record of checkpoint 'step-2'" in result.stdout
    rows = {r["name"]: r for r in json.loads(run("ls", store, "--json").stdout)["checkpoints"]}
    assert rows["step-2"]["created"] is None and "commit record" in rows["step-2"]["problem"]


EXTREME_CREATED = [1e300, -1e300, float("inf"), float("-inf"), float("nan"), 2**64 - 1, -(2**63), -1e10, 0]
EXTREME_METADATA = {"k": [b"\xff", 2**64 - 1, -(2**63), float("nan")], "m": {b"raw": float("-inf")}}


@pytest.mark.parametrize("created", EXTREME_CREATED, ids=repr)
def test_every_command_renders_the_extreme_values_a_record_may_hold(store, created):
    """A creation time no date can show (1e300 used to raise OverflowError in ls, show and watch),
    NaN (which used to make the checkpoint 'damaged'), and metadata with bytes keys (a TypeError)
    render as their raw values in every command."""

    def extreme(m):
        m["created"] = created
        m["metadata"] = EXTREME_METADATA

    hostile.mutate_manifest(store, "step-2", extreme)
    shown = repr(float(created))
    for args in (
        ["ls", store],
        ["ls", store, "--json"],
        ["show", f"{store}#step-2"],
        ["show", f"{store}#step-2", "--json"],
        ["watch", store, "--timeout", "0"],
        ["watch", store, "--timeout", "0", "--json"],
        ["timeline", store],
        ["timeline", store, "--json"],
    ):
        result = run(*args)
        assert result.exit_code == 0, (args, result.output)
        assert "step-2" in result.stdout and (args[0] == "show" or "step-1" in result.stdout), args
        if args[0] in ("ls", "show", "watch") and "--json" not in args and abs(float(created)) >= 1e12:
            assert f"{shown} s" in result.stdout, (args, result.stdout)


@pytest.mark.parametrize(
    "raised, code, line",
    [
        (RuntimeError("boom"), 2, "treestore: error: RuntimeError: boom (run with --debug for a traceback)"),
        (KeyboardInterrupt(), 130, "treestore: interrupted"),
        (click.Abort(), 2, "treestore: error: aborted"),
        (click.ClickException("a click failure"), 2, "treestore: error: a click failure"),
        (
            PermissionError(13, "Permission denied", "/x"),
            2,
            "treestore: error: [Errno 13] Permission denied: '/x'",
        ),
    ],
    ids=["bug", "interrupt", "abort", "click", "oserror"],
)
def test_every_failure_ends_as_one_line_and_its_exit_status(tmp_path, monkeypatch, raised, code, line):
    """Whatever a command raises, the command line prints one line (a traceback only with
    --debug) and exits 2, or 130 when interrupted."""
    treestore.save(str(tmp_path / "s"), {"w": np.arange(3.0)}, "a")

    def fail(self, *args, **kwargs):
        raise raised

    monkeypatch.setattr(treestore.Store, "list", fail)
    result = run("ls", str(tmp_path / "s"))
    assert result.exit_code == code and result.stderr.strip().splitlines() == [line], result.stderr
    if code == 2 and not isinstance(raised, click.Abort):
        debug = run("ls", str(tmp_path / "s"), "--debug")
        assert "Traceback (most recent call last)" in debug.stderr and debug.stderr.strip().endswith(line)


def test_bare_treestore_prints_its_help_and_exits_0():
    result = run()
    assert (
        result.exit_code == 0
        and "Usage: treestore" in result.stdout
        and "Try `treestore demo` first" in result.stdout
    )


def test_the_demo_fails_loudly_when_what_it_loads_is_not_what_it_saved(tmp_path, monkeypatch):
    """The demo's own check, that step-2 loads back bit-exactly, is not decoration: when the tree
    it compares against is not the one it saved, it stops with an error, not "demo ok"."""
    import jax

    from treestore_cli import commands_demo

    made = commands_demo.params
    calls = []

    def drifting(step):  # the third call, the comparison's, differs from what was saved
        calls.append(step)
        tree = made(step)
        return jax.tree.map(lambda x: x + 1, tree) if len(calls) == 3 else tree

    monkeypatch.setattr(commands_demo, "params", drifting)
    line = error_line(run("demo", str(tmp_path / "demo")))
    assert "step-2 did not load back bit-exactly" in line and calls == [1, 2, 2]
