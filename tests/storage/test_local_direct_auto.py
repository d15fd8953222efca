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


def test_direct_reads_of_many_ranges_match_buffered_ones(tmp_path) -> None:
    """O_DIRECT reads of a batch: one open, one bounce buffer, ranges that follow each other (a
    checked load's edges and request) read as one span; unaligned, overlapping and out-of-order
    ranges come back as buffered reads give them; a range past the end fails naming the file."""
    import os as _os

    import pytest as _pytest
    from bytecp.storage.local import LocalStorage

    from bytecp.errors import CorruptCheckpointError

    data = _os.urandom(3 * (1 << 20) + 123)
    (tmp_path / "f.bin").write_bytes(data)
    spans = [(5000, 100), (5100, 300_000), (305_100, 77), (0, 10), (4096, 9000), (3 << 20, 123), (1 << 20, 2 << 20)]
    for direct in (True, False):
        st = LocalStorage(str(tmp_path), direct=direct)
        outs = [bytearray(n) for _, n in spans]
        st.read_ranges("f.bin", [(o, memoryview(b)) for (o, _), b in zip(spans, outs, strict=True)])
        assert [bytes(b) for b in outs] == [data[o : o + n] for o, n in spans], direct
        with _pytest.raises(CorruptCheckpointError, match="f.bin"):
            st.read_ranges("f.bin", [(len(data) - 10, memoryview(bytearray(20)))])
