"""treestore's one compiled part (treestore/_kernels/_planes.c): the byte planes of chunk objects and the
one-pass statistics of float32 and bfloat16 chunks.
Everything else about the package is in pyproject.toml. Where no C compiler is found the build goes on
without it, and numpy does the same work, more slowly (treestore/_kernels/planes.py, _format/stats.py)."""

import sys

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "treestore._kernels._planes",
            ["treestore/_kernels/_planes.c"],
            extra_compile_args=["/O2"] if sys.platform == "win32" else ["-O3"],
            optional=True,
        )
    ]
)
