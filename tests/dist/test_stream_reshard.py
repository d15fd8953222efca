"""Streaming data loaders across a world-size change on real gloo ranks, end to
end through ``bytecp.save``/``bytecp.load``: a Hugging Face iterable dataset
saved by 2 ranks and loaded by 4 (every example of the epoch read once); a
merge of partly read shards (4 -> 2) refused on every rank before anything is
loaded; torchtitan's dataloader saved by 2 data-parallel ranks and loaded by
3 through the torchtitan adapter (every token of the data trained once)."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from tests.data.hf_sim import write_shards

from . import stream_cases

pytestmark = pytest.mark.timeout(600)


def test_hf_iterable_dataset_2_to_4_and_a_refused_merge(pools, tmp_path: Path) -> None:
    files = write_shards(tmp_path / "shards", [12] * 8)
    url = str(tmp_path / "ck")
    saved = pools(2).run(stream_cases.hf_save, url, list(files.paths), 3, 3, workers=2)
    got = pools(4).run(stream_cases.hf_load, url, list(files.paths), 3, workers=2)
    every = [x for r in saved for b in r["before"] for x in b] + [x for r in got for x in r["after"]]
    assert sorted(every) == files.all_ids()
    url = str(tmp_path / "ck4")
    pools(4).run(stream_cases.hf_save, url, list(files.paths), 3, 2)  # 6 of 12 examples of each rank's first shard
    for r in pools(2).run(stream_cases.hf_load, url, list(files.paths), 3):
        assert r["untouched"] and "would be read twice" in r["error"] and "'extra.dataloader'" in r["error"], r


def test_torchtitan_dataloader_2_to_3(pools, tmp_path: Path) -> None:
    from tests.data.titan_sim import assets

    root = tmp_path / "titan"
    data = assets(root / "probe")
    url = str(tmp_path / "ck")
    saved = pools(2).run(stream_cases.titan_save, url, str(root), 3)
    got = pools(3).run(stream_cases.titan_load, url, str(root))
    tokens = collections.Counter(t for r in saved for row in r["rows"] for t in row)
    tokens += collections.Counter(t for r in got for t in [x for row in r["rows"] for x in row] + r["buffer"])
    assert tokens == collections.Counter(t for d in data.docs for t in d)
