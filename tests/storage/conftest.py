"""Session-scoped S3 servers for the storage tests (both on 127.0.0.1).

``ceph_rgw``: a real Ceph RADOS Gateway started by tools/ceph/start_rgw.sh
(about 3-10 s, once per session). Where its binaries are missing the tests
that need it are skipped with that reason, except where the server is
required: ``BYTECP_REQUIRE_CEPH=1``, or in CI as root on Debian (where
``make test`` installs it), a missing or failing Ceph is a test error.

``moto_s3``: moto's S3 emulator (accepts any signature).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator

import pytest
import s3_servers
from spawning import spawns

from bytecp import recorder


def _ceph_required() -> bool:
    flag = os.environ.get("BYTECP_REQUIRE_CEPH")
    if flag is not None:
        return flag not in ("", "0", "false", "no")
    ci = os.environ.get("CI", "").lower() not in ("", "0", "false", "no")
    return ci and hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get") is not None


@pytest.fixture(scope="session")
def ceph_rgw() -> Iterator[s3_servers.S3Server]:
    missing = s3_servers.ceph_missing()
    if missing:
        msg = (
            f"Ceph RGW not installed (missing {', '.join(missing)}); as root on Debian "
            "run `bash tools/install-test-servers.sh` (make test does)"
        )
        if _ceph_required():
            pytest.fail(msg + " [required here: BYTECP_REQUIRE_CEPH or CI as root]")
        pytest.skip(msg)
    server = s3_servers.start_ceph_rgw()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[s3_servers.S3Server]:
    server = s3_servers.start_moto()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def ceph_bucket(ceph_rgw: s3_servers.S3Server) -> str:
    return ceph_rgw.new_bucket()


@pytest.fixture(scope="session")
def moto_bucket(moto_s3: s3_servers.S3Server) -> str:
    return moto_s3.new_bucket()


@pytest.fixture(params=["moto", pytest.param("ceph", marks=pytest.mark.ceph)])
@spawns  # its ceph parameter starts the RADOS Gateway; the guard sees one fixture for both
def s3(request: pytest.FixtureRequest) -> tuple[s3_servers.S3Server, str]:
    """(server, bucket) for tests that run against both S3 servers."""
    if request.param == "moto":
        return request.getfixturevalue("moto_s3"), request.getfixturevalue("moto_bucket")
    return request.getfixturevalue("ceph_rgw"), request.getfixturevalue("ceph_bucket")


class Events:
    """A recorder that keeps the events it is sent (storage retries, ...)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float, dict[str, str]]] = []

    def on_report(self, report: object) -> None:
        pass

    def on_start(self, *args: object, **kwargs: object) -> None:
        pass

    def on_event(self, name: str, value: float, labels: dict[str, str]) -> None:
        self.events.append((name, value, dict(labels)))

    def count(self, name: str) -> float:
        return sum(v for n, v, _ in self.events if n == name)


@pytest.fixture
def events() -> Iterator[Events]:
    rec = recorder.add_recorder(Events())
    yield rec
    recorder.remove_recorder(rec)


@pytest.fixture
def unique_prefix(request: pytest.FixtureRequest) -> str:
    """A fresh key prefix per test, so tests sharing a bucket never see each other's objects."""
    name = request.node.name.replace("[", "-").replace("]", "").replace("/", "-")[:60]
    return f"{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(autouse=True)
def _no_ambient_aws(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests pass credentials explicitly; a developer's ~/.aws or AWS_* must not leak in."""
    for var in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
