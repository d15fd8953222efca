"""``bytecp demo``: a training job's life, stage by stage, told in words.

1. FSDP2 training on 2 processes, lazy asynchronous checkpoints every 2
   steps through ``CheckpointManager``; rank 1 is SIGKILLed while it
   writes checkpoint step-6; rank 0 learns it from bytecp and stops.
2. Elastic restart on 1 process (FSDP2) from the latest *committed*
   checkpoint (step-4: the half-written step-6 is not a checkpoint).
3. Restart on 3 processes with DDP; train to the end; evaluate.
4. The loss, step by step, beside an uninterrupted one-process run.
5. What each checkpoint cost training, from the stored reports.
6. ``bytecp export`` of the final checkpoint, and an evaluation job (plain
   torch + safetensors) that gets the training job's evaluation loss exactly.

Every claim the demo prints is checked; ``<out>/summary.json`` records the
facts (the demo's test reads it), and the exit status is 1 if any claim did
not hold.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

import torch

from bytecp.catalog import list_checkpoints
from bytecp.demo.launch import JobOutcome, run_job
from bytecp.demo.model import TinyGPT, global_batch, loss_of, say
from bytecp.demo.tables import collect_checkpoints, format_costs, format_losses, job_label
from bytecp.demo.train import EXIT_STOPPED, LR
from bytecp.manager import CheckpointManager

__all__ = ["run_demo", "TOTAL_STEPS", "KILL_AT"]

TOTAL_STEPS, SAVE_EVERY, KILL_AT, SECOND_STOP = 12, 2, 6, 8
_W = "     "  # indent of the demo's explanations


def tell(text: str, head: str = _W) -> None:
    """A paragraph of the story, wrapped: ``head`` (a stage number) on its first line."""
    lines = textwrap.wrap(text, width=96, initial_indent=head, subsequent_indent=_W)
    for line in lines:
        say(line)


def _uninterrupted(steps: int) -> dict[int, float]:
    """The reference: the same model, data and optimizer in one plain process, never stopped."""
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = {}
    for step in range(1, steps + 1):
        loss = loss_of(model, *global_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        out[step] = float(loss.detach())
    return out


class _Story:
    """The stages' shared state: paths, the claims that failed, the stall
    rows collected so far, and the summary written at the end."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.run = os.path.join(out, "run")
        self.work = os.path.join(out, "work")
        self.logs = os.path.join(out, "logs")
        self.problems: list[str] = []
        self.costs: dict[str, dict[str, Any]] = {}
        self.summary: dict[str, Any] = {"out": out, "jobs": {}, "restores": []}

    def expect(self, ok: bool, claim: str) -> bool:
        if not ok:
            self.problems.append(claim)
            tell(f"NOT AS EXPECTED: {claim}")
        return ok

    def job(self, parallel: str, world: int, until: int, *, kill: bool = False, evaluate: bool = False,
            on_kill: Callable[[dict[str, Any]], None] | None = None) -> JobOutcome:
        label = job_label(parallel, world)
        args = ["--checkpoints", self.run, "--until", str(until), "--parallel", parallel,
                "--save-every", str(SAVE_EVERY), "--keep-last", "3", "--record-states"]
        if kill:
            args += ["--die-at-save", str(KILL_AT), "--die-rank", "1"]
        if evaluate:
            args.append("--eval")
        outcome = run_job(label, world, args, self.work, self.logs, kill=kill, on_kill=on_kill)
        self.summary["jobs"][label] = {
            "world": world, "parallel": parallel, "seconds": round(outcome.seconds, 2), "result": outcome.result,
            "exits": [vars(e) for e in outcome.exits], "victim": outcome.victim,
        }
        if outcome.result is None:
            tails = "\n".join(f"--- rank {r} ---\n{outcome.log_tail(r)}" for r in outcome.logs)
            raise SystemExit(f"demo: the {label} job ended without a result; its logs end with:\n{tails}")
        return outcome

    # -- stages ----------------------------------------------------------
    def crash(self) -> JobOutcome:
        tell(f"FSDP2 training on 2 processes, planned for {TOTAL_STEPS} steps. CheckpointManager saves a "
             f"checkpoint every {SAVE_EVERY} steps, lazily, in the background: training pauses only while bytecp "
             "notes what to save; the copy and the write run while the next steps compute. At step "
             f"{KILL_AT} the demo kills rank 1's process (SIGKILL) while it is writing its part of step-{KILL_AT} "
             "(its write is held back a little, as on a slow disk, so that the kill always lands mid-save).",
             "1/6  ")
        o = self.job("fsdp2", 2, TOTAL_STEPS, kill=True, on_kill=lambda v: tell(
            f"the demo killed rank {v['rank']} (pid {v['pid']}) with SIGKILL while step-{KILL_AT} was being "
            "written."))
        victim, exits = o.victim, o.exits
        if not self.expect(victim is not None and exits[1].how == "killed by the demo",
                           "rank 1 was killed during the save"):
            return o
        survivor = exits[0]
        stopped = (o.result or {}).get("stopped") or {}
        by_itself = self.expect(survivor.how == "exited" and survivor.returncode == EXIT_STOPPED,
                                f"rank 0 stopped by itself (it ended: {survivor.how}, status {survivor.returncode})")
        told = self.expect("rank 1" in stopped.get("save_error", ""), "bytecp told rank 0 that rank 1 failed the save")
        if by_itself and told:
            tell(f"rank 0 stopped by itself {survivor.after_failure_s or 0:.1f} s after the kill (exit status "
                 f"{survivor.returncode}): bytecp's error named the lost rank; nothing hung.")
        committed = collect_checkpoints(self.run, self.costs)
        doomed = os.path.join(self.run, f"step-{KILL_AT}")
        left = [os.path.join(d, f) for d, _, fs in os.walk(doomed) for f in fs]
        found = CheckpointManager(self.run).latest()  # what a restart's restore() picks
        latest = found.name if found else None
        self.summary["in_flight"] = {
            "checkpoint": f"step-{KILL_AT}", "committed": f"step-{KILL_AT}" in committed,
            "metadata_json": os.path.exists(os.path.join(doomed, "metadata.json")), "files_left": len(left),
            "committed_after_crash": committed, "latest_after_crash": latest,
        }
        self.expect(f"step-{KILL_AT}" not in committed, f"step-{KILL_AT} is not committed")
        gone = ("rank 0 removed the files it had written for it" if not left
                else f"{len(left)} of its files are left for `bytecp gc`")
        tell(f"on storage: {', '.join(committed)} committed; step-{KILL_AT} has no metadata.json (a checkpoint's "
             f"commit point), so it is not a checkpoint: restore, `bytecp ls` and retention never see it ({gone}).")
        self.costs[f"failed-{KILL_AT}"] = {
            "checkpoint": f"step-{KILL_AT}", "step": KILL_AT, "committed": False, "saved_by": o.label,
            "note": "rank 1 killed while writing: never committed, never loaded",
        }
        return o

    def restart(self, head: str, why: str, n: int, parallel: str, until: int, *, evaluate: bool = False) -> JobOutcome:
        before = [c.name for c in list_checkpoints(self.run)]
        tell(why, head)
        o = self.job(parallel, n, until, evaluate=evaluate)
        res = o.result or {}
        restored = res.get("restored_step")
        name = f"step-{restored}"
        self.summary["restores"].append({"job": o.label, "restored": name,
                                         "latest_committed_before": before[-1] if before else None})
        self.expect(o.clean, f"the {o.label} job ended cleanly")
        self.expect(bool(before) and name == before[-1], f"the {o.label} job restored the latest committed "
                    f"checkpoint ({before[-1] if before else None}), not {name}")
        check = res.get("restore_check") or {}
        self.expect(check.get("tensors", 0) > 0 and not check.get("differ"),
                    f"the {o.label} job's restored state is bitwise the saved one")
        collect_checkpoints(self.run, self.costs)
        return o

    def losses(self, jobs: list[JobOutcome]) -> None:
        reference = _uninterrupted(TOTAL_STEPS)
        trajectory: dict[int, tuple[str, float]] = {}
        for o in jobs:  # later jobs replace the steps a crash undid
            for s, v in (o.result or {}).get("losses", {}).items():
                trajectory[int(s)] = (o.label, v)
        first, second = jobs[0].result or {}, jobs[1].result or {}
        replayed = sorted(int(s) for s in first.get("losses", {}) if s in second.get("losses", {}))
        diff = max(abs(v - reference[s]) for s, (_, v) in trajectory.items())
        self.summary["loss"] = {
            "trajectory": {s: v for s, (_, v) in sorted(trajectory.items())}, "trained_by":
            {s: j for s, (j, _) in sorted(trajectory.items())}, "uninterrupted": reference, "max_abs_diff": diff,
            "replayed": {s: [first["losses"][str(s)], second["losses"][str(s)]] for s in replayed},
        }
        self.expect(sorted(trajectory) == list(range(1, TOTAL_STEPS + 1)), "every step was trained")
        self.expect(diff < 1e-4, f"the loss follows the uninterrupted run (largest difference {diff:.1e})")
        tell(f"The loss continued where it was. Each step's loss, beside the same {TOTAL_STEPS} steps run in one "
             "process without interruption (the differences are rounding: 2 or 3 processes add up gradients in "
             "another order):", "4/6  ")
        for line in format_losses(trajectory, reference):
            print(line)
        if replayed:
            tell(f"steps {replayed[0]}-{replayed[-1]} were trained twice, before the crash and after the restart, "
                 "on the same data: " + ", ".join(f"{first['losses'][str(s)]:.4f} then {second['losses'][str(s)]:.4f}"
                                                  for s in replayed) + ".")

    def costs_table(self) -> None:
        rows = sorted(self.costs.values(), key=lambda r: (r["step"], r["committed"]))
        kept = [c.name for c in list_checkpoints(self.run)]
        self.summary["checkpoints"] = rows
        self.summary["kept"] = kept
        tell("What each checkpoint cost training, from the per-process reports bytecp stores beside it "
             "(reports/<rank>.json). 'Training paused' is all the time the training loop waited for the save "
             "(the lazy copy included); the rest ran in the background:", "5/6  ")
        for line in format_costs(rows):
            print(line)
        tell("A job's first save also sets up the process group bytecp's background saves use (later saves "
             "reuse it). A step of this tiny model takes milliseconds, so the next optimizer step can catch up "
             "with the lazy copy and wait for it ('of which copy'); on a real model the copy runs under forward "
             "and backward (docs/benchmarks.md, 'What a checkpoint costs training': the lazy save blocked FSDP2 "
             "training 11 ms per checkpoint with 0.30 GB per process on 2 ranks).")
        tell(f"kept now (keep_last=3): {', '.join(kept)}; older ones were deleted once newer ones had committed. "
             f"Per-phase detail of one (monitoring extra): bytecp monitor show {self.run}/{kept[-1]}")

    def handoff(self, final: JobOutcome) -> None:
        ckpt = f"{self.run}/step-{TOTAL_STEPS}"
        export_dir = os.path.join(self.out, "export")
        target = export_dir  # the Hugging Face layout: shards + model.safetensors.index.json
        tell("Hand-off to evaluation: export the final checkpoint in the Hugging Face layout (safetensors shards "
             "and their index, cut small here to show the sharding); then an evaluation job (one process, plain "
             "torch + safetensors: no bytecp, no torch.distributed) rebuilds the model and evaluates it.", "6/6  ")
        say(f"{_W}$ bytecp export {ckpt} {target} --max-shard-size 64KB")
        self._tool("export", [sys.executable, "-m", "bytecp.cli", "export", ckpt, target, "--max-shard-size", "64KB"])
        result = os.path.join(self.work, "eval.json")
        say(f"{_W}$ python -m bytecp.demo.evaluate {export_dir}")
        self._tool("eval job", [sys.executable, "-m", "bytecp.demo.evaluate", export_dir, "--json", result])
        with open(result) as f:
            ev = json.load(f)
        trained = (final.result or {}).get("eval_loss")
        self.summary["export"] = {"checkpoint": ckpt, "target": target, "files": ev["files"]}
        self.summary["eval"] = {"training_job": trained, "eval_job": ev["loss"], "equal": trained == ev["loss"],
                                "eval_job_bytecp_modules": ev["bytecp_modules"],
                                "eval_job_distributed": ev["distributed_initialized"]}
        self.expect(trained == ev["loss"], f"the evaluation job's loss {ev['loss']!r} is the training job's {trained!r}")
        self.expect(not ev["distributed_initialized"], "the evaluation job never initialised torch.distributed")
        if trained == ev["loss"]:
            tell(f"the same loss, to the last bit, as the training job printed: {trained!r}")

    def _tool(self, label: str, cmd: list[str]) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        for line in p.stdout.splitlines():
            print(f"  [{label}] {line}", flush=True)
        if p.returncode:
            raise SystemExit(f"demo: {' '.join(cmd[2:])} failed ({p.returncode}):\n{p.stderr[-2000:]}")


def run_demo(out: str) -> int:
    """Every stage, in order (see the module doc); 0 if every claim held."""
    t0 = time.monotonic()
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    torch.set_num_threads(1)
    story = _Story(out)
    tell("A training job's life with bytecp, in six stages. The model: a small GPT-like transformer; the data: "
         "240 sequences, 12 per step over all processes, read by torchdata's StatefulDataLoader with torch's "
         "DistributedSampler (the loader is checkpointed too, and its position reshards with the model). "
         f"Checkpoints go to {story.run}/step-N, each process's log to {story.logs}/.", "")
    first = story.crash()
    second = story.restart("2/6  ", "Only 1 process is available now: the job restarts on 1 process (FSDP2) "
                           f"and trains to step {SECOND_STOP}. CheckpointManager.restore loads the latest committed "
                           "checkpoint, resharding the 2 processes' shards into one.", 1, "fsdp2", SECOND_STOP)
    third = story.restart("3/6  ", "Three processes are free: the job restarts on 3 with DDP (full copies "
                          f"instead of shards) and trains to step {TOTAL_STEPS}.", 3, "ddp", TOTAL_STEPS,
                          evaluate=True)
    story.losses([first, second, third])
    story.costs_table()
    story.handoff(third)
    story.summary["ok"] = not story.problems
    story.summary["problems"] = story.problems
    story.summary["seconds"] = round(time.monotonic() - t0, 1)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(story.summary, f, indent=1)
    if story.problems:
        tell(f"the story did not hold ({len(story.problems)} problem(s)); see {out}/summary.json and {story.logs}/",
             "")
        return 1
    tell(f"done in {story.summary['seconds']:.0f} s; every claim above was checked. Summary: {out}/summary.json",
         "")
    return 0
