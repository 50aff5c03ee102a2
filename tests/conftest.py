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

import uuid

import pytest
from hypothesis import Phase, settings

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


@pytest.fixture(params=["local", "memory"])
def store_url(request: pytest.FixtureRequest, tmp_path) -> str:
    """A fresh, empty store URL on a local folder and on fsspec's memory filesystem."""
    if request.param == "local":
        return str(tmp_path / "store")
    return f"memory://treestore-tests/{uuid.uuid4().hex}"
