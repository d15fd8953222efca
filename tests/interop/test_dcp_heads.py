"""DCP chunks located from their archives' heads and tails
(:mod:`bytecp.interop.dcp_heads`): the same rows as the full read of every
archive, in two requests per file; a damaged head or central directory in
the middle of a file read the full way (and refused there in one line)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import bytecp
from bytecp.errors import CorruptCheckpointError, FormatVersionError
from bytecp.interop import dcp_heads, dcp_items
from bytecp.storage_api import open_storage


def _save(path: Path, state: dict[str, Any]) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path))
    return path


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    shapes = [(3, 5), (300,), (7, 70000), (1,), (2, 3, 4), (0, 4), (40000,)]
    return {f"t{i}": torch.randn(*s).to(d) for i, s in enumerate(shapes)
            for d in (torch.float32, torch.bfloat16, torch.int64)[i % 3:i % 3 + 1]}


def _chunks(path: Path) -> tuple[Any, list[dcp_heads.Chunk]]:
    st = open_storage(str(path))
    md = dcp_items.read_metadata(st, "w")
    items = dcp_items.storage_items(md, "w", st.file_sizes(""))
    chunks = []
    for key, e in md.state_dict_metadata.items():
        dtype, shape, boxes = dcp_items.tensor_entry("w", key, e)
        chunks += [(key, dtype, shape, o, n, items[(key, o)]) for o, n in boxes]
    return st, chunks


class _Counting:
    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def read_ranges(self, path: str, ranges: Any, **kw: Any) -> None:
        self.calls += 1
        self.inner.read_ranges(path, ranges, **kw)


def test_rows_equal_the_full_read_in_two_requests(tmp_path: Path) -> None:
    state = _state()
    st, chunks = _chunks(_save(tmp_path / "ck", state))
    counting = _Counting(st)
    rows = dcp_heads.locate_chunks(counting, chunks)  # type: ignore[arg-type]
    assert rows == dcp_items.locate_chunks(st, chunks)
    assert counting.calls == 2  # heads, then tails: one file, one batch
    got = bytecp.load_state_dict(str(tmp_path / "ck"))
    assert all(torch.equal(got[k], v) for k, v in state.items())


def test_damage_in_the_middle_is_read_the_full_way(tmp_path: Path) -> None:
    path = _save(tmp_path / "ck", _state())
    st, chunks = _chunks(path)
    middle = sorted(chunks, key=lambda c: c[5][1])[3]
    _, start, length = middle[5]
    data = path / "__0_0.distcp"
    blob = bytearray(data.read_bytes())
    head = dcp_heads.head_layout(bytes(blob[start:start + dcp_heads.HEAD_BYTES]), length)
    assert head is not None and head[1] == "0"
    blob[start + head[2]:start + head[2] + 4] = b"QQQQ"  # the storage's local header: the directory still finds it
    data.write_bytes(bytes(blob))
    with pytest.raises(CorruptCheckpointError, match=f"tensor '{middle[0]}'"):
        bytecp.load_state_dict(str(path))

    blob[start + head[2]:start + head[2] + 4] = b"PK\x03\x04"
    cd = blob.rfind(b"PK\x01\x02", start, start + length)  # its central directory's last entry
    blob[cd:cd + 4] = b"QQQQ"
    data.write_bytes(bytes(blob))
    with pytest.raises(CorruptCheckpointError, match=f"tensor '{middle[0]}'.*damaged central directory"):
        bytecp.load_state_dict(str(path))


def test_a_tensor_not_dense_is_still_refused(tmp_path: Path) -> None:
    path = _save(tmp_path / "ck", {"a": torch.ones(4), "w": torch.randn(4, 6).t(), "z": torch.zeros(3)})
    with pytest.raises(FormatVersionError, match="'w'.*not dense"):
        bytecp.load_state_dict(str(path))
