"""A load of many small tensors (a mixture-of-experts rank holds tens of
thousands): what it costs per tensor was made of Python, torch calls that let
go of the GIL, system calls and a scan in torch's optimizer loading; each is
cut here and checked for what it must still do.

- ``adapters._optim.ParamIds``: the parameter ids handed to
  ``Optimizer.load_state_dict``, a list whose ``in`` is O(1) (torch scans a
  group's ids once per state tensor) and a plain scan again once changed;
- ``storage._posix.read_vectored``: ranges that follow each other in a file
  read by one ``preadv``, a file that ends early named at the first range it
  cuts, ``each`` still called in order;
- ``bytecp.tree.dtypes.host_memoryview``: a tensor's bytes by address, holding it;
- a load of a model of many small parameters with AdamW in several groups,
  bitwise, and an optimizer pre-hook that changes the ids still honoured;
- a load and a blocking save run with the cyclic collector paused (their
  objects would start collections of the whole heap) and turn it back on.
"""

from __future__ import annotations

import copy
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from bytecp.adapters._optim import ParamIds
from bytecp.storage._posix import VECTOR_BYTES, adjacent_runs, read_vectored

import bytecp
from bytecp.errors import CorruptCheckpointError, TransientStorageError
from bytecp.storage_api import open_storage
from bytecp.tree.dtypes import host_memoryview


def test_param_ids_answer_in_like_the_list_they_are() -> None:
    ids = ParamIds(5, 4)
    assert ids == [5, 6, 7, 8] and isinstance(ids, list) and len(ids) == 4
    assert [x in ids for x in (4, 5, 8, 9, -1)] == [False, True, True, False, False]
    assert 5.0 in ids and "5" not in ids and None not in ids  # (as a list answers: 5.0 == 5)
    for other in (copy.copy(ids), copy.deepcopy(ids), pickle.loads(pickle.dumps(ids))):
        assert type(other) is list and other == [5, 6, 7, 8]  # copies are plain lists
    assert ParamIds([3, 1]) == [3, 1] and 1 in ParamIds([3, 1]) and 2 not in ParamIds([3, 1])
    ids.append(42)
    assert 42 in ids and 9 not in ids
    ids[0] = 100
    assert 5 not in ids and 100 in ids
    ids.sort(reverse=True)
    assert ids[0] == 100 and 6 in ids
    empty = ParamIds(3, 0)
    assert empty == [] and 3 not in empty


def test_adjacent_ranges_run_together_up_to_the_cap() -> None:
    def r(offset: int, n: int) -> tuple[int, memoryview]:
        return offset, memoryview(bytearray(n))

    assert adjacent_runs([]) == []
    assert adjacent_runs([r(0, 10), r(10, 5), r(15, 1), r(20, 4), r(24, 4)]) == [(0, 3), (3, 5)]
    big = VECTOR_BYTES // 2 + 1
    assert adjacent_runs([r(0, big), r(big, big), r(2 * big, 1)]) == [(0, 1), (1, 3)]
    assert adjacent_runs([r(0, 3 * VECTOR_BYTES), r(3 * VECTOR_BYTES, 1)]) == [(0, 1), (1, 2)]
    many = [r(k, 1) for k in range(2500)]
    assert adjacent_runs(many) == [(0, 1024), (1024, 2048), (2048, 2500)]


def test_a_vectored_read_fills_every_view_and_stops_at_the_end(tmp_path: Path) -> None:
    data = os.urandom(70_000)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        views = [memoryview(bytearray(n)) for n in (0, 1, 4096, 7, 30_000)]
        assert read_vectored(fd, 100, views) == 34_104
        at = 100
        for v in views:
            assert bytes(v) == data[at : at + len(v)]
            at += len(v)
        tail = [memoryview(bytearray(10)), memoryview(bytearray(10))]
        assert read_vectored(fd, 69_985, tail) == 15  # the file ends inside the second view
        assert bytes(tail[0]) == data[69_985:69_995] and bytes(tail[1][:5]) == data[69_995:]
    finally:
        os.close(fd)


def test_local_read_ranges_reads_small_neighbours_together_and_names_a_short_file(tmp_path: Path) -> None:
    data = os.urandom(50_000)
    (tmp_path / "f.bin").write_bytes(data)
    st = open_storage(str(tmp_path))
    bufs = [memoryview(bytearray(n)) for n in (100, 200, 300, 50)]
    ranges = [(0, bufs[0]), (100, bufs[1]), (300, bufs[2]), (1000, bufs[3])]
    seen: list[int] = []
    st.read_ranges("f.bin", ranges, each=seen.append)
    assert seen == [0, 1, 2, 3]
    assert [bytes(b) for b in bufs] == [data[0:100], data[100:300], data[300:600], data[1000:1050]]
    short = [(49_000, memoryview(bytearray(500))), (49_500, memoryview(bytearray(1000)))]
    seen.clear()
    with pytest.raises(CorruptCheckpointError, match=r"f\.bin: file is truncated: wanted bytes \[49500, 50500\), "
                                                     r"file ends at 50000"):
        st.read_ranges("f.bin", short, each=seen.append)
    assert seen == [0]  # the range read whole was handed on before the error


def test_host_memoryview_is_the_tensors_own_bytes() -> None:
    t = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    v = host_memoryview(t)
    assert v.format == "B" and not v.readonly and bytes(v) == t.view(torch.uint8).numpy().tobytes()
    v[0:2] = bytes(t[2, 3].reshape(1).view(torch.uint8).numpy())
    assert t[0, 0] == 11
    assert len(host_memoryview(torch.empty(0, 5))) == 0
    row = torch.zeros(4, 6)[1]
    assert len(host_memoryview(row)) == 24
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        host_memoryview(torch.zeros(4, 6)[:, 1])
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        host_memoryview(torch.empty(3, device="meta"))
    with pytest.raises(ValueError, match="conj/neg"):  # its bytes are not its values
        host_memoryview(torch.ones(3, dtype=torch.complex64).conj())
    owned = host_memoryview(torch.arange(4, dtype=torch.int32))  # the view holds the tensor: nothing else does
    import gc

    gc.collect()
    [torch.full((4,), -1, dtype=torch.int32) for _ in range(100)]
    assert bytes(owned) == torch.arange(4, dtype=torch.int32).numpy().tobytes()


@pytest.mark.parametrize("summed", [True, False], ids=["compiled-reads", "python-reads"])
def test_a_read_abandoned_at_its_timeout_never_writes_into_freed_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                         summed: bool) -> None:
    """A local read that outlives its request timeout (a hung mount) goes on
    in its worker thread after the load failed: the buffers it fills stay
    alive until it ends (they hold their tensors), never memory the
    process has given to something else since -- on both read paths (the
    compiled checked reads hold every range's buffer until they return)."""
    import time
    import types

    import bytecp.storage.local as local

    from bytecp.format import checked_reads

    bytecp.save(str(tmp_path / "ck"), {"x": torch.full((64, 64), 7.0)})
    if summed:
        k = checked_reads.compiled()
        if k is None:
            pytest.skip("the compiled checked reads are not built here, or this CPU lacks SSE4.2")

        def hung_sums(fd: int, ranges: list, *rest: Any) -> Any:  # type: ignore[type-arg]
            if sum(len(v) for _, v in ranges) == 64 * 64 * 4:
                time.sleep(1.0)
            return k.read_sums(fd, ranges, *rest)

        monkeypatch.setattr(checked_reads, "_LOADED", [types.SimpleNamespace(read_sums=hung_sums)])
    else:
        monkeypatch.setattr(checked_reads, "_LOADED", [None])
    real = local.read_vectored

    def hung(fd: int, offset: int, views: list) -> int:  # type: ignore[type-arg]
        if sum(len(v) for v in views) == 64 * 64 * 4:  # the data read, not the index's
            time.sleep(1.0)
        return real(fd, offset, views)

    monkeypatch.setattr(local, "read_vectored", hung)
    with pytest.raises(TransientStorageError, match="no answer within 0.2 s"):
        bytecp.load(str(tmp_path / "ck"), {"x": torch.zeros(64, 64).t()},  # (not contiguous: a staged read)
                    storage_options={"request_timeout": 0.2}, verify=False, io_threads=1)
    fresh = [torch.zeros(64 * 64 * 4, dtype=torch.uint8) for _ in range(50)]
    time.sleep(1.5)  # the hung read ends meanwhile
    assert not any(bool(b.any()) for b in fresh)


def _model(seed: int, n: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.ModuleList(torch.nn.Linear(4, 3) for _ in range(n))
    params = list(model.parameters())
    third = len(params) // 3
    opt = torch.optim.AdamW([{"params": params[:third], "lr": 1e-3},
                             {"params": params[third:2 * third], "lr": 2e-3, "weight_decay": 0.0},
                             {"params": params[2 * third:], "lr": 3e-3}])
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, generator=g)
    loss = sum((layer(x) ** 2).sum() for layer in model)
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_a_meta_target_is_left_as_it_is(tmp_path: Path) -> None:
    """A target on the meta device has no memory to read into (its address is
    0): it is filled through a staged copy, which a meta tensor takes as a no-op."""
    bytecp.save(str(tmp_path / "ck"), {"x": torch.ones(3, 4)})
    target = {"x": torch.empty(3, 4, device="meta")}
    bytecp.load(str(tmp_path / "ck"), target, strict=False)
    assert target["x"].is_meta


@pytest.mark.parametrize("fresh_optimizer", [False, True], ids=["into-live-state", "into-a-fresh-optimizer"])
def test_many_small_tensors_load_bitwise(tmp_path: Path, fresh_optimizer: bool) -> None:
    model, opt = _model(0, 600)  # 1,200 parameters, 3,600 Adam state entries, three groups
    for s in range(2):
        _step(model, opt, s)
    bytecp.save(str(tmp_path / "ck"), {"model": model, "optim": opt})
    want_model = {k: v.clone() for k, v in model.state_dict().items()}
    want_opt = copy.deepcopy(opt.state_dict())

    other, other_opt = _model(1, 600)
    if not fresh_optimizer:
        _step(other, other_opt, 7)  # state exists: filled in place
    bytecp.load(str(tmp_path / "ck"), {"model": other, "optim": other_opt})
    for k, v in other.state_dict().items():
        assert torch.equal(v, want_model[k]), k
    got = other_opt.state_dict()
    assert [{k: v for k, v in g.items()} for g in got["param_groups"]] == want_opt["param_groups"]
    assert got["state"].keys() == want_opt["state"].keys()
    for i, st in want_opt["state"].items():
        for k, v in st.items():
            assert torch.equal(got["state"][i][k], v), (i, k)
    # training goes on from the loaded state exactly as from the saved one
    _step(model, opt, 9)
    _step(other, other_opt, 9)
    for (k, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), k


def test_an_optimizer_pre_hook_that_changes_the_ids_is_honoured(tmp_path: Path) -> None:
    """A load-state-dict pre-hook may rewrite the groups' ids (here: a copy
    that drops the last id of group 0, then puts it back by append); torch
    then asks ``in`` of the changed list, answered by a scan."""
    model, opt = _model(0, 30)
    _step(model, opt, 0)
    bytecp.save(str(tmp_path / "ck"), {"model": model, "optim": opt})
    other, other_opt = _model(1, 30)
    seen: list[bool] = []

    def hook(optimizer: torch.optim.Optimizer, sd: dict) -> None:
        ids = sd["param_groups"][0]["params"]
        last = ids.pop()
        seen.append(last in ids)
        ids.append(last)
        seen.append(last in ids)

    other_opt.register_load_state_dict_pre_hook(hook)
    bytecp.load(str(tmp_path / "ck"), {"model": other, "optim": other_opt})
    assert seen == [False, True]
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            assert torch.equal(other_opt.state_dict()["state"][i][k], v), (i, k)


def test_the_load_pauses_the_collector_and_turns_it_back_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No cyclic collection runs inside a load's phases (their objects would
    start collections of the whole heap); the collector is on again after
    it, whether the load succeeded or failed, and off if it was off before."""
    import gc

    from bytecp.loading.pipeline import LoadPipeline

    model, opt = _model(0, 20)
    bytecp.save(str(tmp_path / "ck"), {"model": model, "optim": opt})
    seen: list[bool] = []
    for phase in ("read_metadata", "match", "read", "apply"):
        real = getattr(LoadPipeline, phase)
        monkeypatch.setattr(LoadPipeline, phase,
                            lambda self, real=real: (seen.append(gc.isenabled()), real(self))[1])
    bytecp.load(str(tmp_path / "ck"), {"model": model, "optim": opt})
    assert seen == [False] * 4 and gc.isenabled()
    seen.clear()
    with pytest.raises(bytecp.StateMismatchError):
        bytecp.load(str(tmp_path / "ck"), {"model": torch.nn.Linear(2, 2)})
    assert seen and not any(seen) and gc.isenabled()
    gc.disable()
    try:
        bytecp.load(str(tmp_path / "ck"), {"model": model, "optim": opt})
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_blocking_save_pauses_the_collector_and_turns_it_back_on(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``bytecp.save`` runs with the collector paused, as a load does (a
    20,120-tensor save: 1.4 s with collections, 0.9 s without)."""
    import gc

    from bytecp.saving import schedule

    model, opt = _model(0, 20)
    seen: list[bool] = []
    real = schedule.save_now
    monkeypatch.setattr(schedule, "save_now", lambda p: (seen.append(gc.isenabled()), real(p))[1])
    bytecp.save(str(tmp_path / "ck"), {"model": model, "optim": opt})
    assert seen == [False] and gc.isenabled()
    with pytest.raises(bytecp.CheckpointExistsError):
        bytecp.save(str(tmp_path / "ck"), {"model": model, "optim": opt})
    assert gc.isenabled()


def test_iter_weights_reads_with_the_collector_paused_and_never_holds_it_across_a_yield(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``iter_weights`` opens, chooses and reads its groups with the collector
    paused (20,000 tensors: 0.7 s -> 0.41 s), and gives the caller's loop the
    collector as it was at every tensor it yields."""
    import gc

    from bytecp.interop import export

    model, opt = _model(0, 40)
    bytecp.save(str(tmp_path / "ck"), {"model": model, "optim": opt})
    seen: list[bool] = []
    real = export.execute_reads
    monkeypatch.setattr(export, "execute_reads", lambda *a, **k: (seen.append(gc.isenabled()), real(*a, **k))[1])
    got = {}
    for name, t in bytecp.iter_weights(str(tmp_path / "ck"), prefix="model."):
        assert gc.isenabled()
        got[name] = t
    assert seen and not any(seen) and gc.isenabled()
    assert got.keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        assert torch.equal(got[k], v), k


def test_batches_are_prepared_on_the_callers_thread_a_bounded_number_ahead_and_stop_after_a_failure() -> None:
    """``reader._pipelined``: every batch's Python on the calling thread, at most
    ``ahead`` batches prepared and not yet read, no batch handed out after one
    failed, and that failure raised (the earlier batches' bytes all counted)."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from bytecp.loading import reader

    class Run:
        def __init__(self, bad: int | None = None) -> None:
            self.bad = bad
            self.prepared: list[int] = []
            self.threads: set[int] = set()
            self.open = self.most = 0
            self.lock = threading.Lock()

        def prepare(self, batch: list[int]) -> list[int]:
            self.threads.add(threading.get_ident())
            self.prepared.append(batch[0])
            with self.lock:
                self.open += 1
                self.most = max(self.most, self.open)
            return batch

        def finish(self, batch: list[int]) -> int:
            time.sleep(0.005)
            with self.lock:
                self.open -= 1
            if batch[0] == self.bad:
                raise CorruptCheckpointError(f"batch {self.bad} is damaged")
            return 10

    ok = Run()
    with ThreadPoolExecutor(3) as ex:
        assert reader._pipelined(ok, [[i] for i in range(30)], ex, 3) == 300  # type: ignore[arg-type]
    assert ok.prepared == list(range(30)) and ok.threads == {threading.get_ident()} and ok.most <= 3
    bad = Run(bad=5)
    with ThreadPoolExecutor(3) as ex, pytest.raises(CorruptCheckpointError, match="batch 5 is damaged"):
        reader._pipelined(bad, [[i] for i in range(40)], ex, 3)  # type: ignore[arg-type]
    assert bad.most <= 3 and len(bad.prepared) <= 5 + 3 + 1


def test_targets_with_a_conjugate_or_negative_bit_get_their_values_not_the_raw_bytes(tmp_path: Path) -> None:
    """A lazy conjugate (complex) or negative view holds its values negated in
    memory: it is read staged and its values set through it, never read into
    directly (the loader's per-request check skips ``is_conj`` for real dtypes only)."""
    z = torch.randn(6, dtype=torch.complex64)
    x = torch.randn(5)
    bytecp.save(str(tmp_path / "ck"), {"z": z, "x": x})
    zt = torch.zeros(6, dtype=torch.complex64).conj()
    xt = torch._neg_view(torch.zeros(5))
    assert zt.is_conj() and xt.is_neg()
    bytecp.load(str(tmp_path / "ck"), {"z": zt, "x": xt})
    assert torch.equal(zt.resolve_conj(), z) and torch.equal(xt.resolve_neg(), x)
