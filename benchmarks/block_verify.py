"""What checking every byte a load places costs: block checksums (format
version 5) against the checks a load made before them, and against none.

    python -m benchmarks.block_verify [--gb 2] [--repeats 5] [--json out.json]

One process, local disk, warm page cache (the data files read through once
before; ``--direct``: every read with O_DIRECT instead, from the disk, as a
cold load reads): the state of the main benchmark (``benchmarks/model.py``: the GPT
and its Adam state, ``--gb`` GB) saved as FSDP2 over 2 ranks holds it (each
tensor's rows in two halves, one chunk each), then each rank's read phase
of a load at another world size -- the boxes FSDP2 gives each rank, the
rows that hold them (``rows_for``), the reads (``plan_load``) and
``execute_reads`` with 8 threads, as ``bytecp.load`` runs them -- every
rank in turn, timed together:

- 2 -> 3 and 2 -> 4 (resharded: every read is part of a chunk), 2 -> 2
  (every read a whole chunk) and 2 -> 1 (whole tensors);
- ``blocks``: ``verify=True`` (the default) on this format: every byte
  checked, partial reads widened to whole blocks;
- ``chunks``: the checks before version 5: whole chunks only (partial
  reads unchecked);
- ``none``: ``verify=False``.

The three modes alternate within each repeat; the figures are the median
over repeats of the wall time and of the process's CPU time (all threads:
what the checks cost on a machine that others load too). Bytes read count
the blocks read beyond the boxes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import bytecp
from bytecp.format import checksum
from bytecp.loading.checks import block_bytes_of
from bytecp.loading.opened import open_checkpoint
from bytecp.loading.reader import Target, execute_reads
from bytecp.plan.load_plan import plan_load
from bytecp.recorder import Trace
from bytecp.storage_api import open_storage
from bytecp.tree.regions import Region
from bytecp.tree.state import Shard, TensorLeaf

from .model import GPT, config_for_gb

__all__ = ["main"]

MODES = ("blocks", "chunks", "none")


def _rows_of(n: int, world: int, rank: int) -> tuple[int, int]:
    """FSDP2's dim-0 shard of ``n`` rows on ``rank`` of ``world`` (``torch.chunk``: ceil-sized pieces)."""
    size = -(-n // world)
    lo = min(n, rank * size)
    return lo, min(n, lo + size) - lo


def _state(gb: float) -> dict[str, torch.Tensor]:
    """The GPT's parameters and two Adam moments of the same shapes, by name."""
    torch.manual_seed(0)
    model = GPT(config_for_gb(gb))
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        w = p.detach()
        out[f"model.{name}"] = w
        out[f"optim.{name}.exp_avg"] = torch.randn_like(w)
        out[f"optim.{name}.exp_avg_sq"] = torch.rand_like(w)
    return out


def _save(url: str, full: dict[str, torch.Tensor], world: int) -> None:
    """As FSDP2 over ``world`` ranks holds it: each tensor's rows in ``world`` pieces."""
    state = {}
    for fqn, t in full.items():
        shards = []
        for r in range(world):
            lo, n = _rows_of(t.shape[0], world, r)
            if n:
                box = Region((lo, *(0,) * (t.dim() - 1)), (n, *t.shape[1:]))
                shards.append(Shard(box, t[lo : lo + n]))
        state[fqn] = TensorLeaf(tuple(t.shape), t.dtype, shards)
    bytecp.save(url, state, io_threads=4)


def _targets(full: dict[str, torch.Tensor], world: int, rank: int) -> list[Target]:
    out = []
    for fqn, t in full.items():
        lo, n = _rows_of(t.shape[0], world, rank)
        if n:
            box = Region((lo, *(0,) * (t.dim() - 1)), (n, *t.shape[1:]))
            out.append(Target(fqn, box, torch.empty(box.lengths, dtype=t.dtype)))
    return out


class _Counting:
    def __init__(self, inner: Any) -> None:
        self.inner, self.read = inner, 0

    def read_ranges(self, path: str, ranges: Any, **kw: Any) -> None:
        self.read += sum(len(b) for _, b in ranges)
        self.inner.read_ranges(path, ranges, **kw)

    def read_ranges_summed(self, path: str, ranges: Any, spans: Any) -> Any:
        self.read += sum(len(b) for _, b in ranges)
        return self.inner.read_ranges_summed(path, ranges, spans)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _load(url: str, targets: list[list[Target]], mode: str, direct: bool = False) -> tuple[float, int, int, float]:
    """Every rank's read phase in turn (``direct``: every read with O_DIRECT, from the disk, not the
    page cache); -> (seconds, bytes read, bytes placed, CPU seconds of the process)."""
    opened = open_checkpoint(open_storage(url, direct=True) if direct else url)
    verify = mode != "none"
    blocks = block_bytes_of(opened.metadata) if mode == "blocks" else None
    storage = _Counting(opened.storage)
    placed = 0
    c0, t0 = time.process_time(), time.perf_counter()
    for mine in targets:
        wanted: dict[str, list[Region]] = {}
        for t in mine:
            wanted.setdefault(t.fqn, []).append(t.box)
        rows = opened.rows_for(wanted).rows
        reqs = plan_load([(t.fqn, t.box) for t in mine], rows, block_bytes=blocks,
                         itemsizes={t.fqn: t.view.element_size() for t in mine})
        placed += execute_reads(storage, rows, mine, reqs, io_threads=8, verify=verify,  # type: ignore[arg-type]
                                trace=Trace("load", url), block_bytes=blocks)
    return time.perf_counter() - t0, storage.read, placed, time.process_time() - c0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.block_verify", description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--worlds", default="3,4,2,1", help="load world sizes (the save is at 2)")
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--block-bytes", type=int, default=None, help="the block size saved (default: the writer's)")
    p.add_argument("--direct", action="store_true", help="read with O_DIRECT (from the disk: a cold load) "
                   "instead of from the page cache")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    full = _state(args.gb)
    total = sum(t.numel() * t.element_size() for t in full.values())
    results: dict[str, Any] = {"gb": round(total / 1e9, 3), "tensors": len(full), "direct": args.direct,
                               "loads": {}}
    with tempfile.TemporaryDirectory(prefix="bytecp-blocks-", dir=args.dir) as tmp:
        url = str(Path(tmp) / "ck")
        if args.block_bytes:
            checksum.BLOCK_BYTES = args.block_bytes
        _save(url, full, 2)
        results["block_bytes"] = block_bytes_of(open_checkpoint(url).metadata)
        for world in (int(w) for w in args.worlds.split(",")):
            targets = [_targets(full, world, r) for r in range(world)]
            _load(url, targets, "none")  # the files in the page cache, the pools started
            times: dict[str, list[float]] = {m: [] for m in MODES}
            cpu: dict[str, list[float]] = {m: [] for m in MODES}
            read: dict[str, int] = {}
            for k in range(args.repeats):
                for mode in MODES[k % 3 :] + MODES[: k % 3]:  # alternated: no mode always first
                    s, n, placed, c = _load(url, targets, mode, args.direct)
                    times[mode].append(s)
                    cpu[mode].append(c)
                    read[mode] = n
            med = {m: statistics.median(v) for m, v in times.items()}
            mcpu = {m: statistics.median(v) for m, v in cpu.items()}
            results["loads"][f"2->{world}"] = {
                "seconds": {m: round(v, 4) for m, v in med.items()},
                "all_seconds": {m: [round(x, 4) for x in v] for m, v in times.items()},
                "blocks_vs_chunks": round(med["blocks"] / med["chunks"], 3),
                "blocks_vs_none": round(med["blocks"] / med["none"], 3),
                "cpu_seconds": {m: round(v, 4) for m, v in mcpu.items()},
                "cpu_blocks_vs_chunks": round(mcpu["blocks"] / mcpu["chunks"], 3),
                "cpu_blocks_vs_none": round(mcpu["blocks"] / mcpu["none"], 3),
                "bytes_placed": placed, "bytes_read": read,
                "extra_read": round(read["blocks"] / placed - 1, 4),
            }
            print(f"2 -> {world}: " + ", ".join(f"{m} {med[m]:.3f} s" for m in MODES)
                  + f"; blocks/chunks {med['blocks'] / med['chunks']:.3f}x, blocks/none "
                  f"{med['blocks'] / med['none']:.3f}x; CPU s " + ", ".join(f"{m} {mcpu[m]:.3f}" for m in MODES)
                  + f"; read {read['blocks'] / placed - 1:+.2%} bytes", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
