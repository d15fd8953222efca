"""The version-4 commit beyond the exact check's world size: each rank checks
its own chunks, the coordinator that together they hold every element once.

Jobs of more than ``EXACT_CHECK_RANKS`` ranks send the coordinator only
their part entries; here the limit is lowered to 0 so that a one-process
save takes that path.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import bytecp
from bytecp.errors import ConfigError
from bytecp.format import parts_build
from bytecp.saving import writer


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 8, generator=g), "b": torch.randn(8, generator=g), "s": torch.tensor(3.0)}


def test_a_save_past_the_exact_check_commits_and_loads_bitwise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer, "EXACT_CHECK_RANKS", 0)
    state = _state()
    bytecp.save(str(tmp_path / "ck"), state)
    got = bytecp.load_state_dict(str(tmp_path / "ck"))
    assert set(got) == set(state) and all(torch.equal(got[k], v) for k, v in state.items())


def test_parts_that_do_not_add_up_are_never_committed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that lost a chunk (its part holds one element fewer): the
    coordinator's sum differs from the tensors' and nothing is committed."""
    monkeypatch.setattr(writer, "EXACT_CHECK_RANKS", 0)
    real = parts_build.build_part

    def short(*args, **kwargs):  # type: ignore[no-untyped-def]
        part = real(*args, **kwargs)
        part.entries.elements -= 1
        return part

    monkeypatch.setattr(writer, "build_part", short)
    with pytest.raises(ConfigError, match=r"chunks hold 520 elements, the state.s tensors 521") as e:
        bytecp.save(str(tmp_path / "ck"), _state())
    assert "\n" not in str(e.value)
    assert not (tmp_path / "ck" / "metadata.json").exists()
    assert not any((tmp_path / "ck").rglob("*.bin")), list((tmp_path / "ck").rglob("*"))
