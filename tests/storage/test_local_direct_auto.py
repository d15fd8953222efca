"""Local backend, direct=None (the default): large files go through O_DIRECT
where the filesystem allows it."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from bytecp.storage.local import DIRECT_MIN_BYTES, LocalStorage

import bytecp
import bytecp.cli


def big_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"big": torch.randn(DIRECT_MIN_BYTES // 4 + 123, generator=g), "small": torch.arange(7.0)}


def test_default_is_auto_and_large_saves_round_trip(tmp_path: Path) -> None:
    assert LocalStorage(str(tmp_path)).direct is None or not hasattr(os, "O_DIRECT")
    state = big_state()
    url = str(tmp_path / "ck")
    bytecp.save(url, state, io_threads=1)
    sd = bytecp.load_state_dict(url)
    assert torch.equal(sd["big"], state["big"]) and torch.equal(sd["small"], state["small"])
    assert bytecp.cli.main(["verify", url]) == 0


def test_backends_say_whether_reads_cross_a_network(tmp_path: Path) -> None:
    """The load pipeline turns zero-redundancy loading on by default for remote backends only."""
    from bytecp.storage.s3 import S3Storage

    from bytecp.storage_api import open_storage

    assert open_storage(str(tmp_path)).remote is False
    assert open_storage("memory://remote-flag").remote is False
    assert S3Storage.remote is True
