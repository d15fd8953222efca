"""The Megatron-Core MoE reproduction of the load race (``python -m
benchmarks.load_stress --megatron RUNS``).

A tiny MoE GPT (2 layers, hidden 64, 4 experts, top-2, SwiGLU experts with
expert-TP 2) is trained one step at TP2 x EP2 on 4 gloo ranks with the
distributed optimizer and saved with ``bytecp.save``; then ``--jobs``
processes at a time each load it in one process at TP1 x EP1, twice:
``bytecp.load(url, {"model": model}, strict=False)``, then
``bytecp.load(url, {"model": ddp, "optimizer": optimizer})``, and compare
every parameter and optimizer tensor bitwise with the checkpoint's values
(read on their own beforehand). With fp32 training the distributed
optimizer's main parameters are views of the model's parameters: each such
memory must end up holding the optimizer entry's values (the later entry of
the state), which a TP2 save may record differently from the model's (the
two TP ranks' router replicas drift apart by rounding).

Run as a script (``python benchmarks/load_stress_megatron.py save|load ...``)
it is the worker: ``--python`` picks the interpreter, so a checkout before
the fix (another virtual environment) runs the same scenario; the CPU
patches come from this checkout's ``tests/megatron/megatron_cases.py``.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["main"]

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"


def _paths() -> None:
    for p in (TESTS, TESTS / "megatron"):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))


def _build(tp: int, ep: int, etp: int, seed: int) -> tuple[Any, Any, Any]:
    """(every rank) The MoE GPT of the module docstring, Megatron DDP and the distributed optimizer."""
    import warnings

    import megatron_cases as mc
    import torch
    from megatron_cases import _STATE, CpuDeviceMode

    warnings.filterwarnings("ignore")
    mc._patch_cuda()
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
    _STATE.clear()
    torch.manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, use_cpu_initialization=True,
        pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp, num_moe_experts=4, moe_router_topk=2,
        moe_grouped_gemm=False, sequence_parallel=False, bias_activation_fusion=False, add_bias_linear=False,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False),
                     vocab_size=mc.VOCAB, max_sequence_length=mc.SEQ, parallel_output=False)
    with CpuDeviceMode():
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                         bucket_size=None), model)
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True,
                                                     bf16=False, fp16=False), [ddp])
    _STATE.update(model=model, config=cfg, ddp=ddp, optimizer=opt)
    return model, ddp, opt


def _save_rank(rank: int, port: int, url: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="4")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=4, timeout=datetime.timedelta(seconds=300))
    _paths()
    import megatron_cases as mc

    import bytecp

    model, ddp, opt = _build(2, 2, 2, 1234)
    for m in model.modules():  # Megatron refuses MoE training at TP > 1 without sequence parallelism
        if type(m).__name__ == "MoELayer":
            m.eval()
    mc.train_step(1)
    with mc.CpuDeviceMode():
        bytecp.save(url, {"model": ddp, "optimizer": opt})
    dist.destroy_process_group()


def _checkpoint_values(url: str) -> dict[str, Any]:
    """Every tensor of the checkpoint, read whole on its own (no two targets sharing memory)."""
    import torch

    from bytecp.loading.opened import open_checkpoint
    from bytecp.loading.reader import Target, execute_reads
    from bytecp.plan.load_plan import plan_load
    from bytecp.recorder import Trace
    from bytecp.tree.dtypes import dtype_from_name, itemsize
    from bytecp.tree.regions import Region

    opened = open_checkpoint(url)
    md = opened.metadata
    full = {f: Region((0,) * len(i["shape"]), tuple(i["shape"])) for f, i in md.tensors.items()}
    rows = opened.rows_for({f: [b] for f, b in full.items() if b.numel}).rows
    out = {f: torch.empty(b.lengths, dtype=dtype_from_name(md.tensors[f]["dtype"])) for f, b in full.items()}
    targets = [Target(f, b, out[f]) for f, b in full.items() if b.numel]
    reqs = plan_load([(t.fqn, t.box) for t in targets], rows,
                     itemsizes={t.fqn: itemsize(out[t.fqn].dtype) for t in targets})
    execute_reads(opened.storage, rows, targets, reqs, io_threads=1, verify=True, trace=Trace("load", url))
    return out


def _load_once(url: str) -> dict[str, Any]:
    """(one process) The issue's two loads; every tensor compared with the checkpoint's values."""
    import torch
    import torch.distributed as dist

    _paths()
    from netport import free_port  # tests/ is on the path (_paths)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    import megatron_cases as mc
    import moe_cases as moe

    import bytecp

    want = _checkpoint_values(url)
    model, ddp, opt = _build(1, 1, 1, 99)
    t0 = time.monotonic()
    try:
        with mc.CpuDeviceMode():
            bytecp.load(url, {"model": model}, strict=False)
            bytecp.load(url, {"model": ddp, "optimizer": opt})
    except Exception as e:  # noqa: BLE001 - the outcome is the report
        return {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[-1][:300]}"}
    seconds = time.monotonic() - t0
    wrong = []
    for k, v in mc.full_model_state().items():
        # the model's memory is the optimizer's main parameter (fp32): the later entry's values
        ref = want.get(f"optimizer.optimizer.state.param.{k}", want.get(f"model.{k}"))
        if ref is None or not torch.equal(v.view(torch.uint8), ref.view(torch.uint8)):
            wrong.append(k)
    for k, v in moe.full_optimizer_state().items():
        ref = want.get(f"optimizer.{k}")
        if k != "__steps__" and (ref is None or not torch.equal(v.view(torch.uint8), ref.view(torch.uint8))):
            wrong.append(k)
    dist.destroy_process_group()
    return {"ok": not wrong, "error": f"values differ: {wrong[:4]}" if wrong else "", "seconds": seconds}


def _worker(argv: list[str]) -> int:
    cmd = argv[0]
    if cmd == "save":
        import torch.multiprocessing as tmp

        _paths()
        from netport import free_port  # tests/ is on the path (_paths)

        tmp.spawn(_save_rank, args=(free_port(), argv[1]), nprocs=4)
        return 0
    print(json.dumps(_load_once(argv[1])), flush=True)
    return 0


def _run(python: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen([python, str(Path(__file__).resolve()), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env, cwd=tempfile.gettempdir())


def main(args: Any) -> int:
    """(``load_stress --megatron RUNS``) Save once, then ``args.jobs`` loading processes at a
    time, ``RUNS`` rounds; one JSON summary."""
    with tempfile.TemporaryDirectory(prefix="bytecp-moe-") as tmp:
        url = str(Path(tmp) / "ck")
        save = _run(args.python, "save", url)
        save.communicate(timeout=900)
        if save.returncode:
            raise SystemExit(f"the TP2 x EP2 save failed (exit {save.returncode})")
        runs: list[dict[str, Any]] = []
        for _ in range(args.megatron):
            procs = [_run(args.python, "load", url) for _ in range(args.jobs)]
            for p in procs:
                out, _ = p.communicate(timeout=900)
                lines = (out or "").strip().splitlines()
                runs.append(json.loads(lines[-1]) if lines else {"ok": False, "error": f"exit {p.returncode}"})
    failed = [r for r in runs if not r["ok"]]
    summary = {"python": args.python, "jobs_at_once": args.jobs, "runs": len(runs), "failed": len(failed),
               "errors": sorted({r["error"] for r in failed})[:10]}
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
