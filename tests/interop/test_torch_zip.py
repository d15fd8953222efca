"""bytecp.interop.torch_zip: torch.save archives read without torch.load --
tensors located (contiguous or not, inside a larger file), bare pickles, and
every hostile input refused in one line."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from bytecp.errors import CorruptCheckpointError
from bytecp.interop import torch_zip
from bytecp.storage_api import open_storage


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("echo never",))


def _state() -> dict[str, object]:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {"a": base, "view": base[1:3], "t": base.t(), "p": torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16)),
            "empty": torch.empty(0, 5), "x": [1, (2, 3), {"s": {4}}], "b": b"xy", "dt": torch.int8}


def test_tensors_located_in_a_byte_range(tmp_path: Path) -> None:
    obj = _state()
    torch.save(obj, tmp_path / "f.pt")
    blob = (tmp_path / "f.pt").read_bytes()
    (tmp_path / "g.bin").write_bytes(b"j" * 37 + blob + b"tail")
    st = open_storage(str(tmp_path))
    for file, start, length in (("f.pt", 0, None), ("g.bin", 37, len(blob))):
        tree = torch_zip.read_torch_file(st, file, start=start, length=length)
        assert tree["x"] == [1, (2, 3), {"s": {4}}] and tree["b"] == b"xy" and tree["dt"] is torch.int8
        for k in ("a", "view", "t", "p", "empty"):
            t, want = tree[k], obj[k].detach()  # type: ignore[attr-defined]
            assert isinstance(t, torch_zip.StoredTensor) and t.file == file
            assert torch.equal(torch_zip.materialize(st, t), want)
            if t.contiguous and t.nbytes:
                raw = bytearray(st.read_bytes(file, t.data_offset, t.nbytes))
                assert torch.equal(torch.frombuffer(raw, dtype=want.dtype).reshape(want.shape), want)
        assert not tree["t"].contiguous and tree["view"].contiguous and tree["view"].storage_offset == 6


def test_code_refused_by_name(tmp_path: Path) -> None:
    torch.save({"e": _Evil()}, tmp_path / "evil.pt")
    st = open_storage(str(tmp_path))
    with pytest.raises(CorruptCheckpointError, match=r"evil.pt: the pickle names the global posix.system") as e:
        torch_zip.read_torch_file(st, "evil.pt")
    assert "\n" not in str(e.value)
    with pytest.raises(CorruptCheckpointError, match="x.pkl: the pickle names the global posix.system"):
        torch_zip.restricted_loads(pickle.dumps(_Evil()), "x.pkl")
    # a global the caller allows for this call only
    assert torch_zip.restricted_loads(pickle.dumps(Path("a")), "p", {"pathlib.PosixPath": str}) == "a"


def test_damaged_archives_refused(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(1000)}, tmp_path / "f.pt")
    blob = (tmp_path / "f.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(blob[:-300])
    (tmp_path / "short.pt").write_bytes(blob[:2000] + blob[-300:])  # the directory says more than is there
    st = open_storage(str(tmp_path))
    with pytest.raises(CorruptCheckpointError, match="cut.pt: has no zip end-of-central-directory record"):
        torch_zip.read_torch_file(st, "cut.pt")
    with pytest.raises(CorruptCheckpointError, match="short.pt"):
        torch_zip.read_torch_file(st, "short.pt")
    with pytest.raises(CorruptCheckpointError, match="over the 10 byte budget"):
        torch_zip.restricted_loads(pickle.dumps(list(range(100))), "big.pkl", max_bytes=10)
    with pytest.raises(CorruptCheckpointError, match="more than 5 objects"):
        torch_zip.restricted_loads(pickle.dumps(list(range(100))), "many.pkl", max_objects=5)
