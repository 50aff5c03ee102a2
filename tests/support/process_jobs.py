"""Jobs of real processes: one Python process per member of a ``jax.distributed`` job, started
together on this machine, each one's exit status and output collected, none left running."""

from __future__ import annotations

import concurrent.futures as cf
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def run_processes(
    argv: Callable[[int], Sequence[str]],
    count: int,
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
) -> list[tuple[int, str]]:
    """Run ``python argv(i)`` for i in range(``count``), all at once, from the repository root
    (importable there, with jax's own device count: no inherited ``XLA_FLAGS``); each process's
    exit status and output (stdout and stderr). Every output is read as it comes, so no process
    waits on a full pipe while another is read. Raises ``subprocess.TimeoutExpired`` when the
    job has not ended within ``timeout`` seconds; every process still running then is killed."""
    environ = {**os.environ, "PYTHONPATH": str(ROOT)}
    environ.pop("XLA_FLAGS", None)
    environ.update(env or {})
    procs = [
        subprocess.Popen(
            [sys.executable, *argv(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=environ,
            cwd=ROOT,
        )
        for i in range(count)
    ]
    deadline = time.monotonic() + timeout

    def ended(p: subprocess.Popen[str]) -> tuple[int, str]:
        out, _ = p.communicate(timeout=max(deadline - time.monotonic(), 1))
        return p.returncode, out

    try:
        with cf.ThreadPoolExecutor(count) as pool:
            return list(pool.map(ended, procs))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
