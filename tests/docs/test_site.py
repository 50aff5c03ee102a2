"""The documentation site as readers see it: built with mkdocs (as .ci/run builds it), every page
is checked for what made the API page look broken — private module paths in signatures, titles
or prose, Sphinx roles printed literally, and "Returns" tables whose type column holds the first
word of a sentence."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent

PRIVATE = re.compile(
    r"\btreestore(?:\.\w+)*\._(?!_)\w+|<span class=\"n\">_[a-z]\w*</span><span class=\"o\">\."
)
ROLE = re.compile(r":(?:class|func|meth|attr|mod|exc|data|obj):|\b(?:class|func|meth):<code>")
ARTICLE_AS_TYPE = re.compile(r"<td>\s*<code>(?:A|An|The|Its|Their|Each|One)</code>\s*</td>")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _pages(site: Path) -> list[Path]:
    pages = sorted(site.rglob("*.html"))
    assert any(p.parent.name == "api" for p in pages)
    return pages


def test_no_page_shows_a_private_module_path(site: Path) -> None:
    found = {}
    for page in _pages(site):
        hits = PRIVATE.findall(page.read_text(encoding="utf-8"))
        if hits:
            found[str(page.relative_to(site))] = sorted(set(hits))[:5]
    assert not found, found


def test_no_page_prints_a_sphinx_role(site: Path) -> None:
    found = {}
    for page in _pages(site):
        text = page.read_text(encoding="utf-8")
        hits = [html.unescape(text[m.start() - 60 : m.end() + 40]) for m in ROLE.finditer(text)]
        if hits:
            found[str(page.relative_to(site))] = hits[:3]
    assert not found, found


def test_returns_tables_hold_types_not_the_first_word_of_a_sentence(site: Path) -> None:
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    assert api.count("Returns:") > 20
    assert not ARTICLE_AS_TYPE.search(api)
    named = re.compile(r"(?:Returns|Yields):</span></p>\s*<table>\s*<thead>\s*<tr>\s*<th>Name</th>")
    assert not named.search(api)  # no name column: one value is returned


def test_table_cells_do_not_break_names_mid_word(site: Path) -> None:
    css = (site / "stylesheets" / "extra.css").read_text()
    assert re.search(r"td code\s*\{[^}]*word-break:\s*normal", css)
    assert 'href="../stylesheets/extra.css"' in (site / "api" / "index.html").read_text(encoding="utf-8")


def test_no_documented_attribute_is_an_internal_object(site: Path) -> None:
    """Checkpoint.columns (and its reader and storage, Store.storage, LazyLeaf.reader) exposed
    internal objects on the API page; they are deprecated and left out of it."""
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    assert 'id="treestore.Checkpoint.manifest"' in api
    for name in (
        "Checkpoint.columns",
        "Checkpoint.reader",
        "Checkpoint.storage",
        "Store.storage",
        "LazyLeaf.reader",
    ):
        assert f'id="treestore.{name}"' not in api, name
