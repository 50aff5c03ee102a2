"""Real local object-store servers for tests (S3, GCS, Azure Blob, plain HTTP).

Each context manager starts one server as a subprocess on a free 127.0.0.1
port, waits until it answers, yields a :class:`Backend`, and on exit stops it
(SIGTERM, then SIGKILL after a timeout; always reaped)::

    with moto_s3_server() as b:
        fs = b.filesystem()
        fs.pipe_file(b.url("x"), b"data")
        b.reset()  # empty server state; the bucket at b.url_root exists again

The matching pytest fixtures at the bottom (``s3_server``, ``gcs_server``,
``azure_server``, ``http_server``: session scoped; ``s3_backend`` ...
``http_backend``: function scoped, ``reset()`` before each test) can be
registered in tests/conftest.py by plain assignment, e.g.::

    from tests.support import servers  # also sets GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false

    s3_server = servers.s3_server
    s3_backend = servers.s3_backend

A server whose binary/package is missing makes the fixture ``pytest.skip``
locally and fail loudly when ``$CI`` is set. Nothing here talks to anything
but 127.0.0.1.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

# gcsfs >= 2025.x swaps in an "extended" (zonal/HNS) class at import time unless
# this is false; against the emulator every call then stalls 20-90 s on a gRPC
# probe. It must be set before gcsfs is first imported.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
# Never let botocore go looking for instance metadata (169.254.169.254).
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

REPO_ROOT = Path(__file__).resolve().parents[2]
AZURITE_DIR = REPO_ROOT / ".ci" / "azurite"
HOST = "127.0.0.1"

AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="

# Measured start-up times (seconds, 2-core box) land here: {"s3": 0.6, ...}.
STARTUP_SECONDS: dict[str, float] = {}

# Direct opener: never use an HTTP(S)_PROXY from the environment for 127.0.0.1.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True)
class Backend:
    """Connection info for one running server.

    ``url_root``: fsspec URL of an existing, empty bucket/container (or the
    HTTP server root); ``storage_options``: kwargs for ``fsspec.filesystem`` /
    ``fsspec.open``; ``reset()``: empty the server and recreate the bucket;
    ``local_dir``: (HTTP only) the directory being served - write there, read
    over HTTP.
    """

    url_root: str
    storage_options: dict
    name: str
    reset: Callable[[], None] = field(repr=False, compare=False)
    local_dir: str | None = None
    count_url: str | None = None  # moto_s3_server(counting=True): where it tells what it served

    def served(self) -> dict[str, int]:
        """What a counting server has served since its count was last zeroed: ``bytes`` (every
        response body), ``requests``, ``gets`` and ``get_bytes`` (GET requests to objects)."""
        assert self.count_url is not None, "not a counting server"
        status, body = _http("GET", self.count_url)
        assert status == 200, (status, body[:200])
        return json.loads(body)

    def zero_count(self) -> None:
        assert self.count_url is not None, "not a counting server"
        status, body = _http("POST", f"{self.count_url}/reset", b"")
        assert status == 200, (status, body[:200])

    @property
    def protocol(self) -> str:
        return self.url_root.split("://", 1)[0]

    def url(self, *parts: str) -> str:
        """``url_root`` joined with ``parts`` by ``/``."""
        return "/".join([self.url_root.rstrip("/"), *(p.strip("/") for p in parts)])

    def filesystem(self, **extra: Any):
        """``fsspec.filesystem(protocol, **storage_options, **extra)`` (cached instance)."""
        import fsspec

        return fsspec.filesystem(self.protocol, **{**self.storage_options, **extra})


# ---------------------------------------------------------------- helpers


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _unavailable(msg: str) -> None:
    """Skip locally, fail loudly in CI."""
    hint = " Install with: bash .ci/install-servers.sh .venv"
    if _in_ci():
        pytest.fail(f"{msg} (required in CI).{hint}", pytrace=False)
    pytest.skip(f"{msg}.{hint}")


def _require_modules(*mods: str, what: str) -> None:
    missing = [m for m in mods if importlib.util.find_spec(m) is None]
    if missing:
        _unavailable(f"{what}: python package(s) not installed: {', '.join(missing)}")


_PORTS = itertools.count()
PORTS_PER_WORKER = 500


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now. Under pytest-xdist each worker takes its
    own range (below Linux's ephemeral ports), one port after another: a port let go by one
    worker before its server binds it cannot be handed to another worker's server, whose
    readiness probe the first server would answer."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((HOST, 0))
            return s.getsockname()[1]
    base = 20000 + PORTS_PER_WORKER * int(worker[2:])
    for _ in range(PORTS_PER_WORKER):
        port = base + next(_PORTS) % PORTS_PER_WORKER
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {base}..{base + PORTS_PER_WORKER - 1} for {worker}")


def _http(method: str, url: str, body: bytes | None = None, headers=None, timeout=10.0):
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with _OPENER.open(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read()


_LIVE: dict[int, subprocess.Popen] = {}


def _stop(proc: subprocess.Popen, timeout: float = 5.0) -> None:
    """SIGTERM the server's process group, SIGKILL after ``timeout``; reap."""
    try:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout)
        else:
            # leader gone; make sure nothing else in its group lingers
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
    finally:
        _LIVE.pop(proc.pid, None)


@atexit.register
def _stop_all() -> None:  # safety net if a context manager never exited
    for proc in list(_LIVE.values()):
        _stop(proc, timeout=2.0)


def _tail(path: str, n: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read()
        return data[-n:].decode("utf-8", "replace")
    except OSError:
        return ""


@contextlib.contextmanager
def _server_process(
    name: str,
    make_argv: Callable[[int], list[str]],
    probe_path: str = "/",
    *,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    start_timeout: float = 60.0,
    stop_timeout: float = 5.0,
    attempts: int = 3,
) -> Iterator[int]:
    """Run ``make_argv(port)`` until it answers HTTP on ``probe_path``; yield the port."""
    last_err = ""
    for _ in range(attempts):
        port = free_port()
        fd, log_path = tempfile.mkstemp(prefix=f"treestore-{name}-", suffix=".log")
        t0 = time.monotonic()
        try:
            with os.fdopen(fd, "wb") as log:
                proc = subprocess.Popen(
                    make_argv(port),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **(env or {})},
                    cwd=cwd or tempfile.gettempdir(),
                    start_new_session=True,  # own process group: killpg reaches children
                )
            _LIVE[proc.pid] = proc
            try:
                ready = False
                while time.monotonic() - t0 < start_timeout:
                    if proc.poll() is not None:
                        break
                    try:
                        _http("GET", f"http://{HOST}:{port}{probe_path}", timeout=2.0)
                        ready = True
                        break
                    except (OSError, urllib.error.URLError):
                        time.sleep(0.05)
                if ready:
                    STARTUP_SECONDS[name] = round(time.monotonic() - t0, 3)
                    yield port
                    return
                if proc.poll() is None:
                    last_err = f"{name} did not answer within {start_timeout:.0f}s"
                else:
                    last_err = f"{name} exited with code {proc.returncode} during start-up"
            finally:
                _stop(proc, stop_timeout)
            last_err += f"; command: {make_argv(port)}; log tail:\n{_tail(log_path)}"
        finally:
            with contextlib.suppress(OSError):
                os.unlink(log_path)
        # a port race or a crash: try again on another port
    raise RuntimeError(last_err)


def _invalidate_fs_caches(module: str, cls_name: str) -> None:
    """Drop listing caches of already-created fsspec instances (after a reset)."""
    mod = sys.modules.get(module)
    cls = getattr(mod, cls_name, None) if mod else None
    cache = getattr(cls, "_cache", None)
    if isinstance(cache, dict):
        for inst in list(cache.values()):
            with contextlib.suppress(Exception):
                inst.invalidate_cache()


def _new_bucket_name() -> str:
    return f"treestore-test-{uuid.uuid4().hex[:10]}"


# ---------------------------------------------------------------- S3 (moto)


@contextlib.contextmanager
def moto_s3_server(bucket: str | None = None, *, counting: bool = False) -> Iterator[Backend]:
    """moto standalone server; s3fs ``s3://BUCKET`` with ``endpoint_url``. With ``counting``, the
    server counts the bytes it serves (tests/support/counting_moto.py; ``Backend.served``)."""
    _require_modules("moto", "flask", "flask_cors", what="S3 (moto server)")
    _require_modules("s3fs", what="S3 client")
    bucket = bucket or _new_bucket_name()
    counter = Path(__file__).with_name("counting_moto.py")
    with _server_process(
        "s3",
        lambda port: (
            [sys.executable, str(counter), HOST, str(port)]
            if counting
            else [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)]
        ),
        "/moto-api/",
        env={"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"},
    ) as port:
        endpoint = f"http://{HOST}:{port}"

        def reset() -> None:
            status, body = _http("POST", f"{endpoint}/moto-api/reset")
            if status != 200:
                raise RuntimeError(f"moto reset failed: {status} {body[:200]!r}")
            status, body = _http("PUT", f"{endpoint}/{bucket}")  # moto: no auth needed
            if status != 200:
                raise RuntimeError(f"moto create bucket failed: {status} {body[:200]!r}")
            _invalidate_fs_caches("s3fs", "S3FileSystem")

        reset()
        yield Backend(
            url_root=f"s3://{bucket}",
            storage_options={
                "endpoint_url": endpoint,
                "key": "testing",
                "secret": "testing",
                "client_kwargs": {"region_name": "us-east-1"},
            },
            name="s3",
            reset=reset,
            count_url=f"{endpoint}/treestore-count" if counting else None,
        )


# ---------------------------------------------------------------- GCS (emulator)


def _check_gcsfs_class() -> None:
    mod = sys.modules.get("gcsfs")
    if mod is not None and mod.GCSFileSystem.__name__ == "ExtendedGcsFileSystem":
        raise RuntimeError(
            "gcsfs was imported before GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false was set, so "
            "gs:// uses ExtendedGcsFileSystem, which stalls ~60 s per call against the "
            "emulator. Import tests/support/servers.py (or set the variable) before gcsfs."
        )


@contextlib.contextmanager
def gcs_emulator_server(bucket: str | None = None) -> Iterator[Backend]:
    """gcp-storage-emulator (in memory); gcsfs ``gs://BUCKET`` with ``endpoint_url``.

    The emulator ignores ``ifGenerationMatch`` preconditions and suffix ranges
    (``bytes=-N`` returns the whole object), and answers 501 to the move API.
    """
    _require_modules("gcp_storage_emulator", what="GCS (gcp-storage-emulator)")
    _require_modules("gcsfs", what="GCS client")
    _check_gcsfs_class()
    bucket = bucket or _new_bucket_name()
    with _server_process(
        "gcs",
        lambda port: [
            sys.executable,
            "-m",
            "gcp_storage_emulator",
            "start",
            "--host",
            HOST,
            "--port",
            str(port),
            "--in-memory",
        ],
        "/",
    ) as port:
        endpoint = f"http://{HOST}:{port}"

        def reset() -> None:
            status, body = _http("GET", f"{endpoint}/wipe")
            if status != 200:
                raise RuntimeError(f"gcs emulator wipe failed: {status} {body[:200]!r}")
            status, body = _http(
                "POST",
                f"{endpoint}/storage/v1/b?project=test-project",
                json.dumps({"name": bucket}).encode(),
                {"Content-Type": "application/json"},
            )
            if status != 200:
                raise RuntimeError(f"gcs create bucket failed: {status} {body[:200]!r}")
            _invalidate_fs_caches("gcsfs", "GCSFileSystem")

        reset()
        yield Backend(
            url_root=f"gs://{bucket}",
            storage_options={"endpoint_url": endpoint, "token": "anon"},
            name="gcs",
            reset=reset,
        )


# ---------------------------------------------------------------- Azure (azurite)


def azurite_binary() -> str | None:
    """Path of ``azurite-blob``: $AZURITE_BLOB_BIN, .ci/azurite, or PATH."""
    candidates = [
        os.environ.get("AZURITE_BLOB_BIN", ""),
        str(AZURITE_DIR / "node_modules" / ".bin" / "azurite-blob"),
        shutil.which("azurite-blob") or "",
    ]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def azurite_connection_string(port: int) -> str:
    return (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
        f"AccountKey={AZURITE_KEY};"
        f"BlobEndpoint=http://{HOST}:{port}/{AZURITE_ACCOUNT};"
    )


@contextlib.contextmanager
def azurite_server(container: str | None = None) -> Iterator[Backend]:
    """azurite-blob (in memory); adlfs ``az://CONTAINER`` via a connection string."""
    binary = azurite_binary()
    if binary is None:
        _unavailable("Azure (azurite): azurite-blob not found in .ci/azurite, $AZURITE_BLOB_BIN or PATH")
    if shutil.which("node") is None:
        _unavailable("Azure (azurite): node not found on PATH")
    _require_modules("adlfs", "azure.storage.blob", what="Azure client")
    assert binary is not None
    container = container or _new_bucket_name()
    with (
        tempfile.TemporaryDirectory(prefix="treestore-azurite-") as workdir,
        _server_process(
            "azure",
            lambda port: [
                binary,
                "--blobHost",
                HOST,
                "--blobPort",
                str(port),
                "--inMemoryPersistence",
                "--skipApiVersionCheck",
                "--disableTelemetry",
                "--silent",
            ],
            "/",
            cwd=workdir,  # nothing lands in the repo even if azurite writes files
            stop_timeout=3.0,  # it may ignore SIGTERM; then SIGKILL
        ) as port,
    ):
        conn = azurite_connection_string(port)

        def reset() -> None:
            from azure.storage.blob import BlobServiceClient

            with BlobServiceClient.from_connection_string(conn) as svc:
                for c in list(svc.list_containers()):
                    svc.delete_container(c.name)
                svc.create_container(container)
            _invalidate_fs_caches("adlfs", "AzureBlobFileSystem")

        reset()
        yield Backend(
            url_root=f"az://{container}",
            storage_options={"connection_string": conn},
            name="azure",
            reset=reset,
        )


# ---------------------------------------------------------------- HTTP (static, read-only)


@contextlib.contextmanager
def http_static_server(directory: str | os.PathLike[str] | None = None) -> Iterator[Backend]:
    """aiohttp static server over ``directory`` (a fresh temp dir by default).

    Read-only: write files under ``backend.local_dir``, read them at
    ``backend.url(...)``. ``reset()`` empties ``local_dir``.
    """
    _require_modules("aiohttp", what="HTTP static server")
    script = Path(__file__).resolve().parent / "http_static_server.py"
    with contextlib.ExitStack() as stack:
        if directory is None:
            directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="treestore-http-"))
        root = os.path.abspath(directory)
        os.makedirs(root, exist_ok=True)
        port = stack.enter_context(
            _server_process(
                "http",
                lambda port: [
                    sys.executable,
                    str(script),
                    "--host",
                    HOST,
                    "--port",
                    str(port),
                    "--root",
                    root,
                ],
                "/",
            )
        )

        def reset() -> None:
            for entry in os.scandir(root):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
            _invalidate_fs_caches("fsspec.implementations.http", "HTTPFileSystem")

        yield Backend(
            url_root=f"http://{HOST}:{port}",
            storage_options={},
            name="http",
            reset=reset,
            local_dir=root,
        )


# ---------------------------------------------------------------- pytest fixtures

SERVERS: dict[str, Callable[[], contextlib.AbstractContextManager[Backend]]] = {
    "s3": moto_s3_server,
    "gcs": gcs_emulator_server,
    "azure": azurite_server,
    "http": http_static_server,
}


@pytest.fixture(scope="session")
def s3_server() -> Iterator[Backend]:
    with moto_s3_server() as b:
        yield b


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[Backend]:
    with gcs_emulator_server() as b:
        yield b


@pytest.fixture(scope="session")
def azure_server() -> Iterator[Backend]:
    with azurite_server() as b:
        yield b


@pytest.fixture(scope="session")
def http_server() -> Iterator[Backend]:
    with http_static_server() as b:
        yield b


@pytest.fixture
def s3_backend(s3_server: Backend) -> Backend:
    s3_server.reset()
    return s3_server


@pytest.fixture
def gcs_backend(gcs_server: Backend) -> Backend:
    gcs_server.reset()
    return gcs_server


@pytest.fixture
def azure_backend(azure_server: Backend) -> Backend:
    azure_server.reset()
    return azure_server


@pytest.fixture
def http_backend(http_server: Backend) -> Backend:
    http_server.reset()
    return http_server
