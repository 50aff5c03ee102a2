"""Stores served over HTTP(S): read-only."""

from __future__ import annotations

from typing import Any

from treestore._storage.base import Storage


class HTTPStorage(Storage):
    """A store served over HTTP(S): read-only (load, open, diff, show, list, verify).

    Listing needs the server to answer a folder URL with an HTML page linking its entries (as
    common static servers do); loading a named checkpoint needs no listing at all.
    """

    def __init__(self, fs: Any, root: str, url: str) -> None:
        super().__init__(fs, root, url)
        self.read_only = True
