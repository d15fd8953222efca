"""``python -m benchmarks.torchtitan_bench``: the time a checkpoint adds to
torchtitan's training loop, DCP's manager against bytecp's.

One job of 2 gloo processes (CPU) runs torchtitan 0.3.0's own trainer on
the llama3 debug model (FSDP2, float32, 6.2 M parameters: 74 MB of model
and Adam state per checkpoint) several times in turn: without checkpoints,
then with each manager and mode saving every ``--interval`` steps. The
time a checkpoint at step k adds is the loop time of steps k and k+1 (each
step's ``train_step`` plus its ``checkpointer.save``, up to the next step's
start) minus two clean steps of the same run: an async or lazy save's copy
and writes overlap step k+1, so its cost is counted there. The synchronous
last-step save is left out, and the run without checkpoints, put through
the same formula, gives the noise floor. Rank 0's clock; both ranks run in
lockstep; cases alternate, ``--repeat`` rounds. Prints a Markdown
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


def _added(loop_s: list[float], steps: int, interval: int) -> tuple[list[float], float]:
    """(the time each checkpoint adds, the clean steps' median) of one run.

    ``loop_s[s - 1]`` is step ``s``'s train_step plus its save, up to the
    next step's start. A checkpoint at step ``k`` costs ``loop(k) + loop(k+1)``
    (a lazy or async save's copy and writes overlap step ``k+1``) minus two
    clean steps of the same run (neither a checkpoint step nor the one after
    it), so drift between runs on a shared machine cancels."""
    def loop(step: int) -> float:
        return loop_s[step - 1]

    saved = [k for k in range(2, steps - 1) if k % interval == 0]
    clean = [s for s in range(2, steps) if s % interval not in (0, 1 % interval)]
    base = statistics.median(loop(s) for s in clean)
    return [loop(k) + loop(k + 1) - 2 * base for k in saved], base


def summarize(results: dict[str, Any], steps: int, interval: int, repeat: int) -> list[dict[str, Any]]:
    rows = []
    for i, (label, _, _) in enumerate(CASES):
        rec = [results[f"{i}:{r}"] for r in range(repeat)]
        added = [_added(x["loop_s"], steps, interval) for x in rec]
        each = [a for run, _ in added for a in run]
        call = [s for x in rec for s in x["save_s"]]
        rows.append({
            "case": label,
            "added_per_checkpoint_s": statistics.median(each),
            "added_quartiles_s": statistics.quantiles(each, n=4)[::2] if len(each) > 1 else None,
            "clean_step_s": statistics.median(b for _, b in added),
            "save_call_s": statistics.median(call) if call else None,
            "checkpoints": len(each) if i else 0,
        })
    return rows


def table(rows: list[dict[str, Any]], steps: int, interval: int) -> str:
    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    def q(v: list[float] | None) -> str:
        return "-" if v is None else f"{v[0]:.3f} .. {v[1]:.3f}"

    out = [f"{steps} steps, a checkpoint every {interval} steps; medians over all checkpoints of all runs "
           "(the first row is the noise floor: the same formula without checkpoints)", "",
           "| case | added per checkpoint s | quartiles s | save() call s | clean step s | checkpoints |",
           "| --- | ---: | ---: | ---: | ---: | ---: |"]
    out += [f"| {r['case']} | {f(r['added_per_checkpoint_s'])} | {q(r['added_quartiles_s'])} "
            f"| {f(r['save_call_s'])} | {f(r['clean_step_s'])} | {r['checkpoints']} |" for r in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--interval", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if args.interval < 3 or args.steps < 2 * args.interval + 2:
        ap.error("--interval must be at least 3 (a clean step between checkpoints) and --steps at least 2 intervals + 2")
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
