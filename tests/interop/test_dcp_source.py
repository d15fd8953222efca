"""A DCP checkpoint written by ``torch.distributed.checkpoint.save`` in one
process, read by bytecp as it is: nested values and tensors of several
dtypes, ``format=``, and crafted inputs (a ``.metadata`` that would run
code, one declaring 10^12 elements, a truncated ``.distcp``) each refused
in one line before anything is allocated."""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import bytecp
from bytecp.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    StateMismatchError,
)
from bytecp.interop import dcp as dcp_source
from bytecp.interop import find_source
from bytecp.storage_api import open_storage


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "model": {"w": torch.randn(5, 3), "b": torch.arange(7, dtype=torch.bfloat16), "i": torch.arange(4)},
        "extra": {"step": 3, "name": "run", "pair": (1, 2), "nested": [1, {"t": torch.ones(2)}]},
    }


def _save(path: Path, state: dict[str, Any]) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... assuming a single process"
        dcp.save(state, checkpoint_id=str(path))
    return path


def _one_line(fn: Any, cls: type[BaseException], *parts: str) -> str:
    with pytest.raises(cls) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg, msg
    for p in parts:
        assert p in msg, (p, msg)
    return msg


def test_plain_dcp_loads_whole_and_in_place(tmp_path: Path) -> None:
    want = _state()
    path = _save(tmp_path / "ck", want)
    st = open_storage(str(path))
    assert dcp_source.detect(st) and find_source(st) == "dcp"
    for sd in (bytecp.load_state_dict(str(path)), bytecp.load_state_dict(str(path), format="dcp")):
        for k, v in want["model"].items():
            assert sd["model"][k].dtype == v.dtype and torch.equal(sd["model"][k], v), k
        assert sd["extra"]["step"] == 3 and sd["extra"]["name"] == "run" and sd["extra"]["pair"] == (1, 2)
        assert sd["extra"]["nested"][0] == 1 and torch.equal(sd["extra"]["nested"][1]["t"], torch.ones(2))
    state = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}, "extra": {"step": 0, "name": ""}}
    res = bytecp.load(str(path), state, strict=False)
    assert state["extra"] == {"step": 3, "name": "run"} and "extra.pair" in res.unexpected_keys
    assert all(torch.equal(state["model"][k], v) for k, v in want["model"].items())


def test_names_exact_and_dtypes_never_cast(tmp_path: Path) -> None:
    path = _save(tmp_path / "ck", _state())
    state = {"model": {"w": torch.zeros(5, 3), "b": torch.zeros(7), "i": torch.zeros(4, dtype=torch.int64)}}
    with pytest.raises(StateMismatchError, match=r"model.b: checkpoint has bfloat16 \[7\], target is float32"):
        bytecp.load(str(path), state, strict=False)


def test_format_option(tmp_path: Path) -> None:
    path = _save(tmp_path / "ck", _state())
    _one_line(lambda: bytecp.load_state_dict(str(path), format="bytecp"), FileNotFoundError,
              "torch.distributed.checkpoint (DCP)", "format='bytecp'")
    _one_line(lambda: bytecp.load_state_dict(str(path), format="dcpp"), ConfigError, "format='dcpp'", "dcp")
    ck = tmp_path / "bytecp"
    bytecp.save(str(ck), {"w": torch.ones(2)})
    _one_line(lambda: bytecp.load_state_dict(str(ck), format="dcp"), CheckpointNotFoundError,
              f"{ck}/.metadata is missing", "not a DCP checkpoint")


class _Evil:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, ("echo never",))


def test_crafted_inputs_refused_in_one_line(tmp_path: Path) -> None:
    path = _save(tmp_path / "ck", _state())
    meta = path / ".metadata"
    good = meta.read_bytes()
    meta.write_bytes(pickle.dumps(_Evil()))
    _one_line(lambda: bytecp.load_state_dict(str(path)), CorruptCheckpointError,
              f"{path}/.metadata", "names the global posix.system")

    md = pickle.loads(good)  # a real Metadata, edited: a tensor of 10^12 elements
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    w = md.state_dict_metadata["model.w"]
    w.size = torch.Size([10**6, 10**6])
    w.chunks = [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([10**6, 10**6]))]
    meta.write_bytes(pickle.dumps(md))
    _one_line(lambda: bytecp.load_state_dict(str(path)), CorruptCheckpointError,
              "'model.w', float32 [1000000, 1000000]", "refusing to allocate")

    meta.write_bytes(good)
    data = path / "__0_0.distcp"
    blob = data.read_bytes()
    data.write_bytes(blob[: len(blob) // 2])
    _one_line(lambda: bytecp.load_state_dict(str(path)), CorruptCheckpointError, "__0_0.distcp is truncated")
    end = blob.rfind(b"PK\x05\x06")  # the last item's archive damaged, its size kept
    data.write_bytes(blob[:end] + b"XX" + blob[end + 2:])
    _one_line(lambda: bytecp.load_state_dict(str(path)), CorruptCheckpointError, "__0_0.distcp (tensor 'extra.nested.1.t'",
              "no zip end-of-central-directory record")
