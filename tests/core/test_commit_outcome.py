"""The commit's outcome for a large state (bytecp/saving/outcome.py): its
small members travel, its large ones are read from metadata.json when first
asked for, and a checkpoint overwritten or removed since says so."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import shutil
from pathlib import Path

import pytest
import torch

import bytecp
from bytecp.errors import CorruptCheckpointError
from bytecp.format import member_text
from bytecp.format import metadata as fmt
from bytecp.saving.outcome import LAZY_FIELDS, CommittedMetadata, outcome_of
from bytecp.storage_api import open_storage


def _state(n: int) -> dict[str, object]:
    return {"model": {f"w{i}": torch.full((2, 3), float(i)) for i in range(n)}, "step": 3}


def test_a_small_states_outcome_is_the_metadata_without_its_kept_text(tmp_path: Path) -> None:
    md = bytecp.save(str(tmp_path / "ck"), _state(3))
    assert md.encoded is not None  # (the coordinator's: its skeleton's and tensors' JSON text)
    sent = outcome_of(md)
    assert type(sent) is fmt.Metadata and sent.encoded is None and sent == md and sent.to_bytes() == md.to_bytes()


def test_committed_metadata_prints_without_reading_and_compares_and_copies_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    md = bytecp.save(str(tmp_path / "ck"), _state(40))
    monkeypatch.setattr(member_text, "LARGE_STATE", 10)
    got = pickle.loads(pickle.dumps(outcome_of(md))).attach(open_storage(str(tmp_path / "ck")))
    assert md.save_id in repr(got) and "tensors" not in got.__dict__  # printing read nothing
    assert got == md and md == got
    for c in (copy.copy(got), copy.deepcopy(got)):
        assert type(c) is fmt.Metadata and c == md and dict(c.tensors) == dict(md.tensors)


def test_a_large_states_outcome_reads_its_large_members_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             ) -> None:
    md = bytecp.save(str(tmp_path / "ck"), _state(40))
    monkeypatch.setattr(member_text, "LARGE_STATE", 10)
    sent = outcome_of(md)
    assert isinstance(sent, CommittedMetadata) and not set(LAZY_FIELDS) & set(sent.__dict__)
    wire = pickle.dumps(sent)
    assert len(wire) < len(pickle.dumps(md)) / 4
    got = pickle.loads(wire).attach(open_storage(str(tmp_path / "ck")))
    assert (got.save_id, got.step, got.world_size) == (md.save_id, md.step, md.world_size)
    assert dict(got.tensors) == dict(md.tensors) and got.skeleton.to_json() == md.skeleton.to_json()
    assert (got.data_files, got.objects, got.index.to_json()) == (md.data_files, md.objects, md.index.to_json())
    assert "_storage" not in pickle.loads(pickle.dumps(got)).__dict__  # (the storage never travels)
    whole = dataclasses.replace(got, step=9)
    assert whole.step == 9 and dict(whole.tensors) == dict(md.tensors)
    with pytest.raises(RuntimeError, match="no storage"):
        _ = pickle.loads(wire).tensors


def test_a_checkpoint_overwritten_or_removed_since_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = str(tmp_path / "ck")
    md = bytecp.save(url, _state(40))
    monkeypatch.setattr(member_text, "LARGE_STATE", 10)
    sent = pickle.dumps(outcome_of(md))
    bytecp.save(url, _state(41), overwrite=True)
    with pytest.raises(CorruptCheckpointError, match=f"now holds save .*, not save {md.save_id}"):
        _ = pickle.loads(sent).attach(open_storage(url)).tensors
    shutil.rmtree(url)
    with pytest.raises(CorruptCheckpointError, match=f"metadata.json of save {md.save_id} is gone"):
        _ = pickle.loads(sent).attach(open_storage(url)).data_files


def test_a_large_states_load_sends_the_ranks_its_metadata_json_text(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A load's metadata broadcast (bytecp/loading/opened.py ``Shared``): a
    large state's metadata travels as the text it was read from, parsed by
    each rank into the same metadata; a small one's as the object."""
    from bytecp.loading import opened

    url = str(tmp_path / "ck")
    bytecp.save(url, _state(40))
    small = pickle.loads(pickle.dumps(opened.open_checkpoint(url).share()))
    assert small.raw is None and len(small.metadata.tensors) == 40
    monkeypatch.setattr(member_text, "LARGE_STATE", 10)
    shared = opened.open_checkpoint(url).share()
    assert shared.raw == (tmp_path / "ck" / "metadata.json").read_bytes()
    got = pickle.loads(pickle.dumps(shared))
    assert got.raw is None and got.index == shared.index
    assert got.metadata.to_bytes() == shared.metadata.to_bytes()
    assert dict(got.metadata.tensors) == dict(small.metadata.tensors)
    assert got.metadata.skeleton.to_json() == small.metadata.skeleton.to_json()
