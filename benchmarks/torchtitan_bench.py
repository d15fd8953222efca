"""``python -m benchmarks.torchtitan_bench``: the time a checkpoint adds to
torchtitan's training loop, DCP's manager against bytecp's.

One job of 2 gloo processes (CPU) runs torchtitan 0.3.0's own trainer on
the llama3 debug model (FSDP2, float32, 6.6 M parameters: 79 MB of model
and Adam state per checkpoint) several times in turn: without checkpoints,
then with each manager and mode saving every ``--interval`` steps. The
time a checkpoint adds is the loop time of steps 2..N-1 (each step's
``train_step`` plus its ``checkpointer.save``, up to the next step's
start; the synchronous last-step save is outside it) minus the run without
checkpoints, divided by the checkpoints saved. A lazy save's copy overlaps
the next step's forward/backward, so its cost shows in that step, where it
is counted. Rank 0's clock; both ranks run in lockstep. Prints a Markdown
table; ``--out`` writes JSON.

The CPU shims torchtitan's trainer needs here come from
``tests/integrations/titan_shims.py`` (benchmark and test processes only).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from tests.integrations.titan_config import write_assets
from tests.integrations.titan_launch import launch, titan_args

__all__ = ["main", "CASES"]

#: (label, config function, extra CLI args)
CASES: list[tuple[str, str, list[str]]] = [
    ("no checkpoint", "bytecp_debug", ["--checkpoint.no-enable"]),
    ("DCP, synchronous", "dcp_debug", ["--checkpoint.async_mode", "disabled"]),
    ("DCP, async", "dcp_debug", ["--checkpoint.async_mode", "async"]),
    ("bytecp, synchronous", "bytecp_debug", ["--checkpoint.async_mode", "disabled"]),
    ("bytecp, async (eager)", "bytecp_debug", ["--checkpoint.async_mode", "async"]),
    ("bytecp, lazy", "bytecp_debug", ["--checkpoint.async_mode", "lazy"]),
]


def _runs(root: Path, steps: int, interval: int, repeat: int) -> list[dict[str, Any]]:
    runs = []
    for r in range(repeat):
        for i, (_, config, extra) in enumerate(CASES):
            runs.append({"name": f"{i}:{r}", "args": titan_args(
                root / f"run{i}-{r}", "--parallelism.data_parallel_shard_degree", "2",
                "--training.steps", str(steps), "--checkpoint.interval", str(interval),
                "--checkpoint.keep_latest_k", "2", *extra, config=config)})
    return runs


def summarize(results: dict[str, Any], steps: int, interval: int, repeat: int) -> list[dict[str, Any]]:
    saves = len([s for s in range(2, steps) if s % interval == 0])
    loops = {i: [sum(results[f"{i}:{r}"]["loop_s"][1:]) for r in range(repeat)] for i in range(len(CASES))}
    base = statistics.median(loops[0])
    rows = []
    for i, (label, _, _) in enumerate(CASES):
        rec = [results[f"{i}:{r}"] for r in range(repeat)]
        loop = statistics.median(loops[i])
        call = [s for x in rec for s in x["save_s"]]
        rows.append({
            "case": label,
            "loop_s": loop,
            "added_per_checkpoint_s": None if i == 0 else (loop - base) / saves,
            "save_call_s": statistics.median(call) if call else None,
            "step_s": statistics.median([s for x in rec for s in x["step_s"][1:]]),
        })
    return rows


def table(rows: list[dict[str, Any]], steps: int, interval: int) -> str:
    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    out = [f"steps 2..{steps - 1}, a checkpoint every {interval} steps (medians over repeats)", "",
           "| case | loop s | added per checkpoint s | save() call s | train_step s |",
           "| --- | ---: | ---: | ---: | ---: |"]
    out += [f"| {r['case']} | {f(r['loop_s'])} | {f(r['added_per_checkpoint_s'])} | {f(r['save_call_s'])} "
            f"| {f(r['step_s'])} |" for r in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--interval", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="titan-bench-") as tmp:
        root = Path(tmp)
        assets = write_assets(root / "assets")
        results = launch(_runs(root, args.steps, args.interval, args.repeat), 2, root / "jobs", assets,
                         timeout=600 * args.repeat)
    failed = {k: v["error"] for k, v in results.items() if "error" in v}
    if failed:
        raise SystemExit(f"runs failed: {failed}")
    rows = summarize(results, args.steps, args.interval, args.repeat)
    print(table(rows, args.steps, args.interval))
    if args.out:
        Path(args.out).write_text(json.dumps({"steps": args.steps, "interval": args.interval,
                                              "repeat": args.repeat, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
