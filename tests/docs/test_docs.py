"""The README's tables of the API and of the command line name exactly what exists, the
documentation site's navigation names every page, and the docstring of every public name lists
its arguments and says what it returns: a name added, renamed or removed in the code fails here
until the front door says so too."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

import treestore
from treestore import errors, types
from treestore_cli.main import cli

ROOT = Path(__file__).resolve().parent.parent.parent
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


# --- docstrings of the public API -----------------------------------------------------------------
# Every public callable's docstring (Google style, as docs/api.md renders it) lists each of its
# parameters under ``Args:`` (for a dataclass, ``Args:`` or ``Attributes:``: its fields are both),
# and one that returns something says what under ``Returns:`` (or ``Yields:``). ``*args`` and
# ``**kwargs`` are listed with their stars. A constructor's parameters are listed in the docstring
# of the class that defines ``__init__`` (or of that ``__init__``): an error class that inherits
# TreestoreError's constructor is documented by TreestoreError's docstring.

_SECTION = re.compile(r"^(?P<indent> *)(?P<name>[A-Z][A-Za-z ]*):\s*$")
_ENTRY = re.compile(r"^(?P<name>\*{0,2}\w+)(?: \([^)]*\))?:")


def _sections(doc: str) -> dict[str, list[str]]:
    """The entries (``name:`` lines) of each Google-style section of a docstring, by section."""
    found: dict[str, list[str]] = {}
    lines = inspect.cleandoc(doc).splitlines()
    k = 0
    while k < len(lines):
        header = _SECTION.match(lines[k])
        k += 1
        if header is None:
            continue
        indent, entries, body = len(header["indent"]), found.setdefault(header["name"], []), None
        while k < len(lines) and (not lines[k].strip() or len(lines[k]) - len(lines[k].lstrip()) > indent):
            line = lines[k]
            if line.strip():
                depth = len(line) - len(line.lstrip())
                body = depth if body is None else body
                entry = _ENTRY.match(line.strip())
                if depth == body:
                    entries.append(entry["name"] if entry else line.strip())
            k += 1
    return found


def _public_callables() -> dict[str, Any]:
    """Every public function, class and method, by the name a caller writes: the names of
    ``treestore.__all__``, every class of :mod:`treestore.errors` and :mod:`treestore.types`, and
    the public methods (not properties) those classes define."""
    found: dict[str, Any] = {}
    seen: set[int] = set()

    def add(qualname: str, obj: Any) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        found[qualname] = obj
        if not inspect.isclass(obj):
            return
        for name, member in vars(obj).items():
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            if not name.startswith("_") and inspect.isfunction(member):
                found[f"{qualname}.{name}"] = member

    for name in treestore.__all__:
        obj = getattr(treestore, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            add(f"treestore.{name}", obj)
    for name, obj in sorted(vars(errors).items()):
        if inspect.isclass(obj) and issubclass(obj, errors.TreestoreError):
            add(f"treestore.errors.{name}", obj)
    for name in types.__all__:
        obj = getattr(types, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):  # not a type alias (Progress)
            add(f"treestore.types.{name}", obj)
    return found


def _docstring_problems(qualname: str, obj: Any) -> list[str]:
    """What is wrong with the docstring of ``obj``: a parameter missing from ``Args:``, an entry
    of ``Args:`` that is no parameter, or a missing ``Returns:``."""
    if inspect.isclass(obj):
        owner = next((c for c in obj.__mro__ if "__init__" in vars(c)), object)
        if owner is object or owner.__module__ == "builtins":
            return []
        doc = (owner.__doc__ or "") + "\n\n" + (vars(owner)["__init__"].__doc__ or "")
        where = qualname if owner is obj else f"{qualname} (the constructor of {owner.__name__})"
        kinds = ("Args", "Attributes") if dataclasses.is_dataclass(owner) else ("Args",)
    else:
        doc, where, kinds = obj.__doc__ or "", qualname, ("Args",)
    sections = _sections(doc)
    listed = {entry for kind in kinds for entry in sections.get(kind, [])}
    problems = []
    signature = inspect.signature(obj)
    names = [
        {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        for p in signature.parameters.values()
        if p.name not in ("self", "cls")
    ]
    for name in names:
        if name not in listed:
            problems.append(f"{where}: parameter {name!r} is not listed under {' or '.join(kinds)}:")
    for name in sections.get("Args", []):
        if name not in names:
            problems.append(f"{where}: Args: lists {name!r}, which is not a parameter")
    returned = signature.return_annotation
    says = "Returns" in sections or "Yields" in sections
    if not inspect.isclass(obj) and returned not in (None, "None", inspect.Signature.empty) and not says:
        problems.append(f"{where}: returns {returned} but has no Returns: (or Yields:) section")
    return problems


@pytest.mark.parametrize(
    ("qualname", "obj"),
    [pytest.param(q, o, id=q) for q, o in _public_callables().items()],
)
def test_public_docstrings_list_every_argument_and_the_return(qualname: str, obj: Any) -> None:
    problems = _docstring_problems(qualname, obj)
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


def test_each_public_field_is_documented_once() -> None:
    """A field that a public class's ``Attributes:`` documents has no comment of its own beside
    it in the class body (two descriptions of one field drift apart)."""
    import ast

    public = {q.rsplit(".", 1)[1] for q, o in _public_callables().items() if inspect.isclass(o)}
    twice = []
    for path in sorted((ROOT / "treestore").rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not (isinstance(node, ast.ClassDef) and node.name in public):
                continue
            listed = set(_sections(ast.get_docstring(node) or "").get("Attributes", []))
            for field in node.body:
                if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name):
                    own = [lines[n - 1] for n in range(field.lineno - 1, field.end_lineno + 1) if n > 0]
                    commented = "  # " in own[-1] or own[0].lstrip().startswith("#")
                    if field.target.id in listed and commented:
                        twice.append(f"{path.relative_to(ROOT)}:{field.lineno} {node.name}.{field.target.id}")
    assert not twice, twice


def test_the_error_table_names_every_error_class_and_its_builtin() -> None:
    """docs/index.md's table of errors names every class of treestore.errors (a class left out
    is one users do not know to catch), each beside the builtin it also is."""
    text = (ROOT / "docs/index.md").read_text()
    table = text[text.index("## Errors") : text.index("## Addresses")]
    classes = {
        name: cls
        for name, cls in vars(errors).items()
        if isinstance(cls, type)
        and issubclass(cls, errors.TreestoreError)
        and cls.__module__ == errors.__name__
        and cls is not errors.TreestoreError  # the base, named above the table
    }
    missing = [name for name in classes if not re.search(rf"`(errors\.)?{name}`", table)]
    assert not missing, f"docs/index.md's error table leaves out {missing}"
    for name, cls in classes.items():
        builtin = next(
            (
                b.__name__
                for b in cls.__mro__
                if b.__module__ == "builtins"
                and b is not Exception
                and b is not BaseException
                and b is not object
            ),
            None,
        )
        row = next(line for line in table.splitlines() if line.startswith("|") and f"{name}`" in line)
        if builtin is not None and re.match(rf"\| `(errors\.)?{name}`", row):  # a group row names its builtin
            assert f"`{builtin}`" in row, (name, builtin, row)


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)


@pytest.mark.parametrize("page", ["docs/guides/migrating.md"])
def test_each_example_block_runs_alone_and_pastes_into_a_repl(
    page: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every python block of the page runs in a fresh namespace (a reader pastes one section, not
    the page), and every compound statement (def, with, for, ...) ends with an empty ``...``
    line, which the interactive interpreter needs to run it. The blocks' memory:// stores are
    their own (the page's doctest saves under the same names)."""
    import doctest

    from fsspec.implementations.memory import MemoryFileSystem

    monkeypatch.setattr(MemoryFileSystem, "store", {})
    monkeypatch.setattr(MemoryFileSystem, "pseudo_dirs", [""])

    parser = doctest.DocTestParser()
    compound = re.compile(r"(?:def|with|for|while|if|try|class|async)\b")
    for k, block in enumerate(_python_blocks(ROOT / page)):
        lines = block.splitlines()
        for i, line in enumerate(lines):
            if line.startswith(">>> ") and compound.match(line[4:]):
                end = i + 1
                while end < len(lines) and lines[end].startswith("..."):
                    end += 1
                assert lines[end - 1] == "...", (page, k, line)  # the empty line that runs the block
        test = parser.get_doctest(block, {}, f"{page} block {k}", page, 0)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        runner.run(test, out=lambda text: None)
        assert runner.failures == 0, f"{page} block {k} does not run alone"
