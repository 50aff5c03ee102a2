"""Every reader, on generated hostile version-2 manifests and parts, returns exact data or a clear
TreestoreError within bounded memory and CPU (the generator and the bounds: bounded_child.py).

Hypothesis runs in a child process whose address space and CPU time are limited, so a reader that
builds gigabytes from a small manifest, or spins, fails the run instead of the machine.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = 40


@pytest.mark.timeout(900)
def test_readers_are_bounded_on_generated_hostile_v2_manifests(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "tests.attacks.bounded_child", str(tmp_path), str(EXAMPLES)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    expected = f"{EXAMPLES} hostile manifests and {EXAMPLES // 2} hostile parts, every reader bounded"
    assert expected in done.stdout
