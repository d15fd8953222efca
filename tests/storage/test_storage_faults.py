"""Faults against a real S3 server (Ceph RGW; moto where noted) through a fault-injecting proxy.

The proxy (fault_proxy.py) sits at the HTTP layer between the S3 backend and
the server: throttling (503 SlowDown), 500s, connection resets before and
after the server acted, and responses cut mid-body.
"""

from __future__ import annotations

import re
import time
import urllib.parse

import pytest
import torch
from bytecp.storage.s3 import S3Storage
from bytecp.storage.testing import MiB, payload
from fault_proxy import FaultProxy, Rule

import bytecp
from bytecp.errors import (
    BytecpError,
    StorageError,
    StorageNotFoundError,
    StoragePermissionError,
    TransientStorageError,
)
from bytecp.storage_api import open_storage

pytestmark = [pytest.mark.s3]

FAST_RETRY = {"deadline": 30.0, "initial_backoff": 0.02, "max_backoff": 0.2}
SMALL_PARTS = {"part_size": 5 * MiB, "read_part_size": 1 * MiB, "max_concurrency": 4}


def is_upload_part(method: str, path: str) -> bool:
    q = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)
    return method == "PUT" and "partNumber" in q


def part_number(path: str) -> int:
    q = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)
    return int(q.get("partNumber", ["0"])[0])


@pytest.fixture
def proxy(s3):
    server, _ = s3
    with FaultProxy(server.endpoint_url, seed=1234) as p:
        yield p


def through(proxy: FaultProxy, server, **extra):
    return {**server.options(**SMALL_PARTS), "endpoint_url": proxy.endpoint_url, "retry": FAST_RETRY, **extra}


def model_state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt, "extra": {"step": seed}}


def assert_same_state(a: dict, b: dict) -> None:
    sa, sb = a["model"].state_dict(), b["model"].state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    oa, ob = a["optimizer"].state_dict()["state"], b["optimizer"].state_dict()["state"]
    assert oa.keys() == ob.keys()
    for k in oa:
        for name in oa[k]:
            assert torch.equal(torch.as_tensor(oa[k][name]), torch.as_tensor(ob[k][name])), (k, name)


# -- transient faults: everything completes through retries -----------------


def test_flaky_server_storage_level(s3, proxy, unique_prefix, events):
    """A quarter of all requests fail (503/500/reset/reset-after/truncated); writes, commit and reads still complete."""
    server, bucket = s3
    proxy.rules.append(Rule(rate=0.25))
    st = open_storage(f"s3://{bucket}/{unique_prefix}", **through(proxy, server))
    big = payload(11 * MiB + 17, 1)
    small = payload(70_000, 2)
    v = memoryview(big)
    st.write_file("data/0-0.bin", [v[: 3 * MiB], v[3 * MiB :]])
    st.write_file("index/0.parquet", [small])
    st.commit("metadata.json", b'{"ok": true}')
    assert st.list_files() == ["data/0-0.bin", "index/0.parquet", "metadata.json"]
    out = bytearray(len(big))
    st.read_into("data/0-0.bin", 0, memoryview(out))
    assert out == big
    assert st.read_bytes("index/0.parquet") == small
    assert st.read_bytes("metadata.json") == b'{"ok": true}'
    assert proxy.faults >= 3, proxy.counts
    assert events.count("storage_retry") >= proxy.faults // 2
    assert {e[2]["backend"] for e in events.events if e[0] == "storage_retry"} == {"s3"}
    st.delete_prefix()
    assert st.list_incomplete_uploads() == []


def test_lost_reply_to_complete_multipart_upload(s3, proxy, unique_prefix):
    """The server completes the upload but the reply is lost: the retry must not fail the write."""
    server, bucket = s3
    fired = []

    def first_complete(method: str, path: str) -> bool:
        if method == "POST" and "uploadId=" in path and not fired:
            fired.append(path)
            return True
        return False

    proxy.fail_always.append((first_complete, "reset_after"))
    st = open_storage(f"s3://{bucket}/{unique_prefix}", **through(proxy, server))
    data = payload(11 * MiB, 3)
    st.write_file("f.bin", [data])
    assert fired and st.read_bytes("f.bin") == data
    st.delete_prefix()


@pytest.mark.ceph
def test_save_and_load_through_faults_is_bitwise_equal(ceph_rgw, ceph_bucket, unique_prefix, events):
    """bytecp.save/load of a model + optimizer while the server throttles, errors and resets."""
    with FaultProxy(ceph_rgw.endpoint_url, seed=7) as proxy:
        proxy.rules.append(Rule(rate=0.2))
        url = f"s3://{ceph_bucket}/{unique_prefix}/step-1"
        opts = through(proxy, ceph_rgw)
        state = model_state(1)
        bytecp.save(url, state, storage_options=opts)
        target = model_state(2)
        bytecp.load(url, target, storage_options=opts)
        assert_same_state(state, target)
        assert proxy.faults > 0 and events.count("storage_retry") > 0
    open_storage(url, **ceph_rgw.options()).delete_prefix()


# -- persistent faults: fail clearly, commit nothing, clean up ------------


def test_persistent_failure_storage_level(s3, proxy, unique_prefix):
    """Every upload of part 2+ fails: the write fails within the deadline and its upload is aborted."""
    server, bucket = s3
    proxy.fail_always.append((lambda m, p: is_upload_part(m, p) and part_number(p) >= 2, "500"))
    st = open_storage(f"s3://{bucket}/{unique_prefix}", **through(proxy, server, retry={"deadline": 2.0, "initial_backoff": 0.05, "max_backoff": 0.3}))
    t0 = time.monotonic()
    with pytest.raises(TransientStorageError) as info:
        st.write_file("data/0-0.bin", [payload(11 * MiB, 5)])
    assert time.monotonic() - t0 < 10
    msg = str(info.value)
    assert f"s3://{bucket}/{unique_prefix}/data/0-0.bin" in msg and "InternalError" in msg and "deadline" in msg
    assert st.list_incomplete_uploads() == []  # aborted: no orphaned parts
    assert not st.exists("data/0-0.bin")
    aborts = [r for r in proxy.requests if r[0] == "DELETE" and "uploadId=" in r[1]]
    assert aborts


@pytest.mark.ceph
def test_persistent_failure_mid_save_keeps_previous_checkpoint(ceph_rgw, ceph_bucket, unique_prefix):
    """A save under the same URL that fails mid-way: clear error, no new metadata.json, the
    previous checkpoint still loads bitwise, no orphaned parts or data objects remain."""
    url = f"s3://{ceph_bucket}/{unique_prefix}/ckpt"
    with FaultProxy(ceph_rgw.endpoint_url, seed=3) as proxy:
        opts = through(proxy, ceph_rgw, retry={"deadline": 2.0, "initial_backoff": 0.05, "max_backoff": 0.3})
        first = model_state(1)
        bytecp.save(url, first, storage_options=opts)
        direct = open_storage(url, **ceph_rgw.options())
        committed = direct.read_bytes("metadata.json")
        files_before = direct.list_files()

        proxy.fail_always.append((lambda m, p: is_upload_part(m, p) and part_number(p) >= 2, "503"))
        proxy.fail_always.append((lambda m, p: m == "PUT" and "uploadId" not in p and "/data/" in p, "503"))
        with pytest.raises(BytecpError) as info:
            bytecp.save(url, model_state(2), storage_options=opts, overwrite=True)
        msg = str(info.value)
        assert url in msg and ("SlowDown" in msg or "503" in msg), msg

    assert direct.read_bytes("metadata.json") == committed  # nothing committed
    assert direct.list_incomplete_uploads() == []  # aborted multipart uploads
    leftovers = sorted(set(direct.list_files()) - set(files_before))
    assert leftovers == [] or all(f.startswith("reports/") for f in leftovers), leftovers
    again = model_state(3)
    bytecp.load(url, again, storage_options=ceph_rgw.options())
    assert_same_state(first, again)
    direct.delete_prefix()


@pytest.mark.ceph
def test_wrong_credentials_save_is_a_permission_error(ceph_rgw, ceph_bucket, unique_prefix, events):
    url = f"s3://{ceph_bucket}/{unique_prefix}/ckpt"
    t0 = time.monotonic()
    with pytest.raises((StoragePermissionError, BytecpError)) as info:
        bytecp.save(url, model_state(1), storage_options={**ceph_rgw.options(), "secret": "x" * 40})
    assert time.monotonic() - t0 < 10
    assert re.search("SignatureDoesNotMatch|permission denied", str(info.value)), str(info.value)
    assert events.count("storage_retry") == 0


@pytest.mark.ceph
def test_missing_data_object_fails_load_naming_it(ceph_rgw, ceph_bucket, unique_prefix):
    url = f"s3://{ceph_bucket}/{unique_prefix}/ckpt"
    bytecp.save(url, model_state(1), storage_options=ceph_rgw.options(**SMALL_PARTS))
    st = open_storage(url, **ceph_rgw.options())
    victim = next(f for f in st.list_files("data") if f.endswith(".bin"))
    st.delete([victim])
    with pytest.raises((StorageNotFoundError, StorageError, BytecpError)) as info:
        bytecp.load(url, model_state(2), storage_options=ceph_rgw.options())
    assert victim in str(info.value), str(info.value)
    st.delete_prefix()


def test_retries_are_not_hidden_inside_botocore(moto_s3):
    """One retry policy: botocore and s3fs make a single attempt each."""
    st = S3Storage("s3://b/x", **moto_s3.options())
    assert st._client.fs.retries == 1
    cfg = st._client.fs.config_kwargs if hasattr(st._client.fs, "config_kwargs") else {}
    assert cfg["retries"]["total_max_attempts"] == 1
