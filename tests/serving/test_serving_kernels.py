"""The compiled kernels of serving deltas (``bytecp.format._kernels``, loaded by
:mod:`bytecp.format.kernels`) against the NumPy definitions in
:mod:`bytecp.format.serving_wire`: the same positions, sums and writes on
random and damaged input, every element size; a damaged position list is
refused by both, nothing written; a build that is stale or disagrees is
never used; and a follower's update that fails after it changed boxes in
place puts every one back, with either engine."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import bytecp
from bytecp.errors import ConfigError, CorruptCheckpointError
from bytecp.format import kernels
from bytecp.format import serving_wire as wire

pytestmark = pytest.mark.timeout(300)

BUILT = kernels.load() is not None


@pytest.fixture(params=["c", "numpy"])
def engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test once per engine: the compiled kernels (skipped where this install has none) and NumPy's."""
    if request.param == "c" and not BUILT:
        pytest.skip("the compiled kernels are not in use here (not built at install: no C compiler; or BYTECP_KERNELS=0)")
    monkeypatch.setattr(kernels, "_LOADED", [kernels.load() if request.param == "c" else None])
    assert kernels.engine() == request.param
    return str(request.param)


def _decode(raw: bytes, count: int, numel: int) -> np.ndarray | str:
    try:
        return wire.decode_positions(raw, count, numel, "here")
    except CorruptCheckpointError as e:
        assert str(e).startswith("here: ")
        return "refused"


def _reference(raw: bytes, count: int, numel: int) -> np.ndarray | str:
    if count == 0:
        return _decode(raw, count, numel)
    try:
        return wire.decode_positions_reference(np.frombuffer(raw, dtype=np.uint8), count, numel, "here")
    except CorruptCheckpointError:
        return "refused"


def _same(a: np.ndarray | str, b: np.ndarray | str) -> bool:
    return a == b if isinstance(a, str) or isinstance(b, str) else np.array_equal(a, b)


@pytest.mark.skipif(not BUILT, reason="the compiled kernels are not in use here (not built at install: no C "
                    "compiler; or BYTECP_KERNELS=0)")
def test_positions_decode_alike_and_damage_is_refused_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kind of gap list, then each damaged in every way a byte can be:
    the compiled decoder returns what the NumPy one does, or refuses what it refuses."""
    monkeypatch.setattr(kernels, "_LOADED", [kernels.load()])
    assert kernels.engine() == "c"
    rng = np.random.default_rng(0)
    cases = 0
    for numel, count in [(1, 1), (200, 200), (200, 9), (40_000, 2_000), (3_000_000, 4_000), (1 << 42, 60)]:
        p = np.unique(rng.integers(0, numel, count, dtype=np.int64))
        raw = wire.encode_positions(p)
        assert np.array_equal(_decode(raw, len(p), numel), p)
        damaged = [raw[:-1], raw + b"\x01", raw[:-1] + bytes([raw[-1] | 0x80]), b"\x00" + raw,
                   raw[:1] + b"\x00" + raw[1:], raw + b"\xff" * 10 + b"\x01"]
        for _ in range(60):
            b = bytearray(raw)
            i = int(rng.integers(0, len(b)))
            b[i] = int(rng.integers(0, 256))
            damaged.append(bytes(b))
        for bad in damaged:
            for n, lim in ((len(p), numel), (len(p) + 1, numel), (len(p), int(p[-1]))):
                cases += 1
                assert _same(_decode(bad, n, lim), _reference(bad, n, lim)), (numel, count, bad[:12], n, lim)
    assert cases > 1000


def test_the_element_checksum_and_the_writes_agree_with_numpy(engine: str) -> None:
    rng = np.random.default_rng(1)
    for size in (1, 2, 4, 8):
        bits = wire.bits_dtype(size)
        live = rng.integers(0, np.iinfo(bits).max, 50_000, dtype=bits, endpoint=True)
        before = live.copy()
        q = np.unique(rng.integers(0, len(live), 3_000, dtype=np.int64))
        new = rng.integers(0, np.iinfo(bits).max, len(q), dtype=bits, endpoint=True)
        g = q * 7 + 3
        want = wire.change_sum_reference(g, new, before[q])
        assert wire.change_sum(g, new, before[q]) == want
        change, old = wire.swap_bits(live, q, new, g)
        assert change == want and np.array_equal(old, before[q])
        expect = before.copy()
        expect[q] = new
        assert np.array_equal(live, expect)
        wire.scatter_bits(live, q, old)  # undone
        assert np.array_equal(live, before)
        change, _ = wire.swap_bits(live, q, new, None, 11)  # linear index = position + 11
        assert change == wire.change_sum_reference(q + 11, new, before[q])


@pytest.mark.skipif(not BUILT, reason="the compiled kernels are not in use here (not built at install: no C "
                    "compiler; or BYTECP_KERNELS=0)")
def test_a_batch_of_boxes_applies_as_numpy_does_step_after_step() -> None:
    """``apply_deltas`` (a thread's boxes in one call) against NumPy: random
    boxes at random places of their tensors, several steps each, every
    element size; a box whose second step's positions are damaged is left as
    its first step made it (recorded: the caller puts it back) and takes no
    third step, the other boxes all of theirs; the records undo it all."""
    k = kernels.compiled()
    rng = np.random.default_rng(5)
    for size in (1, 2, 4, 8):
        bits = wire.bits_dtype(size)
        tensors = [rng.integers(0, np.iinfo(bits).max, n, dtype=bits, endpoint=True) for n in (5_000, 20_000, 7)]
        before = [t.copy() for t in tensors]
        expect = [t.copy() for t in tensors]
        jobs: list[Any] = []
        want: list[Any] = []
        recs: list[list[Any]] = []
        for box, (ti, start, numel) in enumerate([(0, 0, 5_000), (1, 300, 9_000), (1, 9_300, 10_000), (2, 2, 5)]):
            recs.append([])
            for step in range(3):
                p = np.unique(rng.integers(0, numel, max(1, numel // (3 + step)), dtype=np.int64))
                v = rng.integers(0, np.iinfo(bits).max, len(p), dtype=bits, endpoint=True)
                raw = v.tobytes() + wire.encode_positions(p)
                damaged = box == 1 and step == 1
                if damaged:  # the last gap left unfinished: "not the count of values"
                    raw = raw[:-1] + bytes([raw[-1] | 0x80])
                g_add = 1_000 * box
                code = 1 if damaged else 6 if box == 1 and step == 2 else 0
                if code == 0:
                    t = expect[ti]
                    want.append((0, wire.change_sum_reference(p + start + g_add, v, t[p + start])))
                    t[p + start] = v
                else:
                    want.append((code, None))
                jobs.append((tensors[ti], raw, len(p), numel, size, start, g_add, np.empty(len(p), np.int64),
                             np.empty(len(p), bits), recs[box], (box, step), box))
        assert k.apply_deltas(jobs) == want
        assert all(np.array_equal(t, e) for t, e in zip(tensors, expect, strict=True))
        assert [len(r) for r in recs] == [3, 1, 3, 3] and recs[1][0][0] == (1, 0)
        for r in reversed(recs):
            for _tag, held, q, old in reversed(r):
                wire.scatter_bits(held, q, old)
        assert all(np.array_equal(t, b) for t, b in zip(tensors, before, strict=True))


@pytest.mark.skipif(not BUILT, reason="the compiled kernels are not in use here (not built at install: no C "
                    "compiler; or BYTECP_KERNELS=0)")
def test_a_batch_refuses_jobs_that_do_not_fit_and_skips_a_failed_box_wherever_its_steps_are() -> None:
    """``apply_deltas``' checks: a box's steps interleaved with another's (a
    failed box takes none of its later steps, the other all of its); sizes
    and offsets whose products or sums would wrap past 2**63 refused (a
    ValueError, nothing written), as are buffers of the wrong size."""
    k = kernels.compiled()
    held = np.zeros(64, dtype=np.uint16)
    bad = np.uint16(1).tobytes() + b"\x80"  # one value, its gap unfinished

    def job(p: list[int], group: int, recs: list[Any], raw: bytes | None = None, **kw: Any) -> tuple[Any, ...]:
        v = np.full(len(p), 7 + group, dtype=np.uint16)
        args = dict(held=held, raw=raw if raw is not None else v.tobytes() + wire.encode_positions(np.array(p)),
                    count=len(p), numel=32, itemsize=2, start=0 if group == 0 else 32, g_add=0,
                    q=np.empty(len(p), np.int64), old=np.empty(len(p), np.uint16))
        args.update(kw)
        return (*args.values(), recs, group, group)

    a: list[Any] = []
    b: list[Any] = []
    got = k.apply_deltas([job([1], 0, a), job([2], 1, b), job([3], 0, a, raw=bad), job([4], 1, b, raw=bad),
                          job([5], 0, a), job([6], 1, b)])
    assert [c for c, _ in got] == [0, 0, 1, 1, 6, 6]
    assert [int(x) for x in np.flatnonzero(held)] == [1, 34] and len(a) == len(b) == 1
    before = held.copy()
    one = np.empty(1, np.int64)
    for kw in (dict(start=(1 << 63) - 8, numel=8), dict(count=1 << 61, itemsize=8, q=one[:0]),
               dict(count=1 << 62, q=one[:0], old=held[:0]), dict(q=np.empty(2, np.int64)), dict(numel=65)):
        with pytest.raises(ValueError, match="does not fit"):
            k.apply_deltas([job([1], 0, [], **kw)])
    assert np.array_equal(held, before)


def test_a_position_outside_the_tensor_writes_nothing(engine: str) -> None:
    live = np.arange(100, dtype=np.uint16)
    with pytest.raises(IndexError):
        wire.swap_bits(live, np.array([3, 50, 100], dtype=np.int64), np.array([9, 9, 9], dtype=np.uint16), None)
    assert np.array_equal(live, np.arange(100, dtype=np.uint16))
    if engine == "c":  # NumPy's own fancy assignment is not checked here: its writes are its own
        with pytest.raises(IndexError):
            wire.scatter_bits(live, np.array([3, -1], dtype=np.int64), np.array([9, 9], dtype=np.uint16))
        assert np.array_equal(live, np.arange(100, dtype=np.uint16))


def test_the_setting_and_a_build_that_cannot_be_used(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    import sys

    monkeypatch.setenv("BYTECP_KERNELS", "0")
    assert kernels.load() is None
    monkeypatch.setenv("BYTECP_KERNELS", "yes")
    with pytest.raises(ConfigError, match="BYTECP_KERNELS='yes': use 0"):
        kernels.load()
    monkeypatch.setenv("BYTECP_KERNELS", "1")
    stale = types.ModuleType("bytecp.format._kernels")
    stale.ABI = kernels.ABI + 1  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "bytecp.format._kernels", stale)
    with pytest.raises(ConfigError, match="another version"):
        kernels.load()
    monkeypatch.delenv("BYTECP_KERNELS")
    with caplog.at_level("WARNING", logger="bytecp.format.kernels"):
        assert kernels.load() is None
    assert "another version" in caplog.text
    if BUILT:  # a build whose sums are wrong is not used either
        import importlib

        monkeypatch.delitem(sys.modules, "bytecp.format._kernels")
        good = importlib.import_module("bytecp.format._kernels")
        wrong = types.ModuleType("bytecp.format._kernels")
        wrong.__dict__.update({k: getattr(good, k) for k in ("ABI", "decode_positions", "scatter", "swap_change_sum")})
        wrong.change_sum = lambda *a: good.change_sum(*a) + 1  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "bytecp.format._kernels", wrong)
        caplog.clear()
        with caplog.at_level("WARNING", logger="bytecp.format.kernels"):
            assert kernels.load() is None
        assert "element checksum differs" in caplog.text


def _model(seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(96, 128), torch.nn.ReLU(), torch.nn.Linear(128, 16)).to(dtype)


def _bits(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().view(torch.int16).clone() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("where", ["a later box", "the read of the rest", "right after a box's writes"])
def test_an_update_failing_after_changes_in_place_puts_them_back(tmp_path: Path, engine: str, where: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A follower changes its boxes in place as it applies deltas; when the
    update then fails (at a later box, or reading the tensors taken whole),
    the weights are bitwise what they were, the failure is reported, and the
    next update chains from the step still held: by deltas, bitwise."""
    from bytecp.serving import delta_batch, delta_update

    run = str(tmp_path / "run")
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    mgr = bytecp.CheckpointManager(run, every_n_steps=1, keep_last=10, serving_dtype=torch.bfloat16)
    served = _model(3, torch.bfloat16)
    gen = bytecp.follow(run, {"model": served}, poll_s=0.01, dtype=torch.bfloat16)

    def train(step: int) -> None:
        g = torch.Generator().manual_seed(step)
        model(torch.randn(8, 96, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        mgr.save(step, {"model": model, "optimizer": opt})

    train(1)
    assert next(gen).ok
    held = _bits(served)
    train(2)
    calls: list[int] = []
    real_swap, real_stage, real_batch = wire.swap_bits, delta_update.stage, delta_batch.apply

    changed: list[bool] = []  # whether the boxes were changed in place before the failure (else it proves little)

    def swap(*a: Any, **k: Any) -> Any:
        calls.append(1)
        if len(calls) == 3 and where == "a later box":
            changed.append(any(not torch.equal(v, held[k]) for k, v in _bits(served).items()))
            raise RuntimeError("the third box failed")
        got = real_swap(*a, **k)
        if len(calls) == 2 and where != "a later box":
            changed.append(any(not torch.equal(v, held[k]) for k, v in _bits(served).items()))
        if len(calls) == 2 and where != "a later box":  # an interruption as the call returns
            raise KeyboardInterrupt
        return got

    def batch(*a: Any, **k: Any) -> Any:  # (the compiled kernels: every box of a thread in one call)
        calls.append(1)
        real_batch(*a, **k)  # the boxes changed in place, then:
        changed.append(any(not torch.equal(v, held[k]) for k, v in _bits(served).items()))
        if where == "a later box":
            raise RuntimeError("the third box failed")
        raise KeyboardInterrupt  # as the call returns

    def stage(*a: Any, **k: Any) -> Any:
        calls.append(1)
        raise OSError("the storage went away")

    if where == "the read of the rest":
        monkeypatch.setattr(delta_update, "stage", stage)
    else:
        monkeypatch.setattr(wire, "swap_bits", swap)
        monkeypatch.setattr(delta_batch, "apply", batch)
    if where == "right after a box's writes":
        with pytest.raises(KeyboardInterrupt):
            next(gen)
        gen = bytecp.follow(run, {"model": served}, poll_s=0.01, dtype=torch.bfloat16)
        assert changed == [True]
        assert all(torch.equal(v, held[k]) for k, v in _bits(served).items())  # every box put back
        monkeypatch.setattr(wire, "swap_bits", real_swap)
        monkeypatch.setattr(delta_batch, "apply", real_batch)
        up = next(gen)  # a new follower (the interrupted one's generator is gone): from step 1's whole copy
        assert up.ok and up.step == 2 and not up.fallbacks, up
    else:
        up = next(gen)
        assert not up.ok and up.step == 2 and ("third box" in up.error or "storage went away" in up.error), up
        assert calls and changed == ([] if where == "the read of the rest" else [True])
        assert all(torch.equal(v, held[k]) for k, v in _bits(served).items())  # every box put back
    monkeypatch.setattr(wire, "swap_bits", real_swap)
    monkeypatch.setattr(delta_update, "stage", real_stage)
    monkeypatch.setattr(delta_batch, "apply", real_batch)
    train(3)
    up = next(gen)
    steps = 1 if where == "right after a box's writes" else 2  # chained from the step held
    assert up.ok and up.step == 3 and not up.fallbacks and up.delta_steps == steps, up
    assert up.tensors_by_delta == up.tensors_read > 0, up
    want = {k: v.to(torch.bfloat16).view(torch.int16) for k, v in model.state_dict().items()}
    assert all(torch.equal(v, want[k]) for k, v in _bits(served).items())
    gen.close()


@pytest.mark.parametrize("threads", [1, 2])
def test_positions_damaged_behind_a_valid_crc32c_fall_back_after_the_step_before(
        tmp_path: Path, engine: str, threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A delta whose crc32c holds but whose positions do not decode (a
    writer's bug, not a disk's), met as the second step of a follower's
    chain: that tensor's first step is put back and it is read whole
    instead, named in the fallbacks; every other tensor is taken by its two
    steps; all bitwise the trainer's weights at the step taken. On one
    thread and on two (the boxes dealt to the apply threads, however few)."""
    import json

    from bytecp.format.checksum import crc32c
    from bytecp.serving import delta_apply, delta_update

    monkeypatch.setattr(delta_update, "_THREADS", threads)
    monkeypatch.setattr(delta_apply, "PARALLEL_ELEMENTS", 0)

    run = str(tmp_path / "run")
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)  # (sparse changes: written as deltas, not whole)
    mgr = bytecp.CheckpointManager(run, every_n_steps=1, keep_last=10, serving_dtype=torch.bfloat16)
    served = _model(3, torch.bfloat16)
    gen = bytecp.follow(run, {"model": served}, poll_s=0.01, dtype=torch.bfloat16, on_error="raise")
    for step in (1, 2, 3):
        g = torch.Generator().manual_seed(step)
        model(torch.randn(8, 96, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        mgr.save(step, {"model": model, "optimizer": opt})
        if step == 1:
            assert next(gen).ok
    d = next((Path(run) / "step-3" / wire.SERVING_DIR).iterdir())
    doc = json.loads((d / "0.json").read_text())
    ent = max(doc["entries"], key=lambda e: e.get("delta", {}).get("count", 0))
    part = ent["delta"]
    data = bytearray((d / "0.bin").read_bytes())
    end = part["offset"] + part["nbytes"]
    data[end - 1] |= 0x80  # the last position's gap left unfinished
    part["crc32c"] = crc32c(bytes(data[part["offset"]:end]))
    (d / "0.bin").write_bytes(bytes(data))
    (d / "0.json").write_text(json.dumps(doc))
    up = next(gen)
    assert up.ok and up.step == 3 and up.delta_steps == 2, up
    assert up.tensors_by_delta == up.tensors_read - 1 and len(up.fallbacks) == 1, up
    assert ent["fqn"] in up.fallbacks[0] and "0.bin" in up.fallbacks[0] and "hold" in up.fallbacks[0], up
    want = {k: v.to(torch.bfloat16).view(torch.int16) for k, v in model.state_dict().items()}
    assert all(torch.equal(v, want[k]) for k, v in _bits(served).items())
    gen.close()


def test_changes_merged_aside_reach_every_live_tensor_strided_ones_too(engine: str) -> None:
    """A box held by two live tensors (one of them a transposed view of other
    memory) is not changed in place: its merged changes are written into
    each afterwards, at the same row-major positions, and their versions move."""
    from bytecp.serving.delta_apply import Target, scatter
    from bytecp.tree.regions import Region

    a = torch.zeros(6, 4, dtype=torch.bfloat16)
    b = torch.zeros(4, 6, dtype=torch.bfloat16).t()  # 6 x 4, not contiguous
    t = Target("w", Region((0, 0), (6, 4)), (6, 4), torch.bfloat16, [a, b])
    pos = np.array([1, 5, 23], dtype=np.int64)
    bits = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    versions = (a._version, b._version)
    scatter([t], {("w", t.box): (pos, bits)}, torch.bfloat16)
    for x in (a, b):
        assert x.reshape(-1)[pos].tolist() == [1.0, 2.0, 3.0] and int((x != 0).sum()) == 3
    assert a._version > versions[0] and b._version > versions[1]


def test_an_interruption_while_an_update_is_taken_comes_after_it() -> None:
    """``interrupts_held``: SIGINT arriving inside the block is delivered
    (KeyboardInterrupt) once the block is done, not in the middle of it."""
    import signal
    import threading

    from bytecp.serving.delta_apply import interrupts_held

    done = []
    # Python's own handler, whatever the test process had (a test runner's worker may ignore SIGINT)
    was = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with interrupts_held():
                # to this thread: a signal sent to the process may be taken by another thread
                # (pytest-xdist's), whose handler then runs after this block, not inside it
                signal.pthread_kill(threading.get_ident(), signal.SIGINT)
                for _ in range(1000):  # bytecodes run: the handler would have raised by now
                    pass
                done.append(1)
        assert done == [1]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, was)
