"""More of the command line: ``show --stats`` of leaves saved without statistics."""

from __future__ import annotations

import numpy as np
from click.testing import CliRunner

import treestore
from treestore_cli.main import cli


def test_show_stats_of_leaves_without_statistics_marks_them_unknown(tmp_path):
    url = str(tmp_path / "store")
    tree = {"w": np.arange(4.0), "z": np.array([1 + 2j])}
    treestore.save(url, tree, "c")
    treestore.save(url, tree, "none", options=treestore.SaveOptions(stats=False))
    r = CliRunner().invoke(cli, ["show", f"{url}#none", "--stats", "--flat"])
    assert r.exit_code == 0, r.output
    rows = {
        line.split()[0]: line.split()[1:] for line in r.output.splitlines() if line.startswith(("w ", "z "))
    }
    assert rows == {"w": ["?"], "z": ["?"]}, r.output
    r = CliRunner().invoke(cli, ["show", f"{url}#c", "--stats", "--flat"])
    assert r.exit_code == 0, r.output
    rows = {
        line.split()[0]: line.split()[1:] for line in r.output.splitlines() if line.startswith(("w ", "z "))
    }
    assert rows["w"] == ["float64", "0", "0", "0", "3", "3.74166"], r.output  # recorded: shown
    assert rows["z"][0] == "complex128", r.output
