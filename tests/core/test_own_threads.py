"""The threads a save runs beside training never get an OpenMP team of their
own (bytecp/saving/own_threads.py): torch runs their operations on them,
and nothing process-wide (the training thread's count, a new thread's) moves."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import bytecp
from bytecp.saving import hostcopy, writer
from bytecp.saving.own_threads import serial_torch

from .helpers import same_bits


def _in_thread(fn: Any) -> Any:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(timeout=60)
    return out[0]


def test_a_serial_thread_changes_nothing_beyond_itself() -> None:
    before = torch.get_num_threads()

    def serial() -> tuple[int, bool]:
        serial_torch()
        serial_torch()  # (once per thread: the second call does nothing)
        x = torch.randn(1 << 18)
        return torch.get_num_threads(), same_bits(x.clone() * 1, x)

    assert _in_thread(serial) == (1, True)
    assert torch.get_num_threads() == before
    assert _in_thread(torch.get_num_threads) == before  # a new thread still gets the process's count


@pytest.mark.parametrize("lazy", [False, True])
def test_every_thread_of_an_async_save_runs_torch_on_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            lazy: bool) -> None:
    """Whatever thread of an async save copies or writes a box -- the save's
    own thread, its copy and write threads, an eager save's copy-ahead helper -- runs
    torch on itself; the state saved has boxes torch would split (over
    32,768 elements, strided), in several data files."""
    seen: dict[str, set[int]] = {}
    before = torch.get_num_threads()
    torch.set_num_threads(4)  # a team torch would split boxes over (the suite runs with OMP_NUM_THREADS=1)

    def recorded(fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            seen.setdefault(threading.current_thread().name.rsplit("_", 1)[0], set()).add(torch.get_num_threads())
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(writer, "_write_one_file", recorded(writer._write_one_file))
    monkeypatch.setattr(writer, "FILE_TARGET_BYTES", 1 << 20)  # several files: the write threads
    monkeypatch.setattr(hostcopy, "_run", recorded(hostcopy._run))
    monkeypatch.setattr(hostcopy, "_copy_small", recorded(hostcopy._copy_small))
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(300, 700, generator=g).t(), "v": torch.randn(5 << 20, generator=g),
             "u": torch.randn(1 << 19, generator=g), "small": torch.randn(7, generator=g)}
    try:
        for i in range(3):
            bytecp.async_save(str(tmp_path / str(i)), state, lazy=lazy).wait()
            got = bytecp.load_state_dict(str(tmp_path / str(i)))
            assert all(same_bits(got[k], v) for k, v in state.items())
    finally:
        torch.set_num_threads(before)
    mine = {name: counts for name, counts in seen.items() if name != "MainThread"}  # (an eager caller copies too)
    assert "bytecp-write" in mine and len(mine) >= 2, seen
    assert all(counts == {1} for counts in mine.values()), seen
