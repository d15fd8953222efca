"""A load from a warm page cache against the read floor, and DCP's, in one run.

    python -m benchmarks.load_floor [--gb 1.07 | --moe N] [--threads 4] [--repeats 7] [--json out.json]

One process, local disk, the GPT of benchmarks/model.py (plain, Adam state
trained one step) of about ``--gb`` GB of tensors (or, with ``--moe N``, the
MoE-like GPT of benchmarks/moe_model.py of about N small tensors: a
mixture-of-experts rank's load, where what costs is per tensor), saved once by
``bytecp.save`` and once by ``torch.distributed.checkpoint.save``. Then,
page cache warm (every file read once first), rounds of four, taken in turn
so load on a shared machine hits them alike:

- **floor**: every bytecp data file read whole into buffers allocated
  (and touched) before the round, with ``--threads`` threads (``os.preadv``
  of 32 MiB pieces): what moving those bytes from the page cache costs,
  with nothing checked and nothing placed;
- **floor, mapped** (where the compiled checked reads are): the same pieces
  copied out of a mapping of each file by ``bytecp.format._reads.read_sums``
  (streaming stores, nothing summed): the fastest way to move the bytes from
  the page cache this machine offers, which bytecp's local reads use;
- **bytecp**: ``bytecp.load(url, state, io_threads=--threads)`` into the
  live model and optimizer (``verify=True``, the default: every byte's
  checksum checked);
- **bytecp unverified**: the same with ``verify=False``;
- **DCP**: ``dcp.load`` of the model's and optimizer's state dicts
  (``get_state_dict``/``set_state_dict``, DCP's own way of loading both).

Figures: the median and minimum wall seconds of each over ``--repeats``
rounds (after one warm-up round), the median CPU seconds of the process
(every thread: steadier than the wall time on a shared machine), and the
speed of each against the floor's (floor seconds / its seconds, medians:
1.0 is the floor), wall and CPU, and against the mapped floor's.
``tensors`` and ``read_gb`` say what moved.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

import bytecp
from benchmarks import moe_model
from benchmarks.model import build, config_for_gb, state_bytes
from bytecp.format import checked_reads

__all__ = ["main", "run", "read_floor"]

_PIECE = 32 << 20


def _timed(files: list[Path], bufs: list[torch.Tensor], threads: int,
           read: Callable[[int, Path, memoryview, int], None]) -> float:
    """Seconds to fill each buffer of ``bufs`` from its file of ``files``, 32 MiB pieces
    spread over ``threads`` threads, each piece ``read(fd, path, buffer, offset)``."""
    pieces = [(f, memoryview(b.numpy()), off) for f, b in zip(files, bufs, strict=True)
              for off in range(0, b.numel(), _PIECE)]

    def one(p: tuple[Path, memoryview, int]) -> None:
        path, view, off = p
        fd = os.open(path, os.O_RDONLY)
        try:
            read(fd, path, view, off)
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, pieces))
    return time.perf_counter() - t0


def read_floor(files: list[Path], bufs: list[torch.Tensor], threads: int) -> float:
    """Seconds to read each of ``files`` whole into its buffer of ``bufs`` (allocated before),
    32 MiB pieces spread over ``threads`` threads."""
    def read(fd: int, path: Path, view: memoryview, off: int) -> None:
        got, end = off, min(off + _PIECE, len(view))
        while got < end:
            n = os.preadv(fd, [view[got:end]], got)
            if not n:
                raise OSError(f"{path}: short read at {got}")
            got += n

    return _timed(files, bufs, threads, read)


def read_floor_mapped(files: list[Path], bufs: list[torch.Tensor], threads: int) -> float:
    """:func:`read_floor`, each piece copied out of a mapping of its file (the compiled checked reads,
    nothing summed) instead of ``preadv``."""
    k = checked_reads.compiled()
    assert k is not None
    none, out = np.zeros(0, np.int64), np.zeros(0, np.uint32)

    def read(fd: int, path: Path, view: memoryview, off: int) -> None:
        if k.read_sums(fd, [(off, view[off:off + _PIECE])], none, out, checked_reads.PIECE_BYTES, True):
            raise OSError(f"{path}: short read at {off}")

    return _timed(files, bufs, threads, read)


def run(gb: float, root: str, threads: int, repeats: int, moe: int | None = None) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    cfg: Any
    if moe is not None:
        cfg = moe_model.config_for_tensors(moe)
        model, optim = moe_model.build(cfg)
        moe_model.forward_backward(model, cfg)
        optim.step()
        optim.zero_grad(set_to_none=True)
    else:
        cfg = config_for_gb(gb)
        model, optim = build(cfg, "plain")
    state = {"model": model, "optim": optim}
    url = f"{root}/bytecp"
    bytecp.save(url, state)
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/dcp")
    del msd, osd
    files = sorted(p for p in Path(url).rglob("*.bin") if p.is_file())
    bufs = [torch.empty(p.stat().st_size, dtype=torch.uint8).fill_(0) for p in files]

    def floor() -> float:
        return read_floor(files, bufs, threads)

    def load(verify: bool) -> Callable[[], float]:
        def go() -> float:
            t0 = time.perf_counter()
            bytecp.load(url, state, io_threads=threads, verify=verify)
            return time.perf_counter() - t0
        return go

    def dcp_load() -> float:
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, optim)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=f"{root}/dcp")
        set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        return time.perf_counter() - t0

    cases: dict[str, Callable[[], float]] = {
        "floor": floor, "bytecp": load(True), "bytecp_unverified": load(False), "dcp": dcp_load,
    }
    if checked_reads.compiled() is not None:
        cases["floor_mapped"] = lambda: read_floor_mapped(files, bufs, threads)
    times: dict[str, list[float]] = {k: [] for k in cases}
    cpu: dict[str, list[float]] = {k: [] for k in cases}
    for i in range(repeats + 1):  # round 0 warms the page cache and every code path
        for name, fn in cases.items():
            c0 = time.process_time()
            dt = fn()
            if i:
                times[name].append(dt)
                cpu[name].append(time.process_time() - c0)
    med = {k: statistics.median(v) for k, v in times.items()}
    mcpu = {k: statistics.median(v) for k, v in cpu.items()}
    return {
        "model": dataclasses.asdict(cfg),
        "state_gb": state_bytes(model, optim) / 1e9,
        "tensors": len(model.state_dict()) + sum(len(s) for s in optim.state.values()),
        "read_gb": sum(b.numel() for b in bufs) / 1e9,
        "threads": threads,
        "repeats": repeats,
        **{f"{k}_s": {"median": med[k], "min": min(v), "cpu_median": mcpu[k]} for k, v in times.items()},
        **{f"{k}_speed_vs_floor": med["floor"] / med[k] for k in cases if k != "floor"},
        **{f"{k}_cpu_vs_floor": mcpu[k] / mcpu["floor"] for k in cases if k != "floor"},
        **({f"{k}_speed_vs_mapped_floor": med["floor_mapped"] / med[k] for k in ("bytecp", "bytecp_unverified")}
           if "floor_mapped" in med else {}),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.07, help="state size (parameters + Adam state), GB")
    ap.add_argument("--moe", type=int, default=None, metavar="N", help="a MoE-like GPT of about N tensors instead")
    ap.add_argument("--threads", type=int, default=4, help="reader threads of the floor and of bytecp's load")
    ap.add_argument("--repeats", type=int, default=7, help="measured rounds")
    ap.add_argument("--root", default=None, help="where the checkpoints go (a temporary directory by default)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.root) as root:
        out = run(args.gb, root, args.threads, args.repeats, moe=args.moe)
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
