"""Start-up: ``import treestore`` and the commands that only read manifests never import jax, nor
ml_dtypes (whose newest releases take most of a second to import).

Each check runs in a fresh interpreter (this one imported jax long ago) and looks at
``sys.modules`` once the work is done; save and load in such an interpreter import jax when a
tree needs it, and give back what was saved.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from jax.tree_util import DictKey, GetAttrKey, SequenceKey

import treestore

ROOT = Path(__file__).resolve().parent.parent.parent
Pair = namedtuple("Pair", ["left", "right"])

# The modules of jax and ml_dtypes loaded in the child, printed as its last line of output.
HEAVY = ("jax", "jaxlib", "ml_dtypes")
LOADED = (
    "\nimport json, sys\n"
    f"print(json.dumps(sorted(m for m in sys.modules if m.partition('.')[0] in {HEAVY!r})))\n"
)


def child(code: str) -> tuple[list[str], str]:
    """Run ``code`` in a fresh interpreter: (the jax modules it loaded, the rest of its stdout)."""
    done = subprocess.run(
        [sys.executable, "-c", code + LOADED], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    *out, last = done.stdout.strip().splitlines()
    return json.loads(last), "\n".join(out)


def command(*args: str, status: int = 0) -> str:
    """The output of ``treestore ARGS`` run in a fresh interpreter, which must not load jax."""
    code = (
        "import sys\nfrom treestore_cli.main import main\n"
        f"status = main({list(args)!r})\nassert status == {status}, status\n"
    )
    loaded, out = child(code)
    assert loaded == [], f"treestore {' '.join(args)} imported {loaded[:3]}"
    return out


def tree(step: int) -> dict:
    w = np.arange(24, dtype=np.float32).reshape(4, 6) * step
    return {
        "params": {"w": w, "b": np.zeros(6, np.float32), "j": jnp.arange(3.0) * step},
        "pair": Pair(np.int64(step), "text"),
        "step": step,
    }


@pytest.fixture
def store(tmp_path) -> str:
    url = str(tmp_path / "store")
    treestore.save(url, tree(1), "step-1", metadata={"step": 1})
    treestore.save(url, tree(2), "step-2", metadata={"step": 2})
    return url


def test_import_treestore_loads_no_jax():
    loaded, _ = child("import treestore, treestore.errors, treestore.types")
    assert loaded == []


def test_python_m_treestore_loads_no_jax():
    loaded, out = child(
        "import runpy, sys\nsys.argv = ['treestore', '--version']\n"
        "try:\n    runpy.run_module('treestore', run_name='__main__')\n"
        "except SystemExit as exc:\n    assert exc.code == 0, exc.code\n"
    )
    assert loaded == [] and treestore.__version__ in out


def test_ls_and_show_load_no_jax(store):
    assert "step-2" in command("ls", store)
    assert json.loads(command("ls", store, "--json"))["total"]["checkpoints"] == 2
    shown = command("show", f"{store}#step-1")
    assert "params" in shown and "float32" in shown
    leaves = json.loads(command("show", store, "params/*", "--json"))["leaves"]
    assert {leaf["address"] for leaf in leaves} == {"params/w", "params/b", "params/j"}


def test_diff_and_verify_load_no_jax(store):
    assert "identical" in command("diff", f"{store}#step-1", f"{store}#step-1")
    changed = json.loads(command("diff", f"{store}#step-1", f"{store}#step-2", "--json", status=1))
    assert changed["counts"]["changed"] == 4  # params/w, params/j, pair/0 and step
    stats = json.loads(command("diff", f"{store}#step-1", f"{store}#step-2", "--values", "--json", status=1))
    assert {leaf["address"] for leaf in stats["leaves"] if leaf["change"]} >= {"params/w", "params/j"}
    assert "checked 2 checkpoints" in command("verify", store)


# What reading a store never needs: the save, load and derive engines, timelines.
WRITERS = (
    "treestore._engine.write",
    "treestore._engine.reading.load",
    "treestore._api.derive",
    "treestore._format.manifest.node_edit",
    "treestore._api.inspection.timeline",
    "treestore._api.inspection.norms",
)


@pytest.mark.parametrize("args", [("ls",), ("show",), ("diff",)], ids=["ls", "show", "diff"])
def test_reading_commands_import_no_save_load_or_derive_engine(store, args):
    """ls, show and diff of a store run as the first command of a shell: they pay for reading
    manifests, not for importing the engines that write, load or derive checkpoints."""
    spec = [store] if args == ("ls",) else [f"{store}#step-1"] * (2 if args == ("diff",) else 1)
    code = (
        "import json, sys\nfrom treestore_cli.main import main\n"
        f"main({[*args, *spec]!r})\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m in {WRITERS!r})))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_gc_rm_and_cp_load_no_jax(store, tmp_path):
    assert "would remove 0 chunk(s)" in command("gc", store, "--dry-run")
    dst = str(tmp_path / "copy")
    assert f"copied step-1 to {dst}" in command("cp", f"{store}#step-1", dst)
    assert f"removed {store}#step-1" in command("rm", f"{store}#step-1")
    assert json.loads(command("gc", store, "--grace", "0", "--json"))["chunks_removed"] > 0
    assert [i.name for i in treestore.Store(dst).list()] == ["step-1"]
    assert [i.name for i in treestore.Store(store).list()] == ["step-2"]


def test_a_numpy_tree_saves_and_loads_without_importing_jax(tmp_path):
    """Only a process that imported jax can be one of a jax.distributed job: a save of numpy
    arrays and Python values must not import jax (1-1.5 s) to ask how many processes there are.
    (A ``like=`` template is a jax pytree: flattening it imports jax.)"""
    url = str(tmp_path / "plain")
    code = f"""
import numpy as np
import treestore
treestore.save({url!r}, {{"w": np.ones(3), "n": 7, "s": {{"t": "x"}}}}, "plain")
treestore.Store({url!r}).save({{"w": np.zeros(3)}}, "second", options=treestore.SaveOptions(threads=4))
assert treestore.load({url!r} + "#plain")["n"] == 7
assert treestore.load({url!r} + "#second")["w"].tolist() == [0.0, 0.0, 0.0]
print("ok")
"""
    loaded, out = child(code)
    assert out == "ok" and loaded == [], loaded[:3]


def test_save_and_load_import_jax_when_the_tree_needs_it(store, tmp_path):
    """A fresh interpreter saves a tree with a jax array and a namedtuple, loads it back with and
    without a template, and loads the jax leaf a parent process saved: treestore imports jax
    itself on the way (the child imports it only to check the result)."""
    url = str(tmp_path / "fresh")
    code = f"""
import sys, collections
import numpy as np
import treestore
assert "jax" not in sys.modules
Pair = collections.namedtuple("Pair", ["left", "right"])
treestore.save({url!r}, {{"w": np.ones(3), "n": 7}}, "plain")
assert treestore.load({url!r} + "#plain")["n"] == 7
assert treestore.open({store!r} + "#step-2")["params/j"].read().tolist() == [0.0, 2.0, 4.0]
loaded = treestore.load({store!r} + "#step-2")
import jax
assert isinstance(loaded["params"]["j"], jax.Array), type(loaded["params"]["j"])
assert loaded["params"]["j"].tolist() == [0.0, 2.0, 4.0]
tree = {{"p": Pair(jax.numpy.ones(2), np.zeros(2)), "k": jax.random.key(0)}}
treestore.save({url!r}, tree, "jax")
again = treestore.load({url!r} + "#jax", like=tree)
assert type(again["p"]) is Pair and isinstance(again["p"].left, jax.Array)
assert again["p"].left.tolist() == [1.0, 1.0]
assert type(treestore.load({url!r} + "#jax", types=[Pair])["p"]) is Pair
print("ok")
"""
    loaded, out = child(code)
    assert out == "ok" and "jax" in loaded


def test_parse_address_still_gives_jax_key_entries():
    """The public parse_address returns jax's own key classes, equal to them from either side."""
    path = (DictKey("params"), SequenceKey(0), GetAttrKey("w"))
    assert path == treestore.parse_address("params/0/.w")
    assert [type(k) for k in treestore.parse_address("params/0/.w")] == [type(k) for k in path]
    assert treestore.format_address(path) == "params/0/.w"


@pytest.mark.parametrize("args", [("ls",), ("show",), ("diff",)], ids=["ls", "show", "diff"])
def test_reading_commands_on_a_local_store_import_no_fsspec(store, args):
    """A store given by a plain path opens without fsspec (a tenth of a second of start-up):
    ls, show and diff read its manifests through ``os`` alone."""
    spec = [store] if args == ("ls",) else [f"{store}#step-1"] * (2 if args == ("diff",) else 1)
    code = (
        "import json, sys\nfrom treestore_cli.main import main\n"
        f"main({[*args, *spec]!r})\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.partition('.')[0] == 'fsspec')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
