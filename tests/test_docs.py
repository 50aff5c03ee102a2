"""The README's tables of the API and of the command line name exactly what exists, and the
documentation site's navigation names every page: a name added, renamed or removed in the code
fails here until the front door says so too."""

from __future__ import annotations

import re
from pathlib import Path

import treestore
from treestore_cli.main import cli

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def _table_after(heading: str) -> list[str]:
    """The first cell of each body row of the first table under ``heading``, backticks removed."""
    lines = README.read_text(encoding="utf-8").splitlines()
    start = lines.index(heading)
    rows: list[str] = []
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            rows.append(line.strip("|").split("|")[0].strip())
        elif rows:
            break
    assert len(rows) > 2, f"no table under {heading!r} in README.md"
    body = rows[2:]  # the header row and the |---| row
    return [re.sub(r"^`(.*)`$", r"\1", cell) for cell in body]


def test_readme_api_table_is_treestore_all() -> None:
    listed = _table_after("## The API at a glance")
    twice = sorted({n for n in listed if listed.count(n) > 1})
    assert not twice, f"listed twice: {twice}"
    assert not set(treestore.__all__) - set(listed), "public names missing from the README's API table"
    assert not set(listed) - set(treestore.__all__), "README's API table names what treestore does not export"
    for name in listed:
        getattr(treestore, name)  # every name listed resolves


def test_readme_cli_table_is_the_commands() -> None:
    listed = _table_after("## The command line at a glance")
    assert all(cell.startswith("treestore ") for cell in listed), listed
    commands = [cell.removeprefix("treestore ") for cell in listed]
    assert len(commands) == len(set(commands))
    assert set(commands) == set(cli.commands), (
        f"missing: {sorted(set(cli.commands) - set(commands))}, "
        f"not commands: {sorted(set(commands) - set(cli.commands))}"
    )


def test_mkdocs_nav_names_every_page() -> None:
    """A page left out of the navigation is built but unreachable; one named but absent breaks
    the build."""
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = set(re.findall(r":\s*([\w/]+\.md)\s*$", config, re.MULTILINE))
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert nav == pages
