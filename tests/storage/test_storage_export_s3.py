"""``bytecp export`` to S3 (moto and a real Ceph RADOS Gateway): shards
streamed as multipart uploads, the in-place commit (index last), overwrite
rules, and what ``from_pretrained`` reads back."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from bytecp.storage.testing import MiB

import bytecp
from bytecp.cli import main as cli
from bytecp.storage_api import open_storage

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from export.helpers import config_dict, logits, tiny_gpt2  # noqa: E402
from export.test_hf_export import damage  # noqa: E402

pytestmark = [pytest.mark.s3, pytest.mark.timeout(600)]

VOCAB = 25_000  # the embedding (6.4 MB) is larger than a 5 MiB part: its shard is a streamed multipart upload


def download(url: str, options: dict[str, Any], dest: Path) -> list[str]:
    st = open_storage(url, **options)
    names = st.list_files()
    dest.mkdir(parents=True, exist_ok=True)
    for n in names:
        (dest / n).write_bytes(st.read_bytes(n))
    return names


@pytest.mark.spawn
def test_export_to_s3_loads_back(s3: Any, tmp_path: Path, unique_prefix: str, capsys: Any) -> None:
    from transformers import GPT2LMHeadModel

    server, bucket = s3
    model = tiny_gpt2(vocab_size=VOCAB)
    ck = tmp_path / "ck"
    bytecp.save(str(ck), {"model": model}, metadata={"hf_config": config_dict(model)})
    options = server.options(part_size=5 * MiB)
    out = f"s3://{bucket}/{unique_prefix}/hf"
    opts = ["--out-storage-options", json.dumps(options)]
    assert cli(["export", str(ck), out, "--max-shard-size", "2MB", "--workers", "2", *opts]) == 0
    names = download(out, options, tmp_path / "a")
    shards = [n for n in names if n.startswith("model-")]
    assert len(shards) >= 2 and "model.safetensors.index.json" in names and "config.json" in names
    assert open_storage(out, **options).list_incomplete_uploads() == []  # type: ignore[attr-defined]
    loaded = GPT2LMHeadModel.from_pretrained(str(tmp_path / "a")).eval()
    assert torch.equal(logits(loaded, VOCAB), logits(model, VOCAB))
    capsys.readouterr()  # transformers' own progress output

    # an existing output is refused without --overwrite, untouched
    assert cli(["export", str(ck), out, *opts]) == 2
    err = capsys.readouterr().err
    assert out in err and "--overwrite" in err and len(err.strip().splitlines()) == 1

    # a failed overwrite withdraws the old output (no index: nothing loads), leaves no upload behind
    bad = tmp_path / "bad"
    bytecp.save(str(bad), {"model": model})
    damage(bad, "model.transformer.h.1.mlp.c_proj.weight")
    assert cli(["export", str(bad), out, "--max-shard-size", "2MB", "--overwrite", *opts]) == 2
    assert "checksum mismatch" in capsys.readouterr().err
    left = open_storage(out, **options)
    assert "model.safetensors.index.json" not in left.list_files() and "model.safetensors" not in left.list_files()
    assert left.list_incomplete_uploads() == []  # type: ignore[attr-defined]

    # --overwrite with one shard: the old shards go, the new output loads, in bf16 as asked
    assert cli(["export", str(ck), out, "--overwrite", "--dtype", "bf16", *opts]) == 0
    names = download(out, options, tmp_path / "b")
    assert sorted(names) == ["config.json", "model.safetensors"]
    loaded = GPT2LMHeadModel.from_pretrained(str(tmp_path / "b"), dtype="auto").eval()
    assert loaded.dtype == torch.bfloat16
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v.to(torch.bfloat16)), k


def test_missing_bucket_is_one_line(moto_s3: Any, tmp_path: Path, capsys: Any) -> None:
    ck = tmp_path / "ck"
    bytecp.save(str(ck), {"model": torch.nn.Linear(3, 2)})
    opts = ["--out-storage-options", json.dumps(moto_s3.options())]
    assert cli(["export", str(ck), "s3://no-such-bucket-here/x/hf", *opts]) == 3
    err = capsys.readouterr().err
    assert "no-such-bucket-here" in err and "create it" in err and len(err.strip().splitlines()) == 1
    assert cli(["export", str(ck), "s3://no-such-bucket-here/m.safetensors", *opts]) == 3
    assert "no-such-bucket-here" in capsys.readouterr().err
