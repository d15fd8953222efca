"""Real S3 servers for tests and benchmarks, bound to 127.0.0.1.

- :func:`start_ceph_rgw`: a throw-away Ceph cluster (1 mon, 1 memstore OSD)
  plus a RADOS Gateway, through the project's ``tools/ceph/start_rgw.sh``;
  a real S3 implementation that checks signatures.
- :func:`start_moto`: moto's threaded S3 emulator.

Both return an :class:`S3Server` with the endpoint and credentials; ``stop()``
ends only the processes they started.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable
from typing import Any

from tests.netport import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CEPH_START = os.path.join(REPO, "tools", "ceph", "start_rgw.sh")
CEPH_STOP = os.path.join(REPO, "tools", "ceph", "stop_rgw.sh")
CEPH_BINARIES = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "ceph")




@dataclasses.dataclass
class S3Server:
    """An S3 endpoint with credentials that tests may use."""

    name: str
    endpoint_url: str
    key: str
    secret: str
    checks_signatures: bool
    stop: Callable[[], None]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    #: stores empty objects straight into the server's own store (moto, which
    #: runs in this process); None: through the S3 API
    _store_empty: Callable[[str, list[str]], None] | None = None

    def options(self, **extra: Any) -> dict[str, Any]:
        """Options for ``open_storage("s3://...", **options)``."""
        return {"endpoint_url": self.endpoint_url, "key": self.key, "secret": self.secret, **extra}

    def boto3_client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.key,
            aws_secret_access_key=self.secret,
            region_name="us-east-1",
            config=Config(retries={"total_max_attempts": 2}),
        )

    def put_empty(self, bucket: str, keys: list[str]) -> None:
        """Empty objects at ``keys``: the many keys a listing or delete test
        needs (past S3's 1,000-key pages). moto runs in this process, so its
        objects go straight into its store (a PUT through its HTTP server
        costs ~20 ms of this process's CPU, ~50 s for 2,600 keys); another
        server gets PUTs from 16 threads."""
        if self._store_empty is not None:
            self._store_empty(bucket, keys)
            return
        import concurrent.futures

        client = self.boto3_client()
        with concurrent.futures.ThreadPoolExecutor(16) as ex:
            list(ex.map(lambda k: client.put_object(Bucket=bucket, Key=k, Body=b""), keys))

    def new_bucket(self, prefix: str = "bytecp") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.boto3_client().create_bucket(Bucket=name)
        return name


def ceph_missing() -> list[str]:
    """The Ceph binaries not on PATH (empty when the RGW can run here)."""
    return [b for b in CEPH_BINARIES if shutil.which(b) is None]


def start_ceph_rgw(*, timeout: float = 180.0, memstore_bytes: int = 3 << 30, attempts: int = 2) -> S3Server:
    """Start Ceph (memstore) + RGW on free loopback ports; raise with the log tail on failure.

    A failed start (say, a port taken between choosing and binding it) is
    retried once on new ports.
    """
    missing = ceph_missing()
    if missing:
        raise FileNotFoundError(
            f"Ceph binaries not installed: {', '.join(missing)} "
            "(as root on Debian: bash tools/install-test-servers.sh)"
        )
    for attempt in range(attempts):
        try:
            return _start_ceph_once(timeout, memstore_bytes)
        except (RuntimeError, subprocess.TimeoutExpired):
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _start_ceph_once(timeout: float, memstore_bytes: int) -> S3Server:
    work = tempfile.mkdtemp(prefix="bytecp-ceph-")
    env = dict(
        os.environ,
        RGW_PORT=str(free_port()),
        MON_PORT=str(free_port()),
        OSD_STORE="memstore",
        MEMSTORE_BYTES=str(memstore_bytes),
    )
    try:
        proc = subprocess.run(
            ["bash", CEPH_START, work], env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        subprocess.run(["bash", CEPH_STOP, work], capture_output=True, timeout=60)
        raise
    if proc.returncode != 0:
        subprocess.run(["bash", CEPH_STOP, work], capture_output=True, timeout=60)
        raise RuntimeError(f"tools/ceph/start_rgw.sh failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    values = {}
    for line in proc.stdout.splitlines():
        if line.startswith("export ") and "=" in line:
            k, _, v = line[len("export ") :].partition("=")
            values[k] = v

    def stop() -> None:
        subprocess.run(["bash", CEPH_STOP, work], capture_output=True, timeout=120)

    return S3Server(
        name="ceph-rgw",
        endpoint_url=values["S3_ENDPOINT_URL"],
        key=values["AWS_ACCESS_KEY_ID"],
        secret=values["AWS_SECRET_ACCESS_KEY"],
        checks_signatures=True,
        stop=stop,
        env={"CEPH_CONF": values["CEPH_CONF"]},
    )


def ceph_gc(server: S3Server) -> None:
    """Purge deleted RGW data now (RGW keeps it ~2 h otherwise)."""
    conf = server.env.get("CEPH_CONF")
    if conf:
        subprocess.run(
            ["radosgw-admin", "-c", conf, "gc", "process", "--include-all"],
            capture_output=True,
            timeout=120,
        )


def start_moto() -> S3Server:
    """Start moto's threaded S3 server on a free loopback port."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return S3Server(
        name="moto",
        endpoint_url=f"http://127.0.0.1:{port}",
        key="testing",
        secret="testing",
        checks_signatures=False,
        stop=server.stop,
        _store_empty=_moto_store_empty,
    )


def _moto_store_empty(bucket: str, keys: list[str]) -> None:
    """Empty objects put by moto's own S3 backend (the one its server in this process answers from)."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    backend = s3_backends[DEFAULT_ACCOUNT_ID]["global"]
    for key in keys:
        backend.put_object(bucket, key, b"")
