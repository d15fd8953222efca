"""A Hugging Face directory under an S3 prefix (moto and Ceph RGW) loads with
``bytecp.load`` and ``bytecp.load_state_dict`` bitwise equal to
``from_pretrained``'s weights, reading only the tensors' byte ranges."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist import hf_source_cases as hf  # noqa: E402

import bytecp
from bytecp.storage_api import open_storage

pytestmark = pytest.mark.s3


def test_hf_dir_on_s3(s3, unique_prefix, tmp_path: Path) -> None:
    server, bucket = s3
    opts = server.options()
    local = hf.save("llama", tmp_path / "m", sharded=True)
    ref = hf.reference("llama", local)
    url = f"s3://{bucket}/{unique_prefix}/llama"
    storage = open_storage(url, **opts)
    for f in sorted(local.iterdir()):
        storage.write_file(f.name, [f.read_bytes()])
    model = hf.build("llama", seed=1)
    bytecp.load(url, {"model": model}, storage_options=opts)
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k]), k
    whole = bytecp.load_state_dict(url, storage_options=opts)
    assert set(whole) == set(ref)
    for k, v in ref.items():
        assert torch.equal(whole[k], v), k
    storage.delete_prefix()
