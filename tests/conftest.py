"""Shared fixtures: fresh stores on each local backend."""

from __future__ import annotations

import uuid

import pytest


@pytest.fixture(params=["local", "memory"])
def store_url(request: pytest.FixtureRequest, tmp_path) -> str:
    """A fresh, empty store URL on a local folder and on fsspec's memory filesystem."""
    if request.param == "local":
        return str(tmp_path / "store")
    return f"memory://treestore-tests/{uuid.uuid4().hex}"
