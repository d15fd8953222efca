"""Serving deltas in one process: what a save writes (``serving_dtype=``) is
exactly the serving-dtype elements that changed, and a follower holding
bf16 weights (``bytecp.follow(..., dtype=torch.bfloat16)``) takes each step
from them bitwise -- step by step, behind by several steps, from a whole
copy when it starts mid-run, and by whole tensors when a delta is missing or
damaged or its held state is not the checkpoint's (reported)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import bytecp
from bytecp.catalog import list_checkpoints
from bytecp.format import serving_wire as wire
from bytecp.saving import serving as serving_mod
from bytecp.tree.regions import Region

pytestmark = pytest.mark.timeout(300)

BF16 = torch.bfloat16


def _model(seed: int = 0, dtype: torch.dtype = torch.float32, frozen: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(96, 128), nn.ReLU(), nn.Linear(128, 16)).to(dtype)
    if frozen:
        m[0].requires_grad_(False)
    return m


def _train(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(8, 96, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int16)


def _same_bf16(served: nn.Module, trainer: nn.Module) -> bool:
    got, want = served.state_dict(), trainer.state_dict()
    return set(got) == set(want) and all(torch.equal(_bits(got[k]), _bits(v.to(BF16))) for k, v in want.items())


def _by_deltas(up: Any, n: int = 4) -> bool:
    """Every tensor of the update taken by deltas: those changed by them, the rest unchanged, none read whole."""
    return up.tensors_read == up.tensors_by_delta and up.tensors_by_delta + up.tensors_unchanged == n \
        and up.tensors_by_delta > 0


def _files(ck: Path) -> tuple[str, Path]:
    sid = json.loads((ck / "metadata.json").read_text())["save_id"]
    return sid, ck / "serving" / sid


def _entries(ck: Path, rank: int = 0) -> wire.RankEntries:
    sid, d = _files(ck)
    return wire.RankEntries.from_bytes((d / f"{rank}.json").read_bytes(), str(d))


def _run(tmp_path: Path, lr: float = 1e-4, **kw: Any) -> tuple[str, nn.Module, torch.optim.Optimizer,
                                                                bytecp.CheckpointManager]:
    run = str(tmp_path / "run")
    model = _model(frozen=kw.pop("frozen", False))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    mgr = bytecp.CheckpointManager(run, every_n_steps=1, keep_last=kw.pop("keep_last", 20),
                                   serving_dtype=BF16, **kw)
    return run, model, opt, mgr


def _following(tmp_path: Path) -> tuple[str, nn.Module, torch.optim.Optimizer, bytecp.CheckpointManager,
                                        nn.Module, Any]:
    """A run at lr 1e-5 saved at step 1 and a bf16 follower holding that step."""
    run, model, opt, mgr = _run(tmp_path, lr=1e-5)
    served = _model(seed=3, dtype=BF16)
    gen = bytecp.follow(run, {"model": served}, poll_s=0.01, dtype=BF16, on_error="raise")
    _train(model, opt, 1)
    mgr.save(1, {"model": model, "optimizer": opt})
    assert next(gen).ok
    return run, model, opt, mgr, served, gen


def test_a_save_writes_exactly_the_changed_bf16_elements(tmp_path: Path) -> None:
    run, model, opt, mgr = _run(tmp_path, lr=1e-6, full_every=3, keep_every_n_steps=5, frozen=True)
    before: dict[str, torch.Tensor] = {}
    links: list[wire.Link | None] = []
    for step in range(1, 8):
        _train(model, opt, step)
        mgr.save(step, {"model": model, "optimizer": opt})
        ck = Path(run) / f"step-{step}"
        sid, d = _files(ck)
        man = wire.Manifest.from_bytes((d / "serving.json").read_bytes(), str(d))
        ents = _entries(ck)
        links.append(man.previous)
        assert man.dtype == "bfloat16" and man.step == step and ents.previous == man.previous
        now = {f"model.{k}": v.to(BF16) for k, v in model.state_dict().items()}
        assert {e.fqn for e in ents.entries} == set(now)  # the optimizer's tensors get none
        payload = (d / "0.bin").read_bytes() if ents.delta_nbytes else b""
        whole = (d / "0.whole.bin").read_bytes() if ents.whole_nbytes else b""
        # the first, every full_every-th and a milestone (keep_every_n_steps; the count starts again there),
        # both kinds on a whole save
        assert bool(whole) == (step in (1, 4, 5)), step
        for e in ents.entries:
            bits = _bits(now[e.fqn]).reshape(-1).numpy().view(np.uint16)
            assert e.box == Region((0,) * now[e.fqn].dim(), tuple(now[e.fqn].shape))
            assert e.checksum == wire.box_checksum(bits, e.box, now[e.fqn].shape), e.fqn
            if e.whole is not None:
                assert np.array_equal(np.frombuffer(whole[e.whole.offset:e.whole.offset + e.whole.nbytes],
                                                    np.uint16), bits)
            if step == 1:
                assert e.delta is None
                continue
            assert e.delta is not None
            old = _bits(before[e.fqn]).reshape(-1).numpy().view(np.uint16)
            want = np.flatnonzero(old != bits)
            raw = payload[e.delta.offset:e.delta.offset + e.delta.nbytes]
            n = e.delta.count
            pos = wire.decode_positions(raw[2 * n:], n, e.box.numel, "test")
            assert np.array_equal(pos, want) and np.array_equal(np.frombuffer(raw[:2 * n], np.uint16), bits[want])
            assert e.before == wire.box_checksum(old, e.box, now[e.fqn].shape)
            if e.fqn.startswith("model.0."):  # frozen: referenced (written whole at step 4), no change
                assert n == 0 and e.checksum == e.before
            else:
                assert n < e.box.numel
        assert any(e.delta is not None and e.delta.count for e in ents.entries) or step == 1
        before = now
    assert links[0] is None and [x.step for x in links[1:] if x is not None] == [1, 2, 3, 4, 5, 6]


def test_a_bf16_follower_takes_each_step_by_deltas_bitwise(tmp_path: Path) -> None:
    run, model, opt, mgr = _run(tmp_path, lr=1e-5)
    served = _model(seed=3, dtype=BF16)
    gen = bytecp.follow(run, {"model": served}, poll_s=0.01, dtype=BF16, on_error="raise")
    total_bf16 = sum(p.numel() * 2 for p in model.parameters())
    for step in range(1, 6):
        _train(model, opt, step)
        mgr.save(step, {"model": model, "optimizer": opt})
        up = next(gen)
        assert up.ok and up.step == step and not up.fallbacks, up
        assert _same_bf16(served, model), step
        assert _by_deltas(up), up  # the first from the whole serving copy, then by deltas
        if step > 1:
            assert up.delta_steps == 1 and 0 < up.elements_changed and up.bytes_read < total_bf16 / 2, up
    gen.close()


def test_behind_by_several_steps_the_chain_or_whole_tensors(tmp_path: Path) -> None:
    run, model, opt, mgr = _run(tmp_path, lr=1e-6, full_every=100)
    served = _model(seed=3, dtype=BF16)
    gen = bytecp.follow(run, {"model": served}, poll_s=0.01, dtype=BF16, on_error="raise")
    _train(model, opt, 1)
    mgr.save(1, {"model": model, "optimizer": opt})
    assert next(gen).ok
    for step in (2, 3, 4, 5):
        _train(model, opt, step)
        mgr.save(step, {"model": model, "optimizer": opt})
    up = next(gen)
    assert up.ok and up.step == 5 and up.skipped == 3 and up.delta_steps == 4 and _by_deltas(up), up
    assert _same_bf16(served, model)
    # a large learning rate changes nearly every element: deltas would take more bytes than the boxes, which
    # the trainer writes whole instead; the follower reads step 9's whole bf16 copies, not the fp32 tensors
    for g in opt.param_groups:
        g["lr"] = 0.5
    for step in (6, 7, 8, 9):
        _train(model, opt, step)
        mgr.save(step, {"model": model, "optimizer": opt})
    up = next(gen)
    assert up.ok and up.step == 9 and up.delta_steps == 0 and up.tensors_by_delta == 4 and not up.fallbacks, up
    assert up.bytes_read < 0.6 * sum(p.numel() * 4 for p in model.parameters()), up
    assert _same_bf16(served, model)
    for e in _entries(Path(run) / "step-9").entries:  # dense changes: whole boxes, their checksums summed afresh
        now = model.state_dict()[e.fqn.removeprefix("model.")].to(BF16)
        bits = _bits(now).reshape(-1).numpy().view(np.uint16)
        assert e.delta is None and e.whole is not None and e.checksum == wire.box_checksum(bits, e.box, now.shape)
    # behind by ten steps of a moderate rate: layer 0 changes ~5% of its elements a step, a ten-step chain
    # costing more than the tensor (each changed element counted as ELEMENT_BYTES more): read whole (fp32) and
    # cast; layer 2 changes >10% a step, which the trainer wrote whole: read from step 19's bf16 copy
    for g in opt.param_groups:
        g["lr"] = 1e-4
    for step in range(10, 20):
        _train(model, opt, step)
        mgr.save(step, {"model": model, "optimizer": opt})
    up = next(gen)
    assert up.ok and up.step == 19 and up.tensors_read == 4 and up.tensors_by_delta == 2 and not up.fallbacks, up
    assert up.delta_steps == 0 and up.elements_changed == 0, up
    assert up.bytes_read == 4 * (96 * 128 + 128) + 2 * (128 * 16 + 16), up
    assert _same_bf16(served, model)
    gen.close()


def _flip(path: Path, at: int) -> None:
    with path.open("r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x5A]))


@pytest.mark.parametrize("damage", ["flipped", "entries deleted", "payload deleted"])
def test_a_missing_or_damaged_delta_falls_back_to_the_whole_tensor(tmp_path: Path, damage: str,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    run, model, opt, mgr = _run(tmp_path, lr=1e-5)
    served = _model(seed=3, dtype=BF16)
    gen = bytecp.follow(run, {"model": served}, poll_s=0.01, dtype=BF16, on_error="raise")
    for step in (1, 2):
        _train(model, opt, step)
        mgr.save(step, {"model": model, "optimizer": opt})
        assert next(gen).ok
    _train(model, opt, 3)
    mgr.save(3, {"model": model, "optimizer": opt})
    _, d = _files(Path(run) / "step-3")
    ents = _entries(Path(run) / "step-3")
    if damage == "flipped":
        e = max(ents.entries, key=lambda e: e.delta.nbytes if e.delta else 0)
        assert e.delta is not None
        _flip(d / "0.bin", e.delta.offset + e.delta.nbytes // 2)
    else:
        (d / ("0.json" if damage == "entries deleted" else "0.bin")).unlink()
    with caplog.at_level(logging.WARNING, logger="bytecp"):
        up = next(gen)
    assert up.ok and up.step == 3 and up.fallbacks, up
    assert _same_bf16(served, model)  # read whole instead, bitwise
    why = " ".join(up.fallbacks)
    if damage == "flipped":
        assert up.tensors_by_delta == up.tensors_read - 1 and f"step-3/serving/{ents.save_id}/0.bin" in why and "crc32c" in why, why
    else:
        assert up.tensors_by_delta == 0 and ("0.json" in why or "0.bin" in why), why
    assert "read whole instead of by serving deltas" in caplog.text
    _train(model, opt, 4)  # the next step is by deltas again: they are relative to step 3, held whole
    mgr.save(4, {"model": model, "optimizer": opt})
    up = next(gen)
    assert up.ok and _by_deltas(up) and not up.fallbacks and _same_bf16(served, model), up
    gen.close()


@pytest.mark.parametrize("pieces", [False, True])
def test_a_follower_starting_mid_run_starts_from_the_last_whole_copy(tmp_path: Path, pieces: bool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    if pieces:  # every payload file read in many pieces on threads (as a whole serving copy over 8 MiB is)
        from bytecp.serving import deltas

        monkeypatch.setattr(deltas, "PIECE_BYTES", 96)
    run, model, opt, mgr = _run(tmp_path, lr=1e-6, full_every=4)
    for step in range(1, 8):  # whole copies at steps 1 and 5
        _train(model, opt, step)
        mgr.save(step, {"model": model, "optimizer": opt})
    served = _model(seed=3, dtype=BF16)
    up = next(bytecp.follow(run, {"model": served}, poll_s=0.01, dtype=BF16, on_error="raise"))
    assert up.ok and up.step == 7 and _by_deltas(up) and up.delta_steps == 2, up  # whole at 5, then 6, 7
    fp32 = sum(p.numel() * 4 for p in model.parameters())
    assert up.bytes_read < 0.75 * fp32, up
    assert _same_bf16(served, model)


def test_a_follower_starting_after_retention_removed_every_whole_copy_reads_whole_quietly(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An evaluation job started mid-run, after retention removed the last
    whole copy: it holds nothing, so no chain of deltas could serve it; it
    reads the checkpoint's tensors whole and cast, with nothing to report (no
    delta it needed was missing), then follows by deltas."""
    run, model, opt, mgr = _run(tmp_path, lr=1e-5, keep_last=2)
    for step in range(1, 5):  # the whole copies of step 1 go with it
        _train(model, opt, step)
        mgr.save(step, {"model": model, "optimizer": opt})
    assert sorted(c.step for c in list_checkpoints(run)) == [3, 4]
    served = _model(seed=3, dtype=BF16)
    gen = bytecp.follow(run, {"model": served}, poll_s=0.01, dtype=BF16, on_error="raise")
    with caplog.at_level(logging.WARNING, logger="bytecp"):
        up = next(gen)
    assert up.ok and up.step == 4 and up.tensors_by_delta == 0 and not up.fallbacks, up
    assert "serving deltas" not in caplog.text, caplog.text
    assert _same_bf16(served, model)
    _train(model, opt, 5)
    mgr.save(5, {"model": model, "optimizer": opt})
    up = next(gen)
    assert up.ok and up.step == 5 and _by_deltas(up) and not up.fallbacks and _same_bf16(served, model), up
    gen.close()


def test_a_held_follower_whose_chain_is_broken_reads_whole_and_says_how_many(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A follower holding step 1, two steps behind, the serving files of
    step 2 gone: every changed tensor is read whole (bitwise), the update
    reports the broken chain and the warning counts those tensors."""
    import shutil

    run, model, opt, mgr, served, gen = _following(tmp_path)
    for step in (2, 3):
        _train(model, opt, step)
        mgr.save(step, {"model": model, "optimizer": opt})
    shutil.rmtree(_files(Path(run) / "step-2")[1])
    with caplog.at_level(logging.WARNING, logger="bytecp"):
        up = next(gen)
    assert up.ok and up.step == 3 and up.tensors_by_delta == 0 and up.tensors_read == 4, up
    assert any("no serving deltas" in f for f in up.fallbacks), up.fallbacks
    assert "4 tensor(s) read whole instead of by serving deltas" in caplog.text, caplog.text
    assert _same_bf16(served, model)
    gen.close()


def test_a_follower_in_another_dtype_than_the_deltas_reads_whole_and_is_told_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The trainer writes bf16 deltas, the follower holds float16: every
    update reads the tensors whole and cast (bitwise) and reports why; the
    warning, a setting to change, is logged at the first update only."""
    run, model, opt, mgr = _run(tmp_path, lr=1e-5)
    served = _model(seed=3, dtype=torch.float16)
    gen = bytecp.follow(run, {"model": served}, poll_s=0.01, dtype=torch.float16, on_error="raise")
    with caplog.at_level(logging.WARNING, logger="bytecp"):
        for step in (1, 2, 3):
            _train(model, opt, step)
            mgr.save(step, {"model": model, "optimizer": opt})
            up = next(gen)
            assert up.ok and up.step == step and up.tensors_by_delta == 0 and up.tensors_read == 4, up
            assert any("serving deltas in bfloat16, not float16" in f for f in up.fallbacks), up.fallbacks
            got, want = served.state_dict(), model.state_dict()
            assert all(torch.equal(got[k], v.to(torch.float16)) for k, v in want.items())
    warned = [r.getMessage() for r in caplog.records if "serving deltas in bfloat16" in r.getMessage()]
    assert len(warned) == 1 and "serving_dtype=torch.float16" in warned[0] and "4 tensor(s)" in warned[0], warned
    gen.close()


def test_a_held_state_that_is_not_the_checkpoint_is_caught(tmp_path: Path) -> None:
    run, model, opt, mgr, served, gen = _following(tmp_path)
    _train(model, opt, 2)
    mgr.save(2, {"model": model, "optimizer": opt})
    e = next(e for e in _entries(Path(run) / "step-2").entries if e.fqn == "model.0.weight")
    assert e.delta is not None and e.delta.count
    raw = (_files(Path(run) / "step-2")[1] / "0.bin").read_bytes()[e.delta.offset:e.delta.offset + e.delta.nbytes]
    first = int(wire.decode_positions(raw[2 * e.delta.count:], e.delta.count, e.box.numel, "t")[0])
    with torch.no_grad():  # someone wrote into the weights where the next step changes them
        served[0].weight.view(-1)[first] += 1.0
    up = next(gen)
    assert up.ok and any("model.0.weight" in f and "element checksum" in f for f in up.fallbacks), up
    assert up.tensors_by_delta == up.tensors_read - 1 and _same_bf16(served, model)
    gen.close()


def test_a_run_without_deltas_is_read_whole_and_cast_quietly(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mgr = bytecp.CheckpointManager(run, every_n_steps=1)
    served = _model(seed=3, dtype=BF16)
    gen = bytecp.follow(run, {"model": served}, poll_s=0.01, dtype=BF16, on_error="raise")
    for step in (1, 2):
        _train(model, opt, step)
        mgr.save(step, {"model": model, "optimizer": opt})
        up = next(gen)
        assert up.ok and up.tensors_by_delta == 0 and not up.fallbacks and _same_bf16(served, model), up
    gen.close()


@pytest.mark.parametrize("lazy", [False, True])
def test_async_saves_write_deltas_on_the_background_path(tmp_path: Path, lazy: bool) -> None:
    run, model, opt, mgr = _run(tmp_path, lr=1e-5, async_save=True, lazy=lazy)
    served = _model(seed=3, dtype=BF16)
    gen = bytecp.follow(run, {"model": served}, poll_s=0.01, dtype=BF16, on_error="raise")
    for step in range(1, 4):
        _train(model, opt, step)
        want = {k: v.clone() for k, v in model.state_dict().items()}
        mgr.save(step, {"model": model, "optimizer": opt})
        mgr.wait()
        up = next(gen)
        assert up.ok and _by_deltas(up), up
        assert all(torch.equal(_bits(served.state_dict()[k]), _bits(v.to(BF16))) for k, v in want.items())
    gen.close()


def test_deltas_never_fail_a_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run, model, opt, mgr = _run(tmp_path, lr=1e-5)
    _train(model, opt, 1)
    mgr.save(1, {"model": model, "optimizer": opt})

    def broken(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(serving_mod.ServingWriter, "_add", broken)
    _train(model, opt, 2)
    mgr.save(2, {"model": model, "optimizer": opt})  # commits all the same, with no deltas
    assert not (Path(run) / "step-2" / "serving").exists() or not list((Path(run) / "step-2" / "serving").rglob("*"))
    monkeypatch.undo()
    _train(model, opt, 3)
    mgr.save(3, {"model": model, "optimizer": opt})  # its base was forgotten: whole again
    ents = _entries(Path(run) / "step-3")
    assert ents.previous is None and all(e.whole is not None and e.delta is None for e in ents.entries)
    served = _model(seed=3, dtype=BF16)
    up = next(bytecp.follow(run, {"model": served}, poll_s=0.01, dtype=BF16, on_error="raise"))
    assert up.ok and up.step == 3 and _same_bf16(served, model)


def test_a_failed_save_removes_its_deltas(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run, model, opt, mgr = _run(tmp_path, lr=1e-5)
    _train(model, opt, 1)
    mgr.save(1, {"model": model, "optimizer": opt})
    monkeypatch.setenv("BYTECP_FAULT_ERROR", "commit:0")
    _train(model, opt, 2)
    with pytest.raises(RuntimeError):  # the injected fault
        mgr.save(2, {"model": model, "optimizer": opt})
    assert not list((Path(run) / "step-2").rglob("serving/*/*"))
    monkeypatch.delenv("BYTECP_FAULT_ERROR")
    _train(model, opt, 3)
    mgr.save(3, {"model": model, "optimizer": opt})  # relative to step 1, the last committed
    assert _entries(Path(run) / "step-3").previous.name == "step-1"  # type: ignore[union-attr]


def test_bad_serving_options_are_refused() -> None:
    with pytest.raises(bytecp.ConfigError, match="serving_dtype"):
        bytecp.CheckpointManager("/tmp/x", serving_dtype="int8")
    with pytest.raises(bytecp.ConfigError, match="serving_prefixes needs serving_dtype"):
        bytecp.CheckpointManager("/tmp/x", serving_prefixes=["model"])
    with pytest.raises(bytecp.ConfigError, match="serving_dtype"):
        next(bytecp.follow("/tmp/x", {"model": _model()}, dtype=torch.int32))


def test_retention_keeps_the_deltas_a_live_follower_needs_and_drops_them_after(tmp_path: Path) -> None:
    run, model, opt, mgr = _run(tmp_path, lr=1e-6, keep_last=2, full_every=100)
    served = _model(seed=3, dtype=BF16)
    gen = bytecp.follow(run, {"model": served}, poll_s=0.01, dtype=BF16, on_error="raise")
    _train(model, opt, 1)
    mgr.save(1, {"model": model, "optimizer": opt})
    assert next(gen).ok  # holds step 1 (its marker under its lease)
    deadline = time.monotonic() + 30  # its marker, written by a thread of the follower's
    while not list((Path(run) / ".followers" / "held").glob("*.json")):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for step in range(2, 6):
        _train(model, opt, step)
        mgr.save(step, {"model": model, "optimizer": opt})
    root = Path(run)
    for gone in ("step-2", "step-3"):  # no longer checkpoints, but their deltas stay for the follower at 1
        assert not (root / gone / "metadata.json").exists() and (root / gone / "base.json").exists()
        assert list((root / gone / "serving").rglob("*.bin")) and not list((root / gone / "data").rglob("*"))
    assert [c.step for c in list_checkpoints(run)] == [4, 5]
    up = next(gen)
    assert up.ok and up.step == 5 and up.delta_steps == 4 and _by_deltas(up), up  # through 2 and 3
    assert _same_bf16(served, model)
    marker = next((root / ".followers" / "held").glob("*.json"))
    deadline = time.monotonic() + 30  # the marker is written by a thread of the follower's
    while json.loads(marker.read_text())["step"] != 5:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    _train(model, opt, 6)
    mgr.save(6, {"model": model, "optimizer": opt})  # the follower holds 5 now: 2, 3 (and 4) go whole
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-5", "step-6"]
    gen.close()
    assert not list((root / ".followers").rglob("held/*"))


def test_without_a_live_follower_deltas_go_with_their_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    run, model, opt, mgr = _run(tmp_path, lr=1e-5, keep_last=1)
    held = Path(run) / ".followers" / "held"
    held.mkdir(parents=True)  # a follower killed long ago: its marker stays, its lease does not
    (held / "20200101T000000-deadbeef.json").write_text(json.dumps({"name": "step-0", "save_id": "x", "step": 0}))
    for step in (1, 2, 3):
        _train(model, opt, step)
        mgr.save(step, {"model": model, "optimizer": opt})
    assert sorted(p.name for p in Path(run).iterdir() if p.name.startswith("step-")) == ["step-3"]


def test_gc_removes_the_deltas_of_a_save_that_never_committed(tmp_path: Path) -> None:
    from bytecp.storage_api import open_storage
    from bytecp.tools.gc import collect_garbage

    run, model, opt, mgr = _run(tmp_path, lr=1e-5)
    _train(model, opt, 1)
    mgr.save(1, {"model": model, "optimizer": opt})
    dead = Path(run) / "step-1" / "serving" / "20200101T000000-0badf00d"
    dead.mkdir()
    (dead / "0.json").write_text("{}")
    (dead / "0.bin").write_bytes(b"x")
    got = collect_garbage(open_storage(f"{run}/step-1"))
    assert sorted(got.removed) == ["serving/20200101T000000-0badf00d/0.bin", "serving/20200101T000000-0badf00d/0.json"]
    assert list((Path(run) / "step-1" / "serving").rglob("*.json"))  # the committed save's stay
