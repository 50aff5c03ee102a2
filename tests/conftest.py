"""Shared fixtures: fresh stores on each local backend, and the real object-store servers.

The servers (moto S3, the GCS emulator, azurite, a static HTTP server; tests/support/servers.py) are
session-scoped: each starts once, on a free 127.0.0.1 port, the first time a test asks for it,
and stops at the end of the session. ``*_backend`` fixtures empty the server before each test.
"""

from __future__ import annotations

import os

# gcsfs picks its filesystem class at import time; with the zonal/HNS class every call against the
# emulator stalls for a minute. This must run before anything imports gcsfs.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
# Eight CPU devices for the sharding tests; set before jax starts its backend.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import sys
import time
import uuid

import pytest
from hypothesis import Phase, settings

if sys.version_info < (3, 12) and "coverage" in sys.modules:
    # Python 3.10 and 3.11 refuse sys.settrace while another thread is installing a trace function
    # (a process-wide guard, python/cpython#98257); under coverage every thread installs one as it
    # starts, so two threads starting together can kill one before it runs its target. The
    # thread that loses waits for the other instead (3.12 on, coverage needs no settrace).
    _settrace = sys.settrace

    def _settrace_once_free(fn):  # type: ignore[no-untyped-def]
        for _ in range(1000):
            try:
                return _settrace(fn)
            except RuntimeError as exc:
                if "another trace function is being installed" not in str(exc):
                    raise
                time.sleep(0.001)
        return _settrace(fn)

    sys.settrace = _settrace_once_free

from tests.support import faults, servers

# The mutation check (.ci/mutations.py) needs only to see a test fail, not its smallest example:
# it runs with this profile, which skips shrinking (slow on a loaded machine).
settings.register_profile("mutation", phases=(Phase.explicit, Phase.reuse, Phase.generate), deadline=None)

s3_server = servers.s3_server
gcs_server = servers.gcs_server
azure_server = servers.azure_server
http_server = servers.http_server
s3_backend = servers.s3_backend
gcs_backend = servers.gcs_backend
azure_backend = servers.azure_backend
http_backend = servers.http_backend
faultmem = faults.faultmem  # a faultmem:// store URL (tests/support/faults.py)

# The longest tests, longest first (each well over 20 s in CI). xdist hands tests out in collection
# order; collected last (tests/system is), they left one worker running them alone at the end
# while the other sat idle. A whole module moves at once, so its module fixtures still start once.
LONGEST_FIRST = (
    "tests/api/test_two_tier.py",
    "tests/format/test_memory_limit.py",
    "tests/bench/test_benchmark_device_link.py",
    "tests/bench/test_benchmark_device.py",
    "tests/bench/test_benchmark_full_chip.py",
    "tests/system/",
    "tests/attacks/test_bounded.py",
    "tests/docs/test_site.py",
    "tests/format/test_damage_fuzz.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules of LONGEST_FIRST first, in its order; every other test after them, in the
    order it was collected (a stable sort: the same order on every worker)."""

    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        found = (i for i, first in enumerate(LONGEST_FIRST) if path.startswith(first))
        return next(found, len(LONGEST_FIRST))

    items.sort(key=rank)


@pytest.fixture(params=["local", "memory"])
def store_url(request: pytest.FixtureRequest, tmp_path) -> str:
    """A fresh, empty store URL on a local folder and on fsspec's memory filesystem."""
    if request.param == "local":
        return str(tmp_path / "store")
    return f"memory://treestore-tests/{uuid.uuid4().hex}"
