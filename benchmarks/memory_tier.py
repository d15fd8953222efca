"""The memory tier (keeper://) measured in one run, beside local disk and S3.

Two keeper processes on loopback ports stand for this host (h0) and its
peer (h1), replicas=2. One training process (host h0) saves a model and its
AdamW state through ``CheckpointManager(memory_url="keeper://...",
async_save=True)`` and the run measures, medians of ``--repeats``:

- ``prewarm``: :func:`bytecp.prewarm` at start (with the memory URL: the
  keeper readies 3 arenas, mapped now); ``blocking``: what ``maybe_save``
  blocks the training step for, per memory checkpoint (the first one
  separately); ``two_copy``: the same with ``single_copy=False``;
- ``to_commit``: from the call to the memory checkpoint's commit, every file
  with its two copies (the replication included); ``replication``: the
  keeper's time pushing the checkpoint's files to its peer; ``keeper_cpu``:
  the CPU time of both keeper processes per memory checkpoint (adopting,
  checksumming, replicating, retention's deletes);
- ``recover-local`` / ``recover-peer``: ``bytecp.load`` from this host's
  keeper, and from the peer after this host's keeper lost its copy (a
  replaced host);
- ``recover-disk`` / ``recover-s3``: ``bytecp.load`` of the same state from
  local disk and from a Ceph RADOS Gateway on 127.0.0.1 (started here
  through ``tools/ceph/start_rgw.sh``; ``--no-s3`` skips it);
- ``copies``: the single-copy path (the rank stages into an arena the
  keeper lent, the keeper adopts it as the data file, checksums and
  replicates it) beside the two-copy one (``single_copy=False``: a private
  arena, then the rank's writer thread checksums and writes into the
  keeper's shared memory), for an eager ``async_save``, a lazy one and a
  ``bytecp.save``: ``blocking_s`` (what the call blocks), ``to_commit_s``,
  ``trainer_cpu_s`` (the training process's CPU time from the call to the
  commit, ``getrusage``: the copy, checksums and writes of the save
  thread) and ``trainer_copied_bytes`` (bytes the training process copied:
  staged plus written to the keeper).

    python -m benchmarks.memory_tier --mb 256 --repeats 3 [--json out.json] [--only-copies | --no-copies]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "storage"))

import bytecp  # noqa: E402
from bytecp.storage_api import open_storage  # noqa: E402


def state_of(mb: int, seed: int) -> dict[str, Any]:
    """A model whose parameters and AdamW state take about ``mb`` MB."""
    torch.manual_seed(seed)
    width = 1024
    layers = max(1, mb * (1 << 20) // (3 * 4 * width * width))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return {"model": model, "optim": opt}


class _CopiesOnly(Exception):
    """--only-copies: the rest is skipped."""


def cpu_s() -> float:
    """This process's CPU time (every thread), user + system."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def copies(state: dict[str, Any], nbytes: int, opts: dict[str, Any], repeats: int) -> dict[str, Any]:
    """The single-copy and the two-copy paths, per save order (medians of ``repeats``)."""
    from bytecp.storage.keeper import KeeperStorage

    written = [0]
    write_file = KeeperStorage.write_file

    def counted(self: KeeperStorage, path: str, buffers: Any) -> None:
        written[0] += sum(memoryview(b).nbytes for b in buffers)
        write_file(self, path, buffers)

    KeeperStorage.write_file = counted  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    try:
        for single in (False, True):
            o = dict(opts, single_copy=single)
            for order in ("eager", "lazy", "sync"):
                run = f"keeper://job/copies-{single}-{order}"
                block, staged, commit, cpu, copied = [], [], [], [], []
                for step in range(repeats + 1):
                    url = f"{run}/step-{step}"
                    written[0] = 0
                    c0, t0 = cpu_s(), time.perf_counter()
                    if order == "sync":
                        bytecp.save(url, state, storage_options=o)
                        block.append(time.perf_counter() - t0)
                    else:
                        h = bytecp.async_save(url, state, lazy=order == "lazy", storage_options=o)
                        block.append(time.perf_counter() - t0)
                        while not h.staged():  # lazy: what a step right after the call would wait for
                            time.sleep(0.0005)
                        staged.append(time.perf_counter() - t0)
                        h.wait()
                    commit.append(time.perf_counter() - t0)
                    cpu.append(cpu_s() - c0)
                    # a sync two-copy save reads the live tensors: its one copy is the write
                    copied.append(written[0] + (0 if order == "sync" and not single else nbytes))
                    if step:
                        open_storage(f"{run}/step-{step - 1}", **o).delete_prefix()  # retention
                med = lambda v: statistics.median(v[1:])  # noqa: E731  # the first allocates
                out[f"{'single' if single else 'two'}/{order}"] = {
                    "blocking_s": med(block), "staged_s": med(staged) if staged else med(block),
                    "to_commit_s": med(commit), "trainer_cpu_s": med(cpu),
                    "trainer_copied_bytes": int(med(copied))}
                open_storage(run, **o).delete_prefix()
    finally:
        KeeperStorage.write_file = write_file  # type: ignore[method-assign]
    return out


def manager_loop(state: dict[str, Any], run: Path, mem: str, opts: dict[str, Any], repeats: int,
                 prewarm_s: float) -> dict[str, float]:
    """Memory checkpoints through ``CheckpointManager(async_save=True)``, retention keeping 2."""
    mgr = bytecp.CheckpointManager(str(run), every_n_steps=10**9, memory_url=mem, memory_every_n_steps=1,
                                   memory_storage_options=opts, async_save=True)
    blocking, to_commit, replication, keeper_cpu = [], [], [], []
    for step in range(1, repeats + 2):
        cpu0 = sum(s["cpu_s"] for s in open_storage(mem, **opts).keeper_stats())  # type: ignore[attr-defined]
        t0 = time.perf_counter()
        mgr.maybe_save(step, state)
        blocking.append(time.perf_counter() - t0)
        mgr.wait()
        to_commit.append(time.perf_counter() - t0)
        stats = open_storage(mem, **opts).keeper_stats()  # type: ignore[attr-defined]
        key = f"{mem[len('keeper://'):]}/step-{step}"
        replication.append(max(s["replication_s"].get(key, 0.0) for s in stats))
        keeper_cpu.append(sum(s["cpu_s"] for s in stats) - cpu0)
    return {"prewarm_s": prewarm_s, "blocking_first_s": blocking[0], "blocking_s": statistics.median(blocking[1:]),
            "to_commit_s": statistics.median(to_commit[1:]), "replication_s": statistics.median(replication[1:]),
            "keeper_cpu_s": statistics.median(keeper_cpu[1:])}


def timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-s3", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-copies", action="store_true", help="skip the single- vs two-copy figures")
    ap.add_argument("--only-copies", action="store_true", help="only the single- vs two-copy figures")
    args = ap.parse_args()
    from keepers import TOKEN, free_ports, spawn_keeper

    tmp = Path(tempfile.mkdtemp(prefix="bytecp-memtier-"))
    ports = dict(zip(["h0", "h1"], free_ports(2), strict=True))
    keepers = [spawn_keeper(n, ports, tmp) for n in ports]
    opts = {"keepers": ",".join(f"{n}=127.0.0.1:{p}" for n, p in ports.items()), "host": "h0", "token": TOKEN}
    out: dict[str, Any] = {"mb": args.mb, "repeats": args.repeats}
    s3 = None
    try:
        state = state_of(args.mb, 0)
        nbytes = sum(p.numel() * 4 * 3 for p in state["model"].parameters())
        out["state_bytes"] = nbytes
        if not args.no_copies:
            out["copies"] = copies(state, nbytes, opts, args.repeats)
        if args.only_copies:
            raise _CopiesOnly
        two = dict(opts, single_copy=False)  # the two-copy path first, as before the keepers lent arenas
        out["two_copy"] = manager_loop(state, tmp / "run2", "keeper://job/run2", two, args.repeats,
                                       bytecp.prewarm(state))
        prewarm = bytecp.prewarm(state, url="keeper://job/run", storage_options=opts, arenas=3)
        out.update(manager_loop(state, tmp / "run", "keeper://job/run", opts, args.repeats, prewarm))
        last = f"keeper://job/run/step-{args.repeats + 1}"
        target = state_of(args.mb, 1)
        out["recover-local_s"] = statistics.median(
            timed(lambda: bytecp.load(last, target, storage_options=opts)) for _ in range(args.repeats))
        disk = str(tmp / "disk")
        bytecp.save(disk, state)
        out["recover-disk_s"] = statistics.median(timed(lambda: bytecp.load(disk, target)) for _ in range(args.repeats))
        if not args.no_s3:
            from s3_servers import start_ceph_rgw

            s3 = start_ceph_rgw(memstore_bytes=max(3 << 30, 3 * nbytes))
            bucket = s3.new_bucket()
            url = f"s3://{bucket}/ckpt"
            bytecp.save(url, state, storage_options=s3.options())
            out["recover-s3_s"] = statistics.median(
                timed(lambda: bytecp.load(url, target, storage_options=s3.options())) for _ in range(args.repeats))
        # this host's keeper loses its copy (a replaced host): its peer serves the load
        root = open_storage("keeper://job/run", **opts)._local_root()  # type: ignore[attr-defined]
        shutil.rmtree(os.path.join(root, "job"), ignore_errors=True)
        out["recover-peer_s"] = statistics.median(
            timed(lambda: bytecp.load(last, target, storage_options=opts)) for _ in range(args.repeats))
        for (k, v), w in zip(state["model"].state_dict().items(), target["model"].state_dict().values(),
                             strict=True):
            assert torch.equal(v, w), k
    except _CopiesOnly:
        pass
    finally:
        for k in keepers:
            k.terminate()
            k.wait(timeout=30)
        if s3 is not None:
            s3.stop()
    out["gb_per_s"] = {k[:-2]: nbytes / v / 1e9 for k, v in out.items() if k.startswith("recover-")}
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
