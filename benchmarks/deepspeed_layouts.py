"""``python -m benchmarks.deepspeed_layouts``: bytecp against DeepSpeed beyond data
parallelism, in one run: a pipeline (2 stages, ZeRO-1) and AutoTP (tp=2,
ZeRO-1), each saved by both libraries, then moved to one rank.

Phase 1, two gloo ranks (CPU accelerator) per layout: the engine trains one
step; the libraries alternate on a save of the whole engine to durable
commit (``engine.save_checkpoint`` / ``bytecp.save(url, {"model": engine})``,
each one's first save in the process reported apart).

Phase 2, the layout change: one rank, the same model at one stage (the
pipeline) or without TP (AutoTP). DeepSpeed goes through Universal
Checkpointing: the offline ``ds_to_universal`` conversion plus the universal
load; bytecp loads the phase-1 checkpoint directly. (DeepSpeed-MoE at
ep=2 -> 1 is not here: ``ds_to_universal`` fails on it, see docs/deepspeed.md.)

Times are the slowest rank's between barriers, warm page cache, one run.
Prints a Markdown table per layout; ``--out`` writes JSON.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.deepspeed_bench import TAG, _spawn, rank_setup, to_universal
from benchmarks.harness import ratio_table

LAYOUTS = ("pipeline", "autotp")


def _pipe_engine(size: dict[str, Any], stages: int, universal: bool) -> Any:
    import deepspeed
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule
    from torch import nn

    h, n = size["hidden"], size["layers"]
    specs: list[Any] = []
    for _ in range(n):
        specs += [LayerSpec(nn.Linear, h, h), LayerSpec(nn.ReLU)]
    torch.manual_seed(0)
    module = PipelineModule(layers=specs, num_stages=stages, partition_method="uniform",
                            loss_fn=lambda out, _y: out.square().mean())
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "zero_optimization": {"stage": 1}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
           "checkpoint": {"load_universal": universal}}
    engine, *_ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()), config=cfg)
    g = torch.Generator().manual_seed(0)

    def batches() -> Any:
        while True:
            yield torch.randn(2, h, generator=g), torch.zeros(2, h)

    engine.train_batch(batches())
    return engine


def _tp_engine(size: dict[str, Any], tp: int, universal: bool) -> Any:
    import deepspeed
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=size["hidden"], intermediate_size=size["hidden"] * 4, num_hidden_layers=size["layers"],
                         num_attention_heads=8, num_key_value_heads=4, vocab_size=8192)
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
                           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                           "checkpoint": {"load_universal": universal}}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    engine, *_ = deepspeed.initialize(model=LlamaForCausalLM(config), config=cfg)
    ids = torch.randint(0, 8192, (2, 17), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(input_ids=ids[:, :-1], labels=ids[:, 1:]).loss)
    engine.step()
    return engine


def rank_main(rank: int, world: int, port: int, size: dict[str, Any], root: str, phase: int, out: Any) -> None:
    """One rank of one phase of one layout (``size["layout"]``)."""
    results, case = rank_setup(rank, world, port, label=f"{size['layout']}: ")
    import deepspeed
    import torch
    import torch.distributed as dist

    import bytecp

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    r = Path(root)

    try:
        parallel = world if phase == 1 else 1
        make = _pipe_engine if size["layout"] == "pipeline" else _tp_engine
        engine = make(size, parallel, universal=phase == 2)
        nbytes = sum(p.numel() * 12 for p in engine.module.parameters())  # fp32 model + Adam's two fp32 moments
        t = torch.tensor([nbytes])
        dist.all_reduce(t)
        if phase == 1:
            case("DeepSpeed save (first)", lambda: engine.save_checkpoint(str(r / "ds0"), tag=TAG))
            case("bytecp save (first)", lambda: bytecp.save(str(r / "bytecp0"), {"model": engine}))
            case("bytecp save", lambda: bytecp.save(str(r / "bytecp"), {"model": engine}))
            case("DeepSpeed save", lambda: engine.save_checkpoint(str(r / "ds"), tag=TAG))
        else:
            case("DeepSpeed universal load", lambda: engine.load_checkpoint(str(r / "ds"), tag=TAG + "_universal"))
            case("bytecp layout-change load", lambda: bytecp.load(str(r / "bytecp"), {"model": engine}))
        if rank == 0:
            out.put(("ok", int(t), results))
    except BaseException as e:
        out.put(("error", rank, f"{type(e).__name__}: {e}"))
        raise
    finally:
        dist.destroy_process_group()


def run_layout(layout: str, size: dict[str, Any], root: Path, timeout: float) -> dict[str, Any]:
    """Both phases of one layout; the figures and the state's bytes."""
    spec = {**size, "layout": layout}
    nbytes, results = _spawn(2, spec, root, 1, timeout, target=rank_main)
    results["ds_to_universal"] = to_universal(root / "ds" / TAG, root / "ds" / f"{TAG}_universal", timeout)
    _, more = _spawn(1, spec, root, 2, timeout, target=rank_main)
    results.update(more)
    results["DeepSpeed layout change"] = results["ds_to_universal"] + results["DeepSpeed universal load"]
    return {"state_bytes": nbytes, "seconds": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.deepspeed_layouts", description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--dir", default=None, help="folder on the disk under test (default: system temp)")
    p.add_argument("--out", default=None, help="write the JSON results here")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before a phase is abandoned")
    args = p.parse_args(argv)
    size = {"hidden": args.hidden, "layers": args.layers}
    report: dict[str, Any] = {"size": size, "load_average": os.getloadavg()[0]}
    for layout in args.layouts.split(","):
        root = Path(tempfile.mkdtemp(prefix=f"bytecp-ds-{layout}-", dir=args.dir))
        try:
            report[layout] = got = run_layout(layout, size, root, args.timeout)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        change = "2 stages -> 1" if layout == "pipeline" else "tp 2 -> 1"
        print(f"\n{layout} (hidden {args.hidden}, {args.layers} blocks, ZeRO-1 on 2 ranks): "
              f"{got['state_bytes'] / 1e9:.2f} GB of model + Adam state, one run\n")
        ratio_table("DeepSpeed", [
            ("save to durable commit", "bytecp save", "DeepSpeed save"),
            (f"{change} (DeepSpeed: ds_to_universal + universal load)", "bytecp layout-change load",
             "DeepSpeed layout change"),
        ], got["seconds"])
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
