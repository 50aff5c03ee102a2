"""Entry point of the ``treestore`` command."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    print("treestore: the command line is not built yet", file=sys.stderr)
    return 2
