"""Manifest decoders under an address-space limit (``RLIMIT_AS``): they finish promptly, decoded or
OutOfMemoryError, and their per-item loops stop while there is room to report running out
(treestore._kernels.room). A loop that ran the process to its last bytes left CPython 3.11 to
3.13 spinning forever as it unwound the MemoryError (python/cpython#132508): a version-1 manifest
of 400,000 scalar leaves, under its footprint + 400 MiB, hung in 3 loads of 5."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import treestore
from treestore._engine.reading import committed as _committed
from treestore._format.manifest.codec import encode
from treestore._kernels.room import ROOM

CHILD_SECONDS = 15  # a decode here takes well under a second; one that spins never ends

DECODE_UNDER_A_LIMIT = """
import resource, sys, time
import msgpack
from treestore._format.manifest.codec import decode_any
from treestore.errors import OutOfMemoryError
data = open(sys.argv[1], "rb").read()
extra = int(sys.argv[2])
decode_any(open(sys.argv[3], "rb").read(), "small")  # imports and caches in place first
def size(key="VmSize"):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
base = size()
if not extra:  # what msgpack alone takes, then the whole decode, above the base
    rec = msgpack.unpackb(data, raw=False)
    print(size("VmPeak") - base, end=" ")
    del rec
    decode_any(data, "c")
    print(size("VmPeak") - base)
    sys.exit()
limit = base + extra
resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
start = time.monotonic()
try:
    decode_any(data, "c")
    print("decoded", "-", time.monotonic() - start)
except OutOfMemoryError:  # its traceback still holds what the decode made
    print("OutOfMemoryError", limit - size(), time.monotonic() - start)
"""


def _child(*args: object) -> list[str]:
    root = Path(__file__).resolve().parent.parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-c", DECODE_UNDER_A_LIMIT, *map(str, args)]
    try:
        child = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_SECONDS, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"decoding under a limit {args[1]} bytes above the footprint ran past {CHILD_SECONDS} s")
    assert child.returncode == 0, child.stderr
    return child.stdout.split()


def _manifest(tmp_path: Path, name: str, leaves: int, version: int) -> Path:
    """The bytes of a checkpoint of ``leaves`` int leaves in format ``version``, as that version
    writes them."""
    url = str(tmp_path / name)
    treestore.save(url, {f"k{i}": i for i in range(leaves)}, "c")
    storage = treestore.Store(url)._storage
    record = _committed.read_commit_record(storage, "c")
    data = _committed.read_manifest_bytes(storage, record)
    path = tmp_path / f"{name}.manifest"
    path.write_bytes(data if version == 2 else encode(_committed.read_columns(storage, record, data), 1))
    return path


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="address-space limits as Linux counts them")
@pytest.mark.parametrize(
    ("version", "leaves"),
    [pytest.param(1, 50_000, id="v1"), pytest.param(2, 100_000, id="v2")],  # loops well over ROOM
)
def test_a_manifest_of_many_leaves_decodes_or_runs_out_promptly_with_room_left(tmp_path, version, leaves):
    """Under limits that let msgpack decode the manifest, with ROOM to spare, but not the loops
    over its leaves, nodes and segments: each decode ends within seconds in OutOfMemoryError,
    with room left. Running to the last bytes, the condition of the hang, was what each such
    decode did before those loops looked at the room left; some of them then spun."""
    big, small = _manifest(tmp_path, "big", leaves, version), _manifest(tmp_path, "small", 3, version)
    unpacked, decoded = map(int, _child(big, 0, small))
    assert decoded - unpacked > ROOM, (unpacked, decoded)  # the loops need more than ROOM
    for share in (0.1, 0.35, 0.6, 0.85):  # the leaves (version 1), then the nodes and their segments
        extra = unpacked + ROOM + int(share * (decoded - unpacked - ROOM))
        outcome, room, _ = _child(big, extra, small)
        assert outcome == "OutOfMemoryError", (extra, outcome)
        assert int(room) >= ROOM // 2, f"{int(room):,} bytes left under a limit {extra:,} above the footprint"
    # With room for all of it and ROOM more, it decodes.
    assert _child(big, decoded + 2 * ROOM, small)[0] == "decoded"
