"""The programs jax compiles while a block runs, counted from jax's compile log."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import jax


@contextlib.contextmanager
def compiles() -> Iterator[list[str]]:
    """The programs jax compiles meanwhile, on any thread, from its compile log (turned on for
    the whole process: ``jax.log_compiles`` would turn it on for this thread alone)."""
    names: list[str] = []

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if message.startswith("Finished XLA compilation of"):
                names.append(message)

    handler = Handler(logging.DEBUG)
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    was = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)
    try:
        yield names
    finally:
        jax.config.update("jax_log_compiles", was)
        logger.removeHandler(handler)
