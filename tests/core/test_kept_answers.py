"""What a save keeps between saves of a state whose structure is unchanged
(bytecp.tree.kept, the tensor table's memo, the object blobs already
checked) is given again only while it is still the answer: the top of the
state changing around kept pieces, a tensor table's checks, an object whose
blob changes."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from bytecp.adapters._watch import DESCRIBE_STATS
from torch import nn

import bytecp
from bytecp.errors import ConfigError
from bytecp.format import objects
from bytecp.format.chunk_batch import ChunkBatch
from bytecp.format.index_build import check_chunks, specs_of
from bytecp.format.metadata import ChunkRecord, Metadata
from bytecp.format.tensor_table import TensorTable
from bytecp.saving import commit

from .test_describe_reuse import MODES, Net, reference, same, saved_and_checked, train


def _top_keys(url: Path) -> list[Any]:
    return json.loads((url / "metadata.json").read_text())["skeleton"]["k"]


@pytest.mark.parametrize("mode", MODES)
def test_the_top_of_the_state_changes_around_kept_pieces(tmp_path: Path, mode: str) -> None:
    """The model and optimizer stay (their descriptions kept), the entry
    beside them changes its structure and kind, then the keys move, come and
    go: every checkpoint holds the state of its own call, under its own
    keys, bitwise."""
    m = Net()
    o = torch.optim.Adam(m.parameters(), lr=1e-2)
    train(m, o, 0)
    states: list[dict[str, Any]] = [
        {"model": m, "optim": o, "extra": {"step": 1}},
        {"model": m, "optim": o, "extra": {"step": 1}},  # (the same: the kept answers stand)
        {"model": m, "optim": o, "extra": {"step": 2, "more": [1, 2]}},
        {"model": m, "optim": o, "extra": torch.arange(3)},
        {"model": m, "optim": o, "extra": [{"step": 3}]},
        {"optim": o, "model": m, "extra": 4},
        {"net": m, "optim": o, "extra": 5},
        {"net": m, "optim": o},
    ]
    for i, state in enumerate(states):
        kept = DESCRIBE_STATS.kept
        url = tmp_path / str(i)
        saved_and_checked(mode, str(url), state)
        assert _top_keys(url) == list(state), f"save {i}"
        if 1 <= i <= 4:  # (other keys: another description)
            assert DESCRIBE_STATS.kept == kept + 1, f"save {i}: the kept pieces were not used"
        train(m, o, i + 1)


def _rows(boxes: list[tuple[str, tuple[int, ...], tuple[int, ...]]]) -> ChunkBatch:
    out, pos = [], 0
    for fqn, offsets, lengths in boxes:
        n = int(np.prod(lengths)) * 4
        out.append(ChunkRecord(fqn, "float32", (4, 6), offsets, lengths, "d.bin", pos, n, 0))
        pos += n
    return ChunkBatch.of(out)


def test_a_tables_checks_are_made_once_and_still_check() -> None:
    """The commit checks' columns of a tensor table are kept in its memo (the
    union's table serves every save of the state): the second check uses
    them, and they still find a gap and an overlap, naming the tensor."""
    table = TensorTable.of({"a": {"dtype": "float32", "shape": [4, 6]}, "b": {"dtype": "float32", "shape": [4, 6]}})
    files = {"d.bin": 1 << 20}
    whole = _rows([("a", (0, 0), (4, 6)), ("b", (0, 0), (2, 6)), ("b", (2, 0), (2, 6))])
    check_chunks([whole], table, files)
    assert specs_of(table) is specs_of(table)
    check_chunks([whole], table, files)
    with pytest.raises(ConfigError, match="tensor 'b' of shape \\[4, 6\\]: the ranks' shards hold 12 of its 24"):
        check_chunks([_rows([("a", (0, 0), (4, 6)), ("b", (0, 0), (2, 6))])], table, files)
    with pytest.raises(ConfigError, match="tensor 'a'.*overlap"):
        check_chunks([_rows([("a", (0, 0), (4, 6)), ("a", (1, 0), (1, 6)), ("b", (0, 0), (4, 6))])], table, files,
                     whole=False)


class Opaque:
    """A value only an arbitrary pickle can hold."""

    def __init__(self, x: int) -> None:
        self.x = x


def test_an_object_blob_checked_once_is_checked_again_when_it_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A value that serializes to the bytes already checked is not unpickled
    again; any other is, so a value that only an arbitrary pickle holds is
    still refused under the same name."""
    loads: list[int] = []
    real = torch.load

    def counting(*args: Any, **kwargs: Any) -> Any:
        loads.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", counting)
    groups = [{"lr": 0.1, "betas": (0.9, 0.999), "params": list(range(50))}]
    first = objects.serialize("optim.param_groups", groups, allow_pickle=False)
    again = objects.serialize("optim.param_groups", [dict(groups[0])], allow_pickle=False)
    assert again.blob == first.blob and len(loads) == 1
    changed = [dict(groups[0], lr=0.05)]
    blob = objects.serialize("optim.param_groups", changed, allow_pickle=False).blob
    assert blob is not None and len(loads) == 2
    assert real(io.BytesIO(blob), weights_only=True) == changed
    with pytest.raises(ConfigError, match="'optim.param_groups' is a list, which can only be stored as an arbitrary"):
        objects.serialize("optim.param_groups", [Opaque(1)], allow_pickle=False)
    assert objects.serialize("optim.param_groups", [Opaque(1)], allow_pickle=True).pickle


def test_a_module_under_a_new_key_is_described_afresh(tmp_path: Path) -> None:
    """(the last case above, alone) A kept module saved under another key
    names its tensors under that key."""
    m = nn.Linear(3, 2)
    saved_and_checked("sync", str(tmp_path / "a"), {"model": m})
    saved_and_checked("sync", str(tmp_path / "b"), {"other": m})
    assert _top_keys(tmp_path / "b") == ["other"]


def _files(url: Path) -> set[str]:
    return {str(p.relative_to(url)) for p in url.rglob("*") if p.is_file() and "reports" not in p.parts}


def _needed(url: Path) -> set[str]:
    """The files the checkpoint at ``url`` needs (and any lock a save leaves)."""
    md = Metadata.from_bytes((url / "metadata.json").read_bytes(), str(url))
    return {"metadata.json", *md.referenced_files()} | {"bytecp-save.lock"} & _files(url)


@pytest.mark.parametrize("remembered", [True, False])
def test_an_overwrite_removes_the_files_of_the_save_it_replaces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                remembered: bool) -> None:
    """An overwrite of a checkpoint this process committed takes what it
    needs of it from its own record (the header names the same save; a job
    of too many data files keeps none), and of one another save has put there
    since from its metadata.json: either way exactly the replaced save's
    files go, and the new one loads bitwise."""
    if not remembered:
        monkeypatch.setattr(commit, "COMMITTED_MAX_FILES", 0)
    url, other = tmp_path / "latest", tmp_path / "other"
    m = Net()
    o = torch.optim.Adam(m.parameters(), lr=1e-2)
    state = {"model": m, "optim": o}
    for i in range(3):
        train(m, o, i)
        if i == 0:
            saved_and_checked("lazy", str(url), state)
        else:
            _overwrite(url, state)
        assert _files(url) == _needed(url), sorted(_files(url) ^ _needed(url))
    # another save (of another process, say) replaces the checkpoint behind this process's back
    train(m, o, 5)
    saved_and_checked("sync", str(other), state)
    shutil.rmtree(url)
    shutil.copytree(other, url)
    train(m, o, 6)
    _overwrite(url, state)
    assert not _files(url) & (_files(other) - {"metadata.json"}), "the replaced save's files stayed"
    assert _files(url) == _needed(url), sorted(_files(url) ^ _needed(url))


def _overwrite(url: Path, state: dict[str, Any]) -> None:
    want = reference(state)
    bytecp.async_save(str(url), state, lazy=True, overwrite=True).wait()
    same(bytecp.load_state_dict(str(url)), want, str(url))
