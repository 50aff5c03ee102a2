"""treestore's one compiled part: the byte planes of chunk objects (treestore/_format/_planes.c).
Everything else about the package is in pyproject.toml. Where no C compiler is found the build
goes on without it, and numpy does the same work, more slowly (treestore/_format/codecs.py)."""

import sys

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "treestore._format._planes",
            ["treestore/_format/_planes.c"],
            extra_compile_args=["/O2"] if sys.platform == "win32" else ["-O3"],
            optional=True,
        )
    ]
)
