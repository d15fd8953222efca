"""The distributed save/load/resharding path once against S3 (Ceph RGW), as tests/dist does on local disk.

Real gloo ranks (tests/dist's worker pool) save to and load from the real
S3 server; the credentials and endpoint reach the ranks through the standard
AWS environment variables, as they would on a cluster. Every loaded tensor
is compared bitwise with what torch reports for the saving job.
"""

from __future__ import annotations

import os
import sys

import pytest
from spawning import spawns

import bytecp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for dist.*
from dist import cases  # noqa: E402
from dist.pool import WorkerPool  # noqa: E402
from dist.test_reshard import assert_matches_full, assert_same_state, variant_for  # noqa: E402

pytestmark = [pytest.mark.s3, pytest.mark.ceph, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
@spawns
def s3_pools(ceph_rgw):
    env = {
        "AWS_ACCESS_KEY_ID": ceph_rgw.key,
        "AWS_SECRET_ACCESS_KEY": ceph_rgw.secret,
        "AWS_ENDPOINT_URL_S3": ceph_rgw.endpoint_url,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    pools: dict[int, WorkerPool] = {}

    def get(world: int) -> WorkerPool:
        if world not in pools:
            pools[world] = WorkerPool(world, env=env)
        return pools[world]

    yield get
    for p in pools.values():
        p.close()


@pytest.mark.parametrize(
    ("src", "dst"),
    [(("fsdp2", 2), ("ddp", 3)), (("fsdp1", 3), ("fsdp2", 2))],
    ids=["fsdp2x2-to-ddpx3", "fsdp1x3-to-fsdp2x2"],
)
def test_reshard_through_s3(s3_pools, ceph_rgw, ceph_bucket, unique_prefix, src, dst):
    (sfw, sworld), (dfw, dworld) = src, dst
    url = f"s3://{ceph_bucket}/{unique_prefix}/step-2"
    ref = s3_pools(sworld).run(cases.save_case, sfw, url, variant_for(sfw, sworld), timeout=300)[0]
    got = s3_pools(dworld).run(cases.load_case, dfw, url, variant_for(dfw, dworld), timeout=300)[0]
    assert_same_state(ref, got, f"{sfw} x{sworld} -> {dfw} x{dworld} on S3")
    assert got["step"] == 2
    # one process, no torch.distributed, options passed explicitly
    sd = bytecp.load_state_dict(url, storage_options=ceph_rgw.options())
    assert_matches_full(ref, sd, f"{sfw} x{sworld} -> 1 process on S3")
