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


def _doc_table(path: Path, heading: str) -> list[tuple[str, str]]:
    """(first cell, second cell) of each body row of the first table under ``heading``."""
    lines = path.read_text(encoding="utf-8").splitlines()
    rows: list[tuple[str, str]] = []
    for line in lines[lines.index(heading) + 1 :]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows.append((cells[0], cells[1] if len(cells) > 1 else ""))
        elif rows:
            break
    assert len(rows) > 2, f"no table under {heading!r} in {path.name}"
    return rows[2:]


def _flags(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", text))


def test_cli_page_names_the_commands_options_and_flags_that_exist() -> None:
    """docs/cli.md's command table lists exactly the commands, its global options table exactly
    the group's options, and every flag a command's row mentions is one of that command's."""
    page = ROOT / "docs" / "cli.md"
    rows = _doc_table(page, "## Commands")
    names = [re.match(r"`treestore ([\w-]+)", cell) for cell, _ in rows]
    assert all(names), [cell for (cell, _), m in zip(rows, names, strict=True) if not m]
    commands = [m.group(1) for m in names if m]
    assert sorted(commands) == sorted(cli.commands), (
        f"missing: {sorted(set(cli.commands) - set(commands))}, "
        f"not commands: {sorted(set(commands) - set(cli.commands))}"
    )
    for (cell, text), name in zip(rows, commands, strict=True):
        params = cli.commands[name].params
        known = {o for p in params for o in (*p.opts, *p.secondary_opts)}
        unknown = _flags(cell + " " + text.split(", e.g.")[0]) - known
        assert not unknown, f"treestore {name}: the page names {sorted(unknown)}, which it does not take"
    listed = set().union(*(_flags(cell) for cell, _ in _doc_table(page, "## Global options and exit status")))
    assert listed == {o for p in cli.params for o in (*p.opts, *p.secondary_opts)}
