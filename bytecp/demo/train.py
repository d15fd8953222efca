"""The demo's training job: one process per rank, under ``torchrun`` or the
demo's own launcher (:mod:`bytecp.demo.launch`).

    torchrun --standalone --nproc_per_node 2 -m bytecp.demo.train --checkpoints /tmp/run --until 6
    torchrun --standalone --nproc_per_node 1 -m bytecp.demo.train --checkpoints /tmp/run --until 8
    torchrun --standalone --nproc_per_node 3 -m bytecp.demo.train --checkpoints /tmp/run --until 12 --parallel ddp

Every start resumes from the latest *committed* checkpoint under ``--checkpoints``
(``CheckpointManager.restore``), whatever the number of processes and the
parallelism (FSDP2 or DDP) that saved it, and trains on the data of the
following global steps: its data loader (torchdata's ``StatefulDataLoader``
with ``DistributedSampler``, :func:`bytecp.demo.model.data_loader`) is in the
checkpoint, and bytecp reshards its position to the new number of processes. A checkpoint
is saved every ``--save-every`` steps, lazily and in the background
(``CheckpointManager(async_save=True, lazy=True)``): training pauses only to
describe the state; the copy runs during the next forward/backward and the
write and commit after it.

What the demo's launcher adds: ``--results DIR`` (rank 0 writes
``result.json``: losses, saves, restore check, evaluation loss, the error
that stopped it), ``--record-states`` (the full state at each save, to check
a later restore bitwise), and ``--die-at-save STEP`` (the process of rank
``--die-rank`` announces itself in ``DIR/victim.json`` once its part of that
save is staged and waits to be SIGKILLed; its write is held meanwhile, as on
a slow disk, so the kill always lands before the checkpoint can commit).
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import re
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from bytecp.demo.model import STEPS_PER_EPOCH, TinyGPT, data_loader, eval_batch, loss_of
from bytecp.errors import BytecpError
from bytecp.manager import CheckpointManager

__all__ = ["main", "full_state", "EXIT_STOPPED", "LR"]

#: exit status of a rank that stopped because another one failed
EXIT_STOPPED = 3
#: how long a rank whose training broke waits for its save in flight to end: it
#: ends in seconds (the save's collective breaks and a roll call names the lost
#: rank); the margin is for a host so busy that those seconds stretch. Under the
#: launcher's grace period (60 s), so a save that does not end leaves its stack
STOP_WAIT_S = 45
LR = 1e-2


def _build(parallel: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same initial weights on every rank and in the reference run
    model: torch.nn.Module = TinyGPT()
    if parallel == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """(all ranks) Every model and optimizer tensor, unsharded, by name."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    o = StateDictOptions(full_state_dict=True)
    msd: Any = get_model_state_dict(model, options=o)
    out: dict[str, torch.Tensor] = {f"model.{k}": v for k, v in msd.items()}
    osd: Any = get_optimizer_state_dict(model, opt, options=o)
    out.update({f"optimizer.{p}.{k}": v for p, st in osd["state"].items() for k, v in st.items()})
    return out


def _write_json(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def _await_death(handle: Any, rank: int, step: int, url: str, results: str) -> None:
    """(the victim) Once this rank's part of the save is staged (its write is
    held), say so and wait for the launcher's SIGKILL; die anyway after 60 s
    (under plain torchrun there is no launcher to do it)."""
    deadline = time.monotonic() + 60
    while not handle.staged() and time.monotonic() < deadline:
        time.sleep(0.005)
    _write_json(os.path.join(results, "victim.json"),
                {"rank": rank, "pid": os.getpid(), "step": step, "checkpoint": url, "staged": handle.staged()})
    time.sleep(60)
    os.kill(os.getpid(), signal.SIGKILL)


def _short(e: BaseException) -> str:
    """One line a user can read: bytecp's own message, or the first sentence
    of a backend's (without its source location)."""
    text = " ".join(str(e).split())
    if isinstance(e, BytecpError):
        return text[:400]
    text = re.sub(r"^\[[^\]]*\]\s*", "", text).split(". ")[0]
    if "Connection closed by peer" in text or "Connection reset" in text:
        return f"the connection to another process was lost ({text})"
    return f"{type(e).__name__}: {text[:300]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoints", required=True, help="run directory: checkpoints go to CHECKPOINTS/step-N (any URL bytecp takes)")
    ap.add_argument("--until", type=int, required=True, help="train until this global step")
    ap.add_argument("--parallel", choices=["fsdp2", "ddp"], default="fsdp2")
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--keep-last", type=int, default=3)
    ap.add_argument("--eval", action="store_true", help="print the held-out loss at the end")
    ap.add_argument("--results", help="directory for rank 0's result.json (the demo's launcher reads it)")
    ap.add_argument("--record-states", action="store_true", help="also write RESULTS/state-step-N.pt at each save")
    ap.add_argument("--die-at-save", type=int, help="the process of --die-rank waits to be killed during this save")
    ap.add_argument("--die-rank", type=int, default=1)
    args = ap.parse_args(argv)
    if (args.record_states or args.die_at_save is not None) and not args.results:
        ap.error("--record-states and --die-at-save need --results")

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    model, opt = _build(args.parallel)
    loader = data_loader(rank, world)
    extra: dict[str, Any] = {"step": 0, "dataloader": loader}
    state: dict[str, Any] = {"model": model, "optimizer": opt, "extra": extra}
    mgr = CheckpointManager(args.checkpoints, every_n_steps=args.save_every, keep_last=args.keep_last,
                            async_save=True, lazy=True)
    result: dict[str, Any] = {"world": world, "parallel": args.parallel, "losses": {}, "saves": {}}

    def say(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    restored = mgr.restore(state)
    result["restored_step"] = restored
    if restored is None:
        say(f"no checkpoint under {args.checkpoints}: starting from step 0")
    else:
        say(f"restored {mgr.url_for(restored).rsplit('/', 1)[-1]} with CheckpointManager.restore "
            f"(the latest committed checkpoint)")
        _check_restore(args, restored, model, opt, result, say)

    handles: dict[int, Any] = {}
    step = extra["step"]
    loader.sampler.set_epoch(step // STEPS_PER_EPOCH)  # the epoch of the next step
    batches = iter(loader)  # (restored: where the saved job stopped, on this number of processes)
    try:
        while step < args.until:
            step += 1
            notes = _commit_notes(handles, result)
            if (step - 1) % STEPS_PER_EPOCH == 0 and step > 1:  # a new epoch: its own order
                loader.sampler.set_epoch((step - 1) // STEPS_PER_EPOCH)
                batches = iter(loader)
            x, y = next(batches)
            loss = loss_of(model, x, y)
            loss.backward()
            opt.step()  # lazy mode: waits here only if the previous save's copy is not done
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            result["losses"][str(step)] = float(mean) / world
            extra["step"] = step
            if step % args.save_every == 0:
                if args.record_states:
                    _record(args.results, step, full_state(model, opt), rank)
                victim = args.die_at_save == step and rank == args.die_rank
                if victim:  # hold this rank's write, as on a slow disk, so the kill lands first
                    os.environ["BYTECP_FAULT_DELAY"] = f"write:{rank}:600"
                t0 = time.perf_counter()
                handles[step] = mgr.save(step, state)
                paused = time.perf_counter() - t0
                result["saves"][str(step)] = {"call_s": paused, "outcome": "in flight"}
                notes.append(f"checkpoint step-{step} started in the background (save() returned in {paused * 1e3:.1f} ms)")
                if victim:
                    _await_death(handles[step], rank, step, mgr.url_for(step), args.results)
            say(f"step {step:2d}  loss {result['losses'][str(step)]:.4f}" + "".join(f"   {n}" for n in notes))
        mgr.wait(timeout=120)
        for n in _commit_notes(handles, result):
            say(n)
        if args.eval:
            result["eval_loss"] = _evaluate(model)
            say(f"evaluation loss on held-out data: {result['eval_loss']:.4f} "
                f"(exactly {result['eval_loss']!r}, float32)")
    except Exception as e:  # another rank died, or anything else: say what, never hang
        _stop(e, step, mgr, handles, result, args.results if rank == 0 else None, say)
    if rank == 0 and args.results:
        _write_json(os.path.join(args.results, "result.json"), result)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _commit_notes(handles: dict[int, Any], result: dict[str, Any]) -> list[str]:
    """Saves that ended since the last look, in words (and in ``result``)."""
    notes = []
    for step, h in list(handles.items()):
        if h.done():
            del handles[step]
            err = h.exception()
            result["saves"][str(step)]["outcome"] = "committed" if err is None else "failed"
            notes.append(f"checkpoint step-{step} committed" if err is None else f"checkpoint step-{step} FAILED")
    return notes


def _stop(e: BaseException, step: int, mgr: CheckpointManager, handles: dict[int, Any], result: dict[str, Any],
          results: str | None, say: Any) -> None:
    """Training broke (e.g. a rank was killed): tell what happened to the
    training step and to the save in flight, write the result, and exit at
    once (a broken process group must not be waited on)."""
    result["stopped"] = {"step": step, "error": _short(e)}
    say(f"step {step:2d}  training stopped: {_short(e)}")
    try:
        mgr.wait(timeout=STOP_WAIT_S)
    except (BytecpError, TimeoutError) as se:
        result["stopped"]["save_error"] = _short(se)
        if isinstance(se, TimeoutError):  # where the save is stuck, in this rank's log
            faulthandler.dump_traceback(all_threads=True)
    for s in handles:
        outcome = "committed" if handles[s].done() and handles[s].exception() is None else "failed"
        result["saves"][str(s)]["outcome"] = outcome
        say(f"checkpoint step-{s} {'committed' if outcome == 'committed' else 'was NOT committed'}"
            + (f": {result['stopped']['save_error']}" if "save_error" in result["stopped"] else ""))
    if results:
        _write_json(os.path.join(results, "result.json"), result)
    sys.stdout.flush()
    os._exit(EXIT_STOPPED)


def _record(results: str, step: int, full: dict[str, torch.Tensor], rank: int) -> None:
    if rank == 0:
        torch.save(full, os.path.join(results, f"state-step-{step}.pt"))


def _check_restore(args: argparse.Namespace, restored: int, model: torch.nn.Module, opt: torch.optim.Optimizer,
                   result: dict[str, Any], say: Any) -> None:
    """With ``--record-states``: compare every restored tensor with the full
    state the saving job recorded at that step (all ranks take part)."""
    if not args.record_states:
        return
    path = os.path.join(args.results, f"state-step-{restored}.pt")
    have = full_state(model, opt)
    if not os.path.exists(path):
        return
    want = torch.load(path, weights_only=True)
    differ = sorted(k for k in want if k not in have or not torch.equal(have[k], want[k]))
    result["restore_check"] = {"tensors": len(want), "differ": differ}
    if differ:
        say(f"restored state differs from what was saved in {len(differ)} tensors, e.g. {differ[:3]}")
    else:
        say(f"all {len(want)} model and optimizer tensors are bitwise what the saving job held at step {restored}")


def _evaluate(model: torch.nn.Module) -> float:
    """(all ranks) Mean loss on the held-out batch, float32, as the evaluation job computes it."""
    plain = getattr(model, "module", model)  # DDP's module; FSDP2's model itself (all ranks gather)
    plain.eval()
    with torch.no_grad():
        value = float(loss_of(plain, *eval_batch()))
    plain.train()
    return value


if __name__ == "__main__":
    sys.exit(main())
