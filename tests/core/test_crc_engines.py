"""The crc32c engines (:mod:`bytecp.format.checksum`): crc32c-rs where it is
installed and agrees with the crc32c package at import, else the crc32c
package; both give the same checksums, so a checkpoint one wrote verifies
with the other, and an engine that disagrees is never used.
"""

from __future__ import annotations

import importlib.abc
import logging
import os
import random
import sys
import types
from pathlib import Path

import crc32c as crc32c_pkg
import pytest
import torch

import bytecp
from bytecp.errors import ConfigError, CorruptCheckpointError
from bytecp.format import checksum
from bytecp.storage_api import open_storage
from bytecp.tools.inspect import verify
from bytecp.tree.regions import Region
from tests.core.test_block_checks import load_box


@pytest.fixture()
def rs() -> types.ModuleType:
    """The crc32c-rs package (the tests of fakes in its place run without it)."""
    return pytest.importorskip("crc32c_rs", reason="the crc32c-rs engine is not installed (pip install bytecp[fast])")


def test_the_engine_in_use_is_crc32c_rs_where_installed_and_agrees_with_the_package(rs: types.ModuleType) -> None:
    assert checksum.ENGINE == (os.environ.get("BYTECP_CRC32C", "").lower() or "crc32c-rs")
    assert checksum._crc is (rs.crc32c if checksum.ENGINE == "crc32c-rs" else crc32c_pkg.crc32c)
    assert checksum.crc32c(b"x", (1 << 32) + 5) == crc32c_pkg.crc32c(b"x", 5)  # (a value's low 32 bits)
    rnd = random.Random(7)
    for n in (0, 1, 3, 31, 255, 1024, 4096, 65_536, 262_144, 1_000_003):
        data = rnd.randbytes(n)
        view = memoryview(data)
        for at in (0, 1, 3):
            seed = rnd.getrandbits(32)
            assert checksum.crc32c(view[at:], seed) == crc32c_pkg.crc32c(view[at:], seed)
        # the block sums of a chunk, fed in pieces: the same under either engine
        got = checksum.sums(data, 4096)
        assert got.crc == crc32c_pkg.crc32c(data)
        assert all(checksum.block_crc(got.blocks, k) == crc32c_pkg.crc32c(data[k * 4096:(k + 1) * 4096])
                   for k in range(checksum.block_count(n, 4096)))


def test_bytecp_crc32c_forces_an_engine_and_names_the_choices_when_wrong(monkeypatch: pytest.MonkeyPatch,
                                                                        rs: types.ModuleType) -> None:
    monkeypatch.setenv("BYTECP_CRC32C", "crc32c")
    assert checksum._pick() == (crc32c_pkg.crc32c, "crc32c")
    monkeypatch.setenv("BYTECP_CRC32C", "CRC32C-RS")
    assert checksum._pick() == (rs.crc32c, "crc32c-rs")
    monkeypatch.setenv("BYTECP_CRC32C", "zlib")
    with pytest.raises(ConfigError, match=r"BYTECP_CRC32C='zlib' names no crc32c engine: set it to one of "
                                          r"crc32c-rs, crc32c, or unset it"):
        checksum._pick()
    monkeypatch.setitem(sys.modules, "crc32c_rs", None)  # (not installed: its import fails)
    monkeypatch.setenv("BYTECP_CRC32C", "crc32c-rs")
    with pytest.raises(ConfigError, match=r"the crc32c-rs package is not installed: pip install 'bytecp\[fast\]'"):
        checksum._pick()
    monkeypatch.delenv("BYTECP_CRC32C")
    assert checksum._pick() == (crc32c_pkg.crc32c, "crc32c")


class _BrokenBuild(importlib.abc.MetaPathFinder):
    """An installed crc32c-rs whose compiled part does not load."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "crc32c_rs":
            raise ImportError("libc.so.6: version `GLIBC_2.99' not found", name="crc32c_rs._crc32c_rs")
        return None


def test_a_crc32c_rs_that_does_not_import_is_not_taken_for_a_missing_one(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delitem(sys.modules, "crc32c_rs", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenBuild(), *sys.meta_path])
    monkeypatch.delenv("BYTECP_CRC32C", raising=False)
    with caplog.at_level(logging.WARNING, logger="bytecp.format.checksum"):
        assert checksum._pick() == (crc32c_pkg.crc32c, "crc32c")
    assert "crc32c-rs failed its check here (ImportError: libc.so.6: version `GLIBC_2.99' not found)" in caplog.text
    monkeypatch.setenv("BYTECP_CRC32C", "crc32c-rs")
    with pytest.raises(ConfigError, match="BYTECP_CRC32C=crc32c-rs but crc32c-rs failed its check here"):
        checksum._pick()


@pytest.mark.parametrize("broken", ["raises", "no function"])
def test_a_broken_crc32c_rs_falls_back_with_a_warning_and_forced_is_an_error(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, broken: str) -> None:
    def boom(data: object, value: int = 0) -> int:
        raise RuntimeError("illegal instruction")

    fake = types.SimpleNamespace(crc32c=boom) if broken == "raises" else types.SimpleNamespace()
    monkeypatch.setitem(sys.modules, "crc32c_rs", fake)
    monkeypatch.delenv("BYTECP_CRC32C", raising=False)
    with caplog.at_level(logging.WARNING, logger="bytecp.format.checksum"):
        assert checksum._pick() == (crc32c_pkg.crc32c, "crc32c")
    assert "crc32c-rs failed its check here (" in caplog.text and "using the crc32c package" in caplog.text
    monkeypatch.setenv("BYTECP_CRC32C", "crc32c-rs")
    with pytest.raises(ConfigError, match=r"BYTECP_CRC32C=crc32c-rs but crc32c-rs failed its check here"):
        checksum._pick()


@pytest.mark.parametrize("wrong", ["vectors", "long unaligned", "continued"])
def test_an_engine_that_disagrees_with_the_package_is_not_used(monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture, wrong: str) -> None:
    def bad(data: object, value: int = 0) -> int:
        view = memoryview(data).cast("B")  # type: ignore[arg-type]
        right = crc32c_pkg.crc32c(view, value)
        if wrong == "vectors" and view.nbytes == 9:
            return right ^ 1
        if wrong == "long unaligned" and view.nbytes > 4096 and view.obj is not None and view.nbytes % 2:
            return right ^ 1
        if wrong == "continued" and value:
            return right ^ 1
        return right

    monkeypatch.setitem(sys.modules, "crc32c_rs", types.SimpleNamespace(crc32c=bad, __version__="9.9"))
    monkeypatch.delenv("BYTECP_CRC32C", raising=False)
    with caplog.at_level(logging.WARNING, logger="bytecp.format.checksum"):
        assert checksum._pick() == (crc32c_pkg.crc32c, "crc32c")
    assert "crc32c-rs 9.9 computed other checksums than the crc32c package here" in caplog.text
    monkeypatch.setenv("BYTECP_CRC32C", "crc32c-rs")  # forced: an error, never silently the other one
    with pytest.raises(ConfigError, match="BYTECP_CRC32C=crc32c-rs but crc32c-rs 9.9 computed other checksums"):
        checksum._pick()


def _state() -> dict[str, dict[str, torch.Tensor]]:
    torch.manual_seed(3)
    return {"model": {"w": torch.randn(300, 1000), "b": torch.randn(77), "i": torch.arange(5000)}}


@pytest.mark.parametrize("writer", ["crc32c-rs", "crc32c"])
def test_a_checkpoint_one_engine_wrote_loads_and_verifies_with_the_other(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str, rs: types.ModuleType) -> None:
    calls = {"crc32c-rs": 0, "crc32c": 0}

    def counted(name: str, fn: object) -> object:
        def run(data: object, value: int = 0) -> int:
            calls[name] += 1
            return fn(data, value)  # type: ignore[operator,no-any-return]
        return run

    engines = {"crc32c-rs": counted("crc32c-rs", rs.crc32c), "crc32c": counted("crc32c", crc32c_pkg.crc32c)}
    monkeypatch.setattr(checksum, "BLOCK_BYTES", 64 << 10)  # w: 1.2 MB, 19 blocks
    reader = next(e for e in engines if e != writer)
    state = _state()
    monkeypatch.setattr(checksum, "_crc", engines[writer])
    bytecp.save(str(tmp_path / "ck"), state)
    h = bytecp.async_save(str(tmp_path / "lazy"), state, lazy=True)  # summed on the copy's way
    h.wait()
    assert calls[writer] > 0 and calls[reader] == 0  # (the engine set is the one that summed)
    monkeypatch.setattr(checksum, "_crc", engines[reader])
    for name in ("ck", "lazy"):
        got = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
        bytecp.load(str(tmp_path / name), got)
        assert all(torch.equal(got["model"][k], v) for k, v in state["model"].items())
        box = Region((75, 3), (150, 990))  # part of w's chunk: its blocks checked one by one
        part, _ = load_box(str(tmp_path / name), "model.w", box, torch.float32)
        assert torch.equal(part, state["model"]["w"][box.slices()])
        checked, problems = verify(open_storage(str(tmp_path / name)))
        assert checked > 0 and problems == []
    # and a flipped byte is still found by the other engine
    data = next(p for p in (tmp_path / "ck" / "data").rglob("*.bin"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    assert calls[reader] > 0
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        bytecp.load(str(tmp_path / "ck"), {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}})


@pytest.mark.spawn
def test_bytecp_crc32c_chooses_the_engine_of_a_new_process(tmp_path: Path) -> None:
    import subprocess

    env = {**os.environ, "BYTECP_CRC32C": "crc32c"}
    out = subprocess.run([sys.executable, "-c", "from bytecp.format import checksum; print(checksum.ENGINE)"],
                         env=env, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "crc32c"


def test_a_range_s_sums_from_its_blocks_make_the_combine_tables_of_a_new_block_size(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``checksum.sums_from_blocks``: the range's crc32c and blocks are one pass's; a block size no
    earlier call used gets its combine tables made (else each combine costs 13 us instead of 0.5)."""
    block = 12_347
    monkeypatch.setattr(checksum, "_SHIFTS", {})
    data = random.Random(3).randbytes(5 * block + 77)
    blocks = [checksum.crc32c(data[at:at + block]) for at in range(0, len(data), block)]
    got = checksum.sums_from_blocks(blocks, block, len(data))
    assert block in checksum._SHIFTS
    assert got == checksum.sums(data, block) == (checksum.crc32c(data), b"".join(c.to_bytes(4, "little") for c in blocks))
