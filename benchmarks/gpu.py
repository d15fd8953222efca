"""bytecp beside DCP on a GPU-resident model, in one process (the GPU check's figures).

    python -m benchmarks.gpu [--gb 4.2] [--dir DIR] [--json out.json]

One GPU, one process: the training job's default group is NCCL (world 1),
as on a GPU cluster. The model is a GPT (benchmarks/model.py) in bf16 on
the GPU, trained with fp32 master weights and fp32 Adam moments (the
mixed-precision layout of Megatron-style jobs: 2 + 12 bytes a parameter);
``--gb`` sets the state's size. Every step is a real forward, backward and
Adam step on the GPU. Figures (seconds; each the median of ``--repeat``):

- ``d2h_floor_s``: the same bytes copied into pinned host memory (one
  registered buffer, non-blocking copies on a side stream, all queued then
  waited for): what any staging copy costs at least;
- ``bytecp_eager_block_s``: what ``bytecp.async_save`` blocks for (the copy);
- ``bytecp_lazy_call_s`` / ``bytecp_lazy_hook_s``: what ``lazy=True`` blocks
  for at the call, and in the next ``optimizer.step()``'s hook;
- ``dcp_async_block_s``: ``torch.distributed.checkpoint.async_save`` with its
  pinned-memory stager and process executor (torchtitan's
  ``async_with_pinned_mem``): the call plus the wait for its staging;
- ``*_commit_s``: from the call until the checkpoint is durable (bytecp's
  ``handle.wait()``, DCP's upload future), and ``bytecp.save``/``dcp.save``;
- ``added_*_s``: the training time a checkpoint adds, from ``--steps``
  training steps with a checkpoint every ``--every`` steps against the same
  steps without one (each mode runs its saves to durable before the next);
- ``bytecp_load_s`` / ``dcp_load_s``: loading the checkpoint back into the
  GPU model (page cache warm), against ``read_floor_s``: reading the same
  data files into pinned memory with as many threads.

The checkpoints are written under ``--dir`` (local disk) and deleted when
measured. Without CUDA it says so and writes ``{"skipped": reason}``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import cProfile
import datetime
import io
import itertools
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.netport import free_port as _free_port

__all__ = ["main", "run", "Job"]

BATCH, SEQ = 8, 1024


class Job:
    """The training job: a bf16 GPT on the GPU, fp32 master weights, fp32 Adam."""

    def __init__(self, gb: float, seed: int = 0) -> None:
        from benchmarks.model import GPT, GPTConfig, config_for_gb

        base = config_for_gb(gb * 12 / 14)  # 14 bytes a parameter here, 12 there
        self.cfg = GPTConfig(layers=base.layers, hidden=base.hidden, vocab=base.vocab, seq=SEQ)
        torch.manual_seed(seed)
        with torch.device("cuda"):  # initialized on the GPU
            self.model = GPT(self.cfg).to(torch.bfloat16)
            self.master = GPT(self.cfg)
        self.master.load_state_dict({k: v.float() for k, v in self.model.state_dict().items()})
        self.optimizer = torch.optim.Adam(self.master.parameters(), lr=1e-5, fused=True)
        self._params = list(self.model.parameters())
        self._masters = list(self.master.parameters())
        for q in self._masters:
            q.grad = torch.zeros_like(q)
        g = torch.Generator(device="cuda").manual_seed(seed + 1)
        self.tokens = torch.randint(self.cfg.vocab, (BATCH, SEQ + 1), device="cuda", generator=g)
        self.step()  # Adam state exists from here on

    def state(self) -> dict[str, Any]:
        """What bytecp saves: the modules and the optimizer (its hook guards lazy saves)."""
        return {"model": self.model, "master": self.master, "optimizer": self.optimizer}

    def state_dict(self) -> dict[str, Any]:
        """The same tensors as a DCP state dict."""
        optim = {f"{name}.{k}": v for (name, _), st in zip(self.master.named_parameters(),
                                                            (self.optimizer.state[q] for q in self._masters),
                                                            strict=True) for k, v in st.items()}
        # plain dicts, as torchtitan's get_model_state_dict gives (DCP's pinned stager cannot copy an OrderedDict)
        return {"model": dict(self.model.state_dict()), "master": dict(self.master.state_dict()), "optim": optim}

    def nbytes(self) -> int:
        total = 0
        for v in _tensors(self.state_dict()):
            total += v.numel() * v.element_size()
        return total

    def step(self) -> None:
        """Forward, backward (bf16), Adam on the fp32 masters, masters back into the bf16 weights."""
        logits = self.model(self.tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, self.cfg.vocab).float(), self.tokens[:, 1:].reshape(-1)).backward()
        torch._foreach_copy_([q.grad for q in self._masters], [p.grad for p in self._params])
        self.optimizer.step()
        with torch.no_grad():
            torch._foreach_copy_(self._params, self._masters)
        for p in self._params:
            p.grad = None


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    return []


def _sync() -> None:
    torch.cuda.synchronize()


def _median(fn: Callable[[], float], repeat: int) -> float:
    return statistics.median(fn() for _ in range(repeat))


def d2h_floor(job: Job) -> float:
    """Every state tensor copied into one pinned buffer on a side stream, queued then waited for."""
    from bytecp.device_memory import PinnedBuffer

    tensors = _tensors(job.state_dict())
    sizes = [t.numel() * t.element_size() for t in tensors]
    buf = PinnedBuffer(sum(-(-n // 4096) * 4096 for n in sizes))
    views, pos = [], 0
    for t, n in zip(tensors, sizes, strict=True):
        views.append(buf.tensor[pos : pos + n].view(t.dtype).view(t.shape))
        pos += -(-n // 4096) * 4096
    stream = torch.cuda.Stream()

    def once() -> float:
        _sync()
        t0 = time.perf_counter()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for v, t in zip(views, tensors, strict=True):
                v.copy_(t, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(stream)
        ev.synchronize()
        return time.perf_counter() - t0

    once()
    out = _median(once, 5)
    buf.close()
    return out


class Dirs:
    """Fresh checkpoint folders under one root, removed once measured."""

    def __init__(self, root: str) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.n = 0

    def new(self, name: str) -> str:
        self.n += 1
        return str(self.root / f"{name}-{self.n}")

    @staticmethod
    def drop(path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)


def bytecp_saves(job: Job, dirs: Dirs, repeat: int) -> dict[str, Any]:
    """Eager and lazy async saves (blocking, hook wait, to commit) and a sync save."""
    import bytecp

    out: dict[str, list[float]] = {k: [] for k in ("eager_block", "eager_commit", "lazy_call", "lazy_hook",
                                                   "lazy_commit", "save")}
    bytecp.prewarm(job.state())
    step_host = _median(lambda: _timed(job.step), 3)  # the host's time in a step without a save in flight
    for i in range(repeat + 1):  # the first of each is a warm-up
        _sync()
        url = dirs.new("bytecp-eager")
        t0 = time.perf_counter()
        h = bytecp.async_save(url, job.state())
        t1 = time.perf_counter()
        h.wait()
        t2 = time.perf_counter()
        dirs.drop(url)
        job.step()
        _sync()
        url = dirs.new("bytecp-lazy")
        t3 = time.perf_counter()
        h = bytecp.async_save(url, job.state(), lazy=True)
        t4 = time.perf_counter()
        job.step()  # the optimizer's pre-step hook waits for the copies to be queued
        t5 = time.perf_counter()
        h.wait()
        t6 = time.perf_counter()
        dirs.drop(url)
        sync_save = _save_seconds(dirs, "bytecp-sync", lambda path: bytecp.save(path, job.state()))
        if i:
            out["eager_block"].append(t1 - t0)
            out["eager_commit"].append(t2 - t0)
            out["lazy_call"].append(t4 - t3)
            out["lazy_hook"].append(max(0.0, (t5 - t4) - step_host))  # the step's host time beyond a plain one
            out["lazy_commit"].append(t6 - t3)
            out["save"].append(sync_save)
    results: dict[str, Any] = {f"bytecp_{k}_s": statistics.median(v) for k, v in out.items()}
    # where a call's time goes (the caller's thread), for the next engineer
    _sync()
    url = dirs.new("bytecp-profile")
    h, results["profile_lazy_call"] = _profiled(lambda: bytecp.async_save(url, job.state(), lazy=True))
    job.step()
    h.wait()
    dirs.drop(url)
    _sync()
    h, results["profile_eager_call"] = _profiled(lambda: bytecp.async_save(url, job.state()))
    h.wait()
    dirs.drop(url)
    return results


def _profiled(fn: Callable[[], Any]) -> tuple[Any, str]:
    """``fn()`` under cProfile: its result and the 30 costliest functions (cumulative)."""
    prof = cProfile.Profile()
    prof.enable()
    try:
        out = fn()
    finally:
        prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(30)
    return out, text.getvalue()[-6000:]


def _save_seconds(dirs: Dirs, name: str, save: Callable[[str], Any]) -> float:
    """A synchronous save into a fresh folder, timed to its return (durable), the folder then removed."""
    _sync()
    path = dirs.new(name)
    t0 = time.perf_counter()
    save(path)
    seconds = time.perf_counter() - t0
    dirs.drop(path)
    return seconds


def _timed(fn: Callable[[], None]) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def dcp_saves(job: Job, dirs: Dirs, repeat: int, group: Any) -> dict[str, float]:
    """DCP's async save as torchtitan's ``async_with_pinned_mem`` runs it, and ``dcp.save``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    out: dict[str, list[float]] = {k: [] for k in ("async_call", "async_staging", "async_block", "async_commit",
                                                   "save")}
    for i in range(repeat + 1):
        _sync()
        path = dirs.new("dcp-async")
        stager = _dcp_stager()
        try:
            t0 = time.perf_counter()
            res = dcp.async_save(job.state_dict(), checkpoint_id=path, process_group=group,
                                 async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=stager)
            t1 = time.perf_counter()
            res.staging_completion.result()  # torchtitan waits for it before the next step
            t2 = time.perf_counter()
            res.upload_completion.result()
            t3 = time.perf_counter()
        finally:
            stager.close()
        dirs.drop(path)
        sync_save = _save_seconds(dirs, "dcp-sync", lambda path: dcp.save(job.state_dict(), checkpoint_id=path))
        if i:
            out["async_call"].append(t1 - t0)
            out["async_staging"].append(t2 - t1)
            out["async_block"].append(t2 - t0)
            out["async_commit"].append(t3 - t0)
            out["save"].append(sync_save)
    return {f"dcp_{k}_s": statistics.median(v) for k, v in out.items()}


def _dcp_stager() -> Any:
    """DCP's pinned-memory stager, as torchtitan's ``async_with_pinned_mem`` makes it: a new one
    per save, since torch 2.11's cannot stage twice (its ``close()`` after every stage empties its
    copy dispatch table: the next stage fails with ``KeyError: <class 'type'>``); its pinned
    memory comes from torch's pinned-memory cache after the first save."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(True, True, True, True))


def added_per_checkpoint(job: Job, dirs: Dirs, steps: int, every: int, group: Any) -> dict[str, float]:
    """Training time a checkpoint adds: ``steps`` steps with a save every ``every`` against none."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    import bytecp

    def loop(save: Callable[[int], Callable[[], None] | None]) -> float:
        """The training time of ``steps`` steps: the waits for a previous
        checkpoint to be durable (before the next) are not counted, so a slow
        disk does not count as the saves' stall; every run is cut at the same
        steps, with or without saves."""
        pending: list[Callable[[], None]] = []
        total = 0.0
        _sync()
        t0 = time.perf_counter()
        for s in range(steps):
            if s % every == every - 1:
                _sync()
                total += time.perf_counter() - t0
                for w in pending:  # the previous checkpoint is durable first
                    w()
                pending.clear()
                t0 = time.perf_counter()
                done = save(s)
                if done is not None:
                    pending.append(done)
            job.step()
        _sync()
        total += time.perf_counter() - t0
        for w in pending:
            w()
        return total

    paths: list[str] = []

    def bytecp_save(lazy: bool) -> Callable[[int], Callable[[], None]]:
        def save(s: int) -> Callable[[], None]:
            paths.append(dirs.new("added-bytecp"))
            h = bytecp.async_save(paths[-1], job.state(), lazy=lazy)
            return lambda: (h.wait(), None)[1]
        return save

    staging: list[Any] = []

    def dcp_save(s: int) -> Callable[[], None]:
        paths.append(dirs.new("added-dcp"))
        stager = _dcp_stager()
        res = dcp.async_save(job.state_dict(), checkpoint_id=paths[-1], process_group=group,
                             async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=stager)
        staging.append(res.staging_completion)

        def durable() -> None:
            res.upload_completion.result()
            stager.close()

        return durable

    def wait_for_staging(*_: Any) -> None:
        """torchtitan's ``maybe_wait_for_staging``, right before the optimizer step."""
        for f in staging:
            f.result()
        staging.clear()

    n = len(range(every - 1, steps, every))
    loop(lambda s: None)  # warm-up
    base = statistics.median(loop(lambda s: None) for _ in range(2))
    results = {"train_step_s": base / steps}
    for name, fn in (("bytecp_lazy", bytecp_save(True)), ("bytecp_eager", bytecp_save(False)),
                     ("dcp_async", dcp_save)):
        hook = job.optimizer.register_step_pre_hook(wait_for_staging) if name == "dcp_async" else None
        try:
            t = loop(fn)
        finally:
            if hook is not None:
                hook.remove()
        results[f"added_{name}_s"] = max(0.0, (t - base) / n)
        for p in paths:
            dirs.drop(p)
        paths.clear()
    return results


def loads(job: Job, dirs: Dirs, repeat: int, threads: int = 8) -> dict[str, Any]:
    """bytecp and DCP loads into the GPU model, page cache warm, against the read floor."""
    import torch.distributed.checkpoint as dcp

    import bytecp
    from bytecp.device_memory import PinnedBuffer

    url = dirs.new("load-bytecp")
    bytecp.save(url, job.state())
    files = [p for p in Path(url).rglob("*.bin") if p.is_file()]  # the data files (FORMAT.md)
    sizes = [p.stat().st_size for p in files]
    piece = 32 << 20
    pieces = [(f, off, min(piece, n - off)) for f, n in zip(files, sizes, strict=True) for off in range(0, n, piece)]
    buf = PinnedBuffer(piece * threads)

    def read_floor() -> float:
        """Every data file's bytes read into pinned memory, ``threads`` threads, a reused piece each."""
        local = threading.local()
        slots = itertools.count()
        t0 = time.perf_counter()

        def read(p: tuple[Path, int, int]) -> None:
            if not hasattr(local, "view"):
                k = next(slots)
                local.view = memoryview(buf.tensor.numpy())[k * piece : (k + 1) * piece]
            path, off, n = p
            fd = os.open(path, os.O_RDONLY)
            try:
                got = 0
                while got < n:
                    m = os.preadv(fd, [local.view[got:n]], off + got)
                    if not m:
                        break
                    got += m
            finally:
                os.close(fd)

        with concurrent.futures.ThreadPoolExecutor(threads) as ex:
            list(ex.map(read, pieces))
        return time.perf_counter() - t0

    def bytecp_load() -> float:
        _sync()
        t0 = time.perf_counter()
        bytecp.load(url, job.state())
        _sync()
        return time.perf_counter() - t0

    path = dirs.new("load-dcp")
    dcp.save(job.state_dict(), checkpoint_id=path)

    def dcp_load() -> float:
        sd = job.state_dict()
        _sync()
        t0 = time.perf_counter()
        dcp.load(sd, checkpoint_id=path)
        _sync()
        return time.perf_counter() - t0

    def bytecp_load_unverified() -> float:
        _sync()
        t0 = time.perf_counter()
        bytecp.load(url, job.state(), verify=False)
        _sync()
        return time.perf_counter() - t0

    read_floor()  # page cache warm
    out: dict[str, Any] = {"read_bytes": float(sum(sizes)), "read_floor_s": _median(read_floor, repeat)}
    bytecp_load()
    out["bytecp_load_s"] = _median(bytecp_load, repeat)
    out["bytecp_load_unverified_s"] = _median(bytecp_load_unverified, repeat)
    _, out["profile_load"] = _profiled(lambda: bytecp.load(url, job.state()))
    dcp_load()
    out["dcp_load_s"] = _median(dcp_load, repeat)
    buf.close()
    dirs.drop(url)
    dirs.drop(path)
    return out


def run(gb: float, root: str, repeat: int, steps: int, every: int) -> dict[str, Any]:
    """Every figure, in one process (the default group initialized here)."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    torch.cuda.set_device(0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=300),
                            device_id=torch.device("cuda", 0))
    gloo = dist.new_group(backend="gloo")  # DCP's async saves (torchtitan makes one too)
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                               "date": datetime.date.today().isoformat()}
    job = Job(gb)
    results["state_bytes"] = job.nbytes()
    results["params"] = sum(p.numel() for p in job.model.parameters())
    dirs = Dirs(root)
    errors: dict[str, str] = {}
    for name, fn in (("d2h", lambda: {"d2h_floor_s": d2h_floor(job)}),
                     ("bytecp", lambda: bytecp_saves(job, dirs, repeat)),
                     ("dcp", lambda: dcp_saves(job, dirs, repeat, gloo)),
                     ("added", lambda: added_per_checkpoint(job, dirs, steps, every, gloo)),
                     ("load", lambda: loads(job, dirs, repeat))):
        t0 = time.perf_counter()
        try:
            results.update(fn())
        except Exception as e:  # one section failing leaves the others' figures
            errors[name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        results[f"section_{name}_s"] = round(time.perf_counter() - t0, 1)
        print(f"gpu bench: {name} done in {results[f'section_{name}_s']} s", file=sys.stderr, flush=True)
    results["errors"] = errors
    results["ratios"] = ratios(results)
    dist.destroy_process_group()
    return results


def ratios(r: dict[str, Any]) -> dict[str, float]:
    """The issue's targets as ratios (None where a figure is missing)."""
    def div(a: str, b: str) -> float | None:
        return r[a] / r[b] if r.get(a) is not None and r.get(b) else None

    out = {
        "eager_block_vs_d2h_floor": div("bytecp_eager_block_s", "d2h_floor_s"),
        "added_lazy_vs_dcp_async": div("added_bytecp_lazy_s", "added_dcp_async_s"),
        "added_eager_vs_dcp_async": div("added_bytecp_eager_s", "added_dcp_async_s"),
        "eager_block_vs_dcp_async_block": div("bytecp_eager_block_s", "dcp_async_block_s"),
        "lazy_call_vs_dcp_async_block": div("bytecp_lazy_call_s", "dcp_async_block_s"),
        "load_speed_vs_read_floor": div("read_floor_s", "bytecp_load_s"),
        "unverified_load_speed_vs_read_floor": div("read_floor_s", "bytecp_load_unverified_s"),
        "load_vs_dcp_load": div("bytecp_load_s", "dcp_load_s"),
        "save_vs_dcp_save": div("bytecp_save_s", "dcp_save_s"),
    }
    return {k: round(v, 3) for k, v in out.items() if v is not None}




def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=4.2, help="state size in GB (bf16 weights + fp32 master and Adam)")
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary folder)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    root = args.dir or tempfile.mkdtemp(prefix="bytecp-gpu-bench-")
    try:
        results = run(args.gb, root, args.repeat, args.steps, args.every)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    text = json.dumps(results, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

