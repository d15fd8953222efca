"""The CUDA paths, each by design (``pytest -m gpu``; skipped without a GPU):
staging memory pinned once per process and reused; memory-tier arenas
registered so a ``keeper://`` save copies at pinned speed; device-to-host
copies ordered after the caller's stream by an event (never a device-wide
synchronize), also from the lazy save's background thread; the lazy
optimizer hook has the training stream wait for the copies' event;
bytecp's background collectives never use the job's NCCL group; loads read
into pinned slabs and copy to the device asynchronously, bitwise.
"""

from __future__ import annotations

import datetime
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import bytecp
from bytecp import device_memory
from bytecp.loading import reader
from bytecp.saving import handles
from bytecp.saving.staging import POOL

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the CUDA paths need a GPU"),
]


#: the real one: the tests' own checks may synchronize (``no_device_sync`` patches bytecp's view of it)
_synchronize = torch.cuda.synchronize


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8),
                                                                      b.view(-1).view(torch.uint8))


def model_and_opt(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512)).cuda()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    train_step(m, opt)
    return m, opt


def train_step(m: nn.Module, opt: torch.optim.Optimizer) -> None:
    m(torch.randn(64, 512, device="cuda")).square().mean().backward()
    opt.step()
    opt.zero_grad()


def host_copy(m: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    _synchronize()
    return {"model": {k: v.detach().cpu().clone() for k, v in m.state_dict().items()},
            "optim": {i: {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in st.items()}
                      for i, st in opt.state_dict()["state"].items()}}


def assert_checkpoint_is(url: str, want: dict[str, Any]) -> None:
    m, opt = model_and_opt(seed=99)
    bytecp.load(url, {"model": m, "optim": opt})
    _synchronize()
    for k, v in want["model"].items():
        assert same(m.state_dict()[k], v), k
    got = opt.state_dict()["state"]
    for i, st in want["optim"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                assert same(got[i][k], v), (i, k)


@pytest.fixture
def no_device_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device-wide (or whole-stream) synchronize by bytecp fails the test."""

    def refuse(*_: Any, **__: Any) -> None:
        raise AssertionError("bytecp synchronized a device or a stream")

    monkeypatch.setattr(torch.cuda, "synchronize", refuse)
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", refuse)


def test_staging_memory_is_pinned_once_and_reused(tmp_path: Path) -> None:
    m, opt = model_and_opt()
    bytecp.async_save(str(tmp_path / "c0"), {"model": m, "optim": opt}).wait(60)
    arena, allocations = POOL._arena, POOL.allocations
    assert arena is not None and arena.is_pinned() and device_memory.is_registered(arena.data_ptr())
    host_allocs = torch.cuda.host_memory_stats().get("num_host_alloc") if hasattr(
        torch.cuda, "host_memory_stats") else None
    for i in range(1, 4):
        train_step(m, opt)
        want = host_copy(m, opt)
        bytecp.async_save(str(tmp_path / f"c{i}"), {"model": m, "optim": opt}).wait(60)
        assert_checkpoint_is(str(tmp_path / f"c{i}"), want)
    assert POOL._arena is arena and POOL.allocations == allocations  # reused, not allocated again
    if host_allocs is not None:  # no cudaHostAlloc by the saves
        assert torch.cuda.host_memory_stats().get("num_host_alloc") == host_allocs


@pytest.mark.parametrize("lazy", [False, True])
def test_copies_wait_for_the_callers_stream_by_event(tmp_path: Path, lazy: bool, no_device_sync: None) -> None:
    """The caller's work queued on its own stream before the save is in the
    checkpoint (the lazy copy runs on another thread, whose current stream
    is not the caller's), and nothing synchronizes the device."""
    w = torch.zeros(4 << 20, device="cuda")  # 16 MiB
    training = torch.cuda.Stream()
    training.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(training):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the value is written
        w.fill_(7.0)
        h = bytecp.async_save(str(tmp_path / "ck"), {"w": w}, lazy=lazy)
    h.wait(60)
    got = bytecp.load_state_dict(str(tmp_path / "ck"))["w"]
    assert torch.equal(got, torch.full_like(got, 7.0))


def test_the_lazy_hook_has_the_training_stream_wait_for_the_copy(tmp_path: Path, no_device_sync: None) -> None:
    """A lazy save's optimizer step runs after the copy on the GPU: the
    checkpoint holds the values of the call, the model the stepped ones."""
    m, opt = model_and_opt()
    for _ in range(2):
        want = host_copy(m, opt)
        h = bytecp.async_save(str(tmp_path / f"ck{uuid.uuid4().hex[:6]}"), {"model": m, "optim": opt}, lazy=True)
        url = h.url
        m(torch.randn(64, 512, device="cuda")).square().mean().backward()
        opt.step()  # the pre-step hook: the stream waits for the copy's event
        opt.zero_grad()
        h.wait(60)
        assert_checkpoint_is(url, want)
        assert not all(same(m.state_dict()[k], v) for k, v in want["model"].items())  # it did step


def test_a_memory_tier_arena_is_registered_for_device_copies(tmp_path: Path) -> None:
    from bytecp.storage.keeper_server import Keeper

    token = "t-" + uuid.uuid4().hex
    keeper = Keeper("g0", 0, token, {}, replicas=1)
    threading.Thread(target=keeper.serve_forever, daemon=True).start()
    try:
        opts = {"keepers": f"g0=127.0.0.1:{keeper.port}", "host": "g0", "token": token}
        m, opt = model_and_opt()
        run = f"keeper://job/{uuid.uuid4().hex}"
        bytecp.prewarm({"model": m, "optim": opt}, url=run, storage_options=opts)
        before = device_memory.STATS.registered
        for step in range(2):
            want = host_copy(m, opt)
            bytecp.async_save(f"{run}/step-{step}", {"model": m, "optim": opt}, storage_options=opts).wait(60)
            m2, opt2 = model_and_opt(seed=5)
            bytecp.load(f"{run}/step-{step}", {"model": m2, "optim": opt2}, storage_options=opts)
            for k, v in want["model"].items():
                assert same(m2.state_dict()[k], v), k
            train_step(m, opt)
        from bytecp.storage._keeper_maps import MAPPINGS, address_of

        mapped = [buf for buf, _ in MAPPINGS._maps.values()]
        assert mapped and all(device_memory.is_registered(address_of(b)) for b in mapped if len(b))
        assert device_memory.STATS.register_failures == 0
        assert device_memory.STATS.registered >= before
    finally:
        keeper.close()


@pytest.fixture
def nccl_world() -> Iterator[None]:
    """This process as a world of 1 on NCCL (the training job's default group)."""
    init = f"file:///tmp/bytecp-nccl-{uuid.uuid4().hex}"
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=init, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60),
                            device_id=torch.device("cuda", 0))
    try:
        yield
    finally:
        handles._groups.clear()
        dist.destroy_process_group()


def test_background_collectives_never_use_the_jobs_nccl_group(tmp_path: Path, nccl_world: None,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str]] = []
    main = threading.main_thread()
    for name in ("all_gather", "broadcast", "gather", "scatter", "batch_isend_irecv", "all_reduce", "barrier"):
        real = getattr(dist, name)

        def spy(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            if threading.current_thread() is not main:
                group = kwargs.get("group")
                if _name == "batch_isend_irecv" and args and args[0]:
                    group = args[0][0].group
                calls.append((_name, str(dist.get_backend(group))))
            return _real(*args, **kwargs)

        monkeypatch.setattr(dist, name, spy)
    m, opt = model_and_opt()
    for lazy in (False, True):
        want = host_copy(m, opt)
        h = bytecp.async_save(str(tmp_path / f"ck{int(lazy)}"), {"model": m, "optim": opt}, lazy=lazy)
        train_step(m, opt)
        h.wait(60)
        assert_checkpoint_is(str(tmp_path / f"ck{int(lazy)}"), want)
    assert calls, "the background save ran no collective"
    assert {b for _, b in calls} == {"gloo"}, calls


def test_loads_copy_through_pinned_slabs_to_the_device(tmp_path: Path, no_device_sync: None) -> None:
    """Large tensors (over a slab), many small ones, a non-contiguous target
    and a checksum check on the way, bitwise on the device."""
    torch.manual_seed(3)
    src = {
        "big": torch.randn(reader.SLAB_BYTES // 4 * 2 + 777),  # three slab pieces
        "small": [torch.randn(31, 17) for _ in range(50)],
        "bf16": torch.randn(300, 500).to(torch.bfloat16),
        "cols": torch.randn(64, 96),
    }
    bytecp.save(str(tmp_path / "ck"), src)
    holder = torch.zeros(96, 64, device="cuda")
    dst = {
        "big": torch.zeros_like(src["big"], device="cuda"),
        "small": [torch.zeros(31, 17, device="cuda") for _ in range(50)],
        "bf16": torch.zeros(300, 500, dtype=torch.bfloat16, device="cuda"),
        "cols": holder.t(),  # a non-contiguous view
    }
    copies = device_memory.STATS.host_to_device
    bytecp.load(str(tmp_path / "ck"), dst)
    assert device_memory.STATS.host_to_device > copies
    assert same(dst["big"], src["big"]) and same(dst["bf16"], src["bf16"]) and same(dst["cols"], src["cols"])
    assert all(same(a, b) for a, b in zip(dst["small"], src["small"], strict=True))
    assert all(s.buf.pinned for s in reader.SLABS._free)
