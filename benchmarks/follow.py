"""Following a run: the latency and bytes of a follower's update
(``bytecp.follow``) beside a full reload of the same checkpoint.

    python -m benchmarks.follow [--hidden 768 --layers 4 --steps 3] [--memory] [--json out.json]

One process, local disk (page cache warm: each checkpoint's files are read
once before the update and the reload are timed, which go first in turn;
the bytes a follower skips are what it saves on a remote store). A transformers Llama built from a config
(no downloads) is trained three ways, each step an in-place change of its
trainable parameters (what an optimizer step does to them and to their
version counters), saved by a ``CheckpointManager`` every step
(incremental): (a) every weight trainable, (b) a LoRA (the real peft, r=8 on
q_proj/v_proj), (c) the embedding and the first half of the layers frozen.
A follower (``{"model": model}`` of its own) takes each checkpoint; figures
are the medians over the updates after the first: the update's wall time
and the bytes it read, beside ``bytecp.load`` of the same checkpoint into a
fresh model (every byte), and beside a ``torch.distributed`` broadcast of
the changed tensors (the trainable ones) from one process group's rank to
another's (gloo, two spawned processes on this host: what a push-based
update such as checkpoint-engine's costs before any resharding; ``/bcast``
is the update's latency over it).

``--memory``: the same cases from the memory tier instead -- a keeper
process on this host (``bytecp keeper``, as a training host runs it), the
trainer's ``CheckpointManager(memory_url="keeper://...",
memory_every_n_steps=1)`` saving each step to it and the follower given
``memory_url=`` (it lists both tiers and reads the memory checkpoint: the
keeper's shared memory, no disk); the reload is ``bytecp.load`` of the same
memory checkpoint. Memory saves are whole (no references): what did not
change is told by checksums.

``--serving``: serving deltas (``CheckpointManager(serving_dtype=torch.bfloat16)``)
in a full fine-tune -- the Llama trained for real (AdamW, forward and
backward on random tokens) at each learning rate of ``--lrs``, every step
saved asynchronously (model and optimizer) to two runs: one with serving
deltas, one without (the model: the deltas are the model's). Then a
follower holding bf16 weights (``bytecp.follow(..., dtype=torch.bfloat16)``)
follows each run as it is replayed -- each checkpoint renamed into the
followed run in turn, page cache warm, the two followers' updates timed
alternately with nothing else running: by deltas on the first, by whole
tensors read and cast on the second. Figures are medians over the steps
after the first: the bytes an update reads (and their share of the bf16
weights' bytes), its wall time (``FollowUpdate.seconds``) and CPU time (the process's over
the same span, nothing else running in it: on a busy shared host the
steadier of the two), the share of bf16 elements that changed since
the previous step, and of the changed tensors taken from the serving files
(their deltas, or the whole bf16 copies the trainer wrote where a delta
would cost more; the rest read whole in fp32 and cast),
and the trainer's side -- the time ``save()`` blocked the training loop
(the async snapshot) with and without deltas, and the time computing and
writing the deltas added to the save's background thread (its ``serve``
spans; the first save, whole, left out). Beside them, what the issue's
comparison moves every step -- the whole bf16 weights rebroadcast (a
``torch.distributed`` broadcast of the same bytes between two gloo
processes on this host, as above). Both followers are checked bitwise
against the trainer's weights cast to bf16 after every update.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

import bytecp
from benchmarks.incremental import _llama
from tests.netport import free_port


def _model(case: str, hidden: int, layers: int) -> Any:
    model = _llama(hidden, layers)
    if case == "lora":
        from peft import LoraConfig, get_peft_model

        return get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    if case == "half_frozen":
        model.model.embed_tokens.requires_grad_(False)
        for layer in model.model.layers[: layers // 2]:
            layer.requires_grad_(False)
    return model


def _train(model: Any, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g), alpha=1e-3)


def _broadcast_rank(rank: int, port: int, numels: list[int], reps: int, out: Any) -> None:
    """One of the two gloo ranks: rank 0 (the trainer) broadcasts tensors of
    ``numels`` float32 elements to rank 1 (the follower); rank 1 reports the
    median wall time of ``reps`` rounds, each ending in a barrier."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    bufs = [torch.full((n,), float(rank)) for n in numels]
    times = []
    for _ in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        for b in bufs:
            dist.broadcast(b, src=0)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    if rank == 1:
        assert all(bool((b == 0).all()) for b in bufs)
        out.put(statistics.median(times[1:]))
    dist.destroy_process_group()


def broadcast_s(numels: list[int], reps: int = 3) -> float:
    """The floor a push-based weight update compares with: a ``torch.distributed``
    broadcast (gloo, two spawned processes on this host) of the same tensors."""
    ctx = mp.get_context("spawn")
    port = free_port()
    q = ctx.Queue()
    procs = [ctx.Process(target=_broadcast_rank, args=(r, port, numels, reps, q), daemon=True) for r in (0, 1)]
    for pr in procs:
        pr.start()
    try:
        return float(q.get(timeout=300))
    finally:
        for pr in procs:
            pr.join(timeout=30)
            if pr.is_alive():
                pr.kill()


def _warm(path: Path) -> None:
    """Read a checkpoint's files once: the page cache holds them as after any
    earlier reader (the save's own written pages are slower to read first)."""
    for f in sorted(path.rglob("*")):
        if f.is_file():
            with f.open("rb") as fh:
                while fh.read(16 << 20):
                    pass


def start_keeper(root: Path) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """(``--memory``) A keeper process on a free loopback port; its storage options."""
    port = free_port()
    token, ready = uuid.uuid4().hex, root / "keeper.ready"
    proc = subprocess.Popen([sys.executable, "-m", "bytecp.storage.keeper_server", "--name", "h0", "--port",
                             str(port), "--keepers", f"h0=127.0.0.1:{port}", "--replicas", "1",
                             "--ready-file", str(ready)], env=dict(os.environ, BYTECP_KEEPER_TOKEN=token))
    deadline = time.time() + 60
    while not ready.exists():
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError("the keeper did not start")
        time.sleep(0.05)
    return proc, {"keepers": f"h0=127.0.0.1:{port}", "host": "h0", "token": token}


def run_case(case: str, hidden: int, layers: int, steps: int, root: Path,
             memory: dict[str, Any] | None = None) -> dict[str, Any]:
    run = root / case
    model, served, fresh = (_model(case, hidden, layers) for _ in range(3))
    mem_url = f"keeper://bench/{root.name}-{case}" if memory is not None else None
    if memory is None:
        mgr = bytecp.CheckpointManager(str(run), every_n_steps=1, keep_last=3)
    else:  # memory every step, never drained in the timed steps
        mgr = bytecp.CheckpointManager(str(run), every_n_steps=10**9, keep_last=3, memory_url=mem_url,
                                       memory_every_n_steps=1, memory_storage_options=memory, memory_keep_last=3)
    gen = bytecp.follow(str(run), {"model": served}, poll_s=0.001, memory_url=mem_url, memory_storage_options=memory)
    updates, reloads = [], []
    for step in range(1, steps + 2):
        _train(model, step)
        if memory is None:
            mgr.save(step, {"model": model})
            _warm(run / f"step-{step}")
        else:
            mgr.maybe_save(step, {"model": model})
        if step % 2:  # alternate which goes first: neither pays the other's first touches
            up = next(gen)
        t0 = time.perf_counter()
        bytecp.load(f"{mem_url or run}/step-{step}", {"model": fresh}, storage_options=memory)
        reloads.append(time.perf_counter() - t0)
        if not step % 2:
            up = next(gen)
        assert up.ok and up.step == step and up.tier == ("memory" if memory else "storage"), up
        if step > 1:
            updates.append(up)
    gen.close()
    for k, v in model.state_dict().items():
        assert torch.equal(served.state_dict()[k], v), k
    total = sum(t.nbytes for t in model.state_dict().values())
    upd_s = statistics.median(u.seconds for u in updates)
    reload_s = statistics.median(reloads[1:])
    bcast_s = broadcast_s([p.numel() for p in model.parameters() if p.requires_grad])  # what changed
    return {"case": case, "tier": "memory" if memory else "storage", "model_bytes": total, "update_bytes_read": int(statistics.median(u.bytes_read for u in updates)),
            "update_tensors_read": updates[-1].tensors_read, "update_s": upd_s, "full_reload_s": reload_s,
            "full_reload_bytes": total, "speedup": reload_s / upd_s, "broadcast_s": bcast_s,
            "vs_broadcast": upd_s / bcast_s}


def _serve_seconds(ck: Path) -> float:
    """A save's ``serve`` spans (computing and writing its serving deltas), from its report."""
    rep = json.loads((ck / "reports" / "0.json").read_text())
    return sum(sp["duration"] for sp in rep["spans"] if sp["phase"] == "serve")


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, 8192, (2, 32), generator=torch.Generator().manual_seed(step))


#: the process's CPU seconds of each follower update (the same span as ``FollowUpdate.seconds``)
_UPDATE_CPU: list[float] = []


def _count_update_cpu() -> None:
    """Wrap the follower's update so that its CPU time is recorded (a measurement of this benchmark only)."""
    from bytecp.serving.follow import _Follower

    if getattr(_Follower.update, "_bench", False):
        return
    real = _Follower.update

    def update(self: Any, d: Any) -> Any:
        c0 = time.process_time()
        try:
            return real(self, d)
        finally:
            _UPDATE_CPU.append(time.process_time() - c0)

    update._bench = True  # type: ignore[attr-defined]
    _Follower.update = update  # type: ignore[method-assign]


def serving_case(lr: float, hidden: int, layers: int, steps: int, root: Path) -> dict[str, Any]:
    """One learning rate of ``--serving`` (see the module's docstring): the
    trainer's run first (each save measured), then the followers replay it,
    each checkpoint published into their runs in turn (a rename), so that
    the updates are timed alternately, A then B then B then A, with nothing
    else running."""
    bf16 = torch.bfloat16
    model = _llama(hidden, layers)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    kinds = ("deltas", "whole")
    saved = {k: root / f"lr{lr:g}-{k}-saved" for k in kinds}
    mgrs = {"deltas": bytecp.CheckpointManager(str(saved["deltas"]), every_n_steps=1, keep_last=None,
                                               async_save=True, serving_dtype=bf16),
            "whole": bytecp.CheckpointManager(str(saved["whole"]), every_n_steps=1, keep_last=None, async_save=True)}
    numel = sum(p.numel() for p in model.parameters())
    rec: dict[str, list[float]] = {k: [] for k in ("d_s", "w_s", "d_cpu", "w_cpu", "d_bytes", "w_bytes",
                                                   "changed", "by_delta", "block_d", "block_w", "serve_s")}
    want: dict[int, dict[str, torch.Tensor]] = {}
    for step in range(1, steps + 2):  # the trainer: a real AdamW step, then both saves, alternately first
        model(input_ids=_tokens(step), labels=_tokens(step)).loss.backward()
        opt.step()
        opt.zero_grad()
        for k in (kinds if step % 2 else kinds[::-1]):
            t0 = time.perf_counter()
            mgrs[k].save(step, {"model": model})  # the training loop's block: the async snapshot
            rec["block_d" if k == "deltas" else "block_w"].append(time.perf_counter() - t0)
            mgrs[k].wait()
        rec["serve_s"].append(_serve_seconds(saved["deltas"] / f"step-{step}"))
        want[step] = {n: v.to(bf16).view(torch.int16) for n, v in model.state_dict().items()}
    runs = {k: root / f"lr{lr:g}-{k}" for k in kinds}
    served = {k: _llama(hidden, layers).to(bf16) for k in kinds}
    _count_update_cpu()
    gens = {}
    for k in kinds:
        runs[k].mkdir()
        gens[k] = bytecp.follow(str(runs[k]), {"model": served[k]}, poll_s=0.001, dtype=bf16, on_error="raise")
    for step in range(1, steps + 2):
        for k in kinds:  # published: each run gets its next checkpoint whole, at once
            os.rename(saved[k] / f"step-{step}", runs[k] / f"step-{step}")
            _warm(runs[k] / f"step-{step}")
        ups, cpu = {}, {}
        for k in (kinds if step % 2 else kinds[::-1]):
            _UPDATE_CPU.clear()
            ups[k] = next(gens[k])
            cpu[k] = _UPDATE_CPU[-1]
            assert ups[k].ok and ups[k].step == step and not ups[k].fallbacks, ups[k]
            got = served[k].state_dict()
            assert all(torch.equal(got[n].view(torch.int16), v) for n, v in want[step].items()), (k, step)
        if step == 1:
            continue
        d, w = ups["deltas"], ups["whole"]
        assert w.tensors_by_delta == 0, w
        rec["by_delta"].append(d.tensors_by_delta / max(1, d.tensors_read))
        rec["d_s"].append(d.seconds)
        rec["w_s"].append(w.seconds)
        rec["d_cpu"].append(cpu["deltas"])
        rec["w_cpu"].append(cpu["whole"])
        rec["d_bytes"].append(d.bytes_read)
        rec["w_bytes"].append(w.bytes_read)
        # the bf16 elements whose value changed since the previous step (the trainer's, whatever was read)
        rec["changed"].append(sum(int((v != want[step - 1][n]).sum()) for n, v in want[step].items()) / numel)
    for g in gens.values():
        g.close()
    # the bf16 weights' bytes rebroadcast whole (float32 buffers of half as many elements: the same bytes)
    bcast = broadcast_s([(p.numel() + 1) // 2 for p in model.parameters()])
    m = {k: statistics.median(v[1:] if k.startswith(("block", "serve")) else v) for k, v in rec.items()}
    return {"lr": lr, "bf16_bytes": 2 * numel, "changed": m["changed"], "by_delta": m["by_delta"],
            "delta_bytes": int(m["d_bytes"]),
            "whole_bytes": int(m["w_bytes"]), "delta_share": m["d_bytes"] / (2 * numel), "delta_s": m["d_s"],
            "whole_s": m["w_s"], "time_ratio": m["d_s"] / m["w_s"], "delta_cpu_s": m["d_cpu"],
            "whole_cpu_s": m["w_cpu"], "cpu_ratio": m["d_cpu"] / m["w_cpu"], "block_deltas_s": m["block_d"],
            "block_whole_s": m["block_w"], "serve_s": m["serve_s"], "broadcast_bf16_s": bcast,
            "vs_broadcast": m["d_s"] / bcast}


def serving_main(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="bytecp-follow-serving-"))
    try:
        rows = [serving_case(float(lr), args.hidden, args.layers, args.steps, root) for lr in args.lrs.split(",")]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{'lr':>7}{'changed':>9}{'by delta':>9}{'delta MB':>10}{'of bf16':>9}{'whole MB':>10}{'delta s':>9}"
          f"{'whole s':>9}{'ratio':>7}{'d cpu s':>9}{'w cpu s':>9}{'ratio':>7}{'bcast s':>9}{'/bcast':>8}"
          f"{'block d':>9}{'block w':>9}{'serve s':>9}")
    for r in rows:
        print(f"{r['lr']:>7g}{r['changed']:>8.1%} {r['by_delta']:>8.0%} {r['delta_bytes'] / 1e6:>9.2f}"
              f"{r['delta_share']:>8.1%} {r['whole_bytes'] / 1e6:>9.1f}{r['delta_s']:>9.3f}{r['whole_s']:>9.3f}"
              f"{r['time_ratio']:>6.2f}x{r['delta_cpu_s']:>9.3f}{r['whole_cpu_s']:>9.3f}{r['cpu_ratio']:>6.2f}x"
              f"{r['broadcast_bf16_s']:>9.3f}{r['vs_broadcast']:>7.2f}x"
              f"{r['block_deltas_s']:>9.3f}{r['block_whole_s']:>9.3f}{r['serve_s']:>9.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--memory", action="store_true", help="from the memory tier (a keeper process), not storage")
    p.add_argument("--json", default=None)
    p.add_argument("--serving", action="store_true", help="serving deltas in a full fine-tune, by learning rate")
    p.add_argument("--lrs", default="1e-6,1e-5,1e-4", help="(--serving) learning rates, comma-separated")
    args = p.parse_args()
    if args.serving:
        serving_main(args)
        return
    root = Path(tempfile.mkdtemp(prefix="bytecp-follow-"))
    keeper, opts = start_keeper(root) if args.memory else (None, None)
    try:
        rows = [run_case(c, args.hidden, args.layers, args.steps, root, opts)
                for c in ("every_weight", "lora", "half_frozen")]
    finally:
        if keeper is not None:
            keeper.terminate()  # a keeper stopped by a signal frees its shared memory
            keeper.wait(timeout=60)
        shutil.rmtree(root, ignore_errors=True)
    print(f"tier: {'memory (keeper://, this host)' if args.memory else 'storage (local disk)'}")
    print(f"{'case':<14}{'model MB':>10}{'read MB':>10}{'update s':>10}{'reload s':>10}{'speedup':>9}"
          f"{'bcast s':>9}{'/bcast':>8}")
    for r in rows:
        print(f"{r['case']:<14}{r['model_bytes'] / 1e6:>10.1f}{r['update_bytes_read'] / 1e6:>10.2f}"
              f"{r['update_s']:>10.3f}{r['full_reload_s']:>10.3f}{r['speedup']:>8.1f}x"
              f"{r['broadcast_s']:>9.3f}{r['vs_broadcast']:>7.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
