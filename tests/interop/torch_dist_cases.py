"""Functions the Megatron worker pool runs on every rank for the torch_dist
source tests: a tiny GPT (``tests/megatron/megatron_cases``) saved by
Megatron-Core's own ``dist_checkpointing.save`` with the torch_dist
strategy, laid out as Megatron-LM lays out a run (``iter_0000100/`` and
``latest_checkpointed_iteration.txt``; the state dict of Megatron-LM's
``generate_state_dict``: ``model``, ``optimizer``, ``iteration``, ``args``,
``rng_state``), then loaded by bytecp at another layout.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "megatron"))

import megatron_cases as mc  # noqa: E402
from megatron_cases import _STATE, CpuDeviceMode  # noqa: E402

import bytecp  # noqa: E402

ITERATION = 100
FOLDER = f"iter_{ITERATION:07d}"


def megatron_save(run: str, *, optimizer: str | None = "fully_reshardable", **build_kw: Any) -> dict[str, Any]:
    """(all ranks) Build (and train two steps with the distributed optimizer),
    save with ``dist_checkpointing.save`` (torch_dist) into ``run/iter_0000100``
    as Megatron-LM does; report the full tensors saved."""
    mc.build(**{"dist_opt": optimizer is not None, **build_kw})
    if optimizer is not None:
        mc.train_step(1)
        mc.train_step(2)
    ref: dict[str, Any] = {"model": mc.full_model_state()}
    if optimizer is not None:
        ref["optim"] = mc.full_optimizer_state()
    _write(run, optimizer, build_kw.get("tp", 1))
    return ref


#: Megatron-LM's ``megatron.training`` (tests/megatron/megatron_lm: its own arguments.py and checkpointing.py)
MEGATRON_LM = str(Path(__file__).resolve().parents[1] / "megatron" / "megatron_lm")
LM_ITERATION = 10


def _pretrain_gpt_argv(run: str, tp: int, layout: str | None, ep: int) -> list[str]:
    """``pretrain_gpt.py``'s command line for the tiny GPT of megatron_cases (its sizes, TP,
    the distributed optimizer saved as ``layout``, ``ep`` expert groups of the MoE GPT),
    torch_dist checkpoints in ``run``."""
    argv = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", str(mc.HIDDEN), "--ffn-hidden-size", "128",
            "--num-attention-heads", "4", "--seq-length", str(mc.SEQ), "--max-position-embeddings", str(mc.SEQ),
            "--micro-batch-size", str(mc.BATCH), "--global-batch-size", str(mc.BATCH), "--lr", "0.01",
            "--train-iters", "20", "--tensor-model-parallel-size", str(tp), "--transformer-impl", "local",
            "--use-cpu-initialization", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
            "--no-bias-gelu-fusion", "--seed", "1234", "--tokenizer-type", "NullTokenizer", "--vocab-size",
            str(mc.VOCAB - 1), "--make-vocab-size-divisible-by", str(mc.VOCAB // tp),
            "--no-gradient-accumulation-fusion", "--save", run, "--load", run, "--save-interval", "10",
            "--ckpt-format", "torch_dist"]
    if layout is not None:
        argv.append("--use-distributed-optimizer")
    if layout == "fully_reshardable":
        argv.append("--dist-ckpt-optim-fully-reshardable")
    if ep > 1:
        argv += ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", str(ep)]
    return argv


def megatron_lm_args(run: str, tp: int = 1, layout: str | None = "fully_reshardable", ep: int = 1) -> Any:
    """(all ranks) Megatron-LM's ``args``: its own ``parse_args`` and
    ``validate_args`` of pretrain_gpt.py's command line and defaults, set as
    its global args, the model type as ``get_model`` sets it."""
    import types

    if MEGATRON_LM not in sys.path:
        sys.path.insert(0, MEGATRON_LM)
    # what a test process patches (tests only): the GPU Megatron-LM's argument
    # checks ask about (a Hopper), and the CUDA generator state it saves (16 bytes, as CUDA's philox)
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(major=9, minor=0)  # type: ignore[assignment]
    torch.cuda.get_rng_state = lambda *a, **k: torch.arange(16, dtype=torch.uint8)  # type: ignore[assignment]
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    from megatron.core.enums import ModelType
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_args

    argv, sys.argv = sys.argv, _pretrain_gpt_argv(run, tp, layout, ep)
    try:
        args = parse_args()
    finally:
        sys.argv = argv
    validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})  # pretrain_gpt.py's args_defaults
    args.padded_vocab_size = mc.VOCAB  # (build_tokenizer: NullTokenizer's vocab + 1, padded to a multiple of TP)
    args.model_type = ModelType.encoder_or_decoder  # (training.get_model)
    set_args(args)
    return args


def megatron_lm_save(run: str, tp: int = 2) -> dict[str, Any]:
    """(all ranks) Megatron-LM's own save path: ``args`` from its ``parse_args``
    and ``validate_args`` (pretrain_gpt.py's command line and defaults), the
    tiny GPT and distributed optimizer trained two steps, its
    ``OptimizerParamScheduler``, then its ``save_checkpoint`` (torch_dist):
    ``run/iter_0000010`` and ``latest_checkpointed_iteration.txt``. Reports
    the full tensors saved and this rank's RNG states as ``save_checkpoint``
    gathered them (``get_rng_state``)."""
    import numpy as np
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    args = megatron_lm_args(run, tp)  # (puts Megatron-LM's megatron.training on the path)
    from megatron.training import checkpointing
    mc.build(tp, dist_opt=True)
    import dataclasses

    from megatron.core.optimizer import (
        AdamOptimizerConfig,
        get_megatron_optimizer,
        get_standard_config_overrides,
    )

    # the optimizer as training.setup_model_and_optimizer builds it (get_megatron_optimizer_config(args))
    config = AdamOptimizerConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(AdamOptimizerConfig)
                                    if hasattr(args, f.name)})
    with CpuDeviceMode():
        _STATE["optimizer"] = get_megatron_optimizer(config, [_STATE["ddp"]],
                                                     config_overrides=get_standard_config_overrides(config=config),
                                                     use_gloo_process_groups=args.enable_gloo_process_groups)
    mc.train_step(1)
    mc.train_step(2)
    ref: dict[str, Any] = {"model": mc.full_model_state(), "optim": mc.full_optimizer_state()}
    opt = _STATE["optimizer"]
    scheduler = OptimizerParamScheduler(  # as training.get_optimizer_param_scheduler builds it from args
        opt, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=0,
        lr_decay_steps=args.train_iters * args.global_batch_size, lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay, end_wd=args.end_weight_decay,
        wd_incr_steps=args.train_iters * args.global_batch_size, wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler)
    ref["rng"] = {"random": random.getstate(), "np": np.random.get_state(), "torch": torch.get_rng_state()}
    model = _STATE["model"]  # this rank's TP shards, as they are
    ref["shards"] = {"embedding": model.embedding.word_embeddings.weight.detach().clone(),
                     "proj": torch.stack([layer.self_attention.linear_proj.weight.detach().clone()
                                          for layer in model.decoder.layers])}
    config = mp.current_process()._config  # type: ignore[attr-defined]  # (see _write)
    daemon = config.pop("daemon", None)
    try:
        with CpuDeviceMode():
            checkpointing.save_checkpoint(LM_ITERATION, [_STATE["ddp"]], opt, scheduler,
                                          num_floating_point_operations_so_far=1234)
    finally:
        if daemon is not None:
            config["daemon"] = daemon
    ref["args"] = {k: v for k, v in vars(args).items()}
    return ref


def megatron_save_moe(run: str, ep: int = 2) -> dict[str, Any]:
    """(all ranks) The MoE GPT (4 experts, top-2) at EP=``ep`` with the
    distributed optimizer (a chain: dense and expert), two steps, saved as
    :func:`megatron_save` saves."""
    import moe_cases

    moe_cases.build(1, ep)
    moe_cases.train_step(1)
    moe_cases.train_step(2)
    ref = {"model": mc.full_model_state(), "optim": moe_cases.full_optimizer_state()}
    _write(run, "fully_reshardable", 1, ep)
    return ref


def bytecp_load_moe(url: str, ep: int, optimizer: bool) -> dict[str, Any]:
    """(all ranks) The MoE GPT at EP=``ep`` with other weights, loaded from ``url``."""
    import moe_cases

    moe_cases.build(1, ep, seed=99, dist_opt=optimizer)
    before = mc.full_model_state()
    state: dict[str, Any] = {"model": _STATE.get("ddp", _STATE["model"]), "iteration": 0}
    if optimizer:
        state["optimizer"] = _STATE["optimizer"]
    with CpuDeviceMode():
        res = bytecp.load(url, state, strict=False)
    out: dict[str, Any] = {"before": before, "model": mc.full_model_state(), "iteration": state["iteration"],
                           "missing": list(res.missing_keys), "unexpected": list(res.unexpected_keys)}
    if optimizer:
        out["optim"] = moe_cases.full_optimizer_state()
    return out


def _write(run: str, optimizer: str | None, tp: int, ep: int = 1) -> None:
    """(all ranks) Megatron-LM's state dict of the built model (and optimizer):
    its real ``args`` and RNG state (:func:`megatron_lm_args`, its
    ``get_rng_state``), saved by ``dist_checkpointing.save`` (torch_dist) into
    ``run/iter_0000100`` (at another layout than its ``save_checkpoint`` writes:
    the optimizer layouts and the MoE chain these tests read)."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    args = megatron_lm_args(run, tp, optimizer, ep)
    from megatron.training.checkpointing import get_rng_state

    model_sd = _STATE["model"].sharded_state_dict()
    sd: dict[str, Any] = {  # generate_state_dict's entries, args and rng_state as Megatron-LM gathers them
        "args": args, "checkpoint_version": 3.0, "iteration": ITERATION, "model": model_sd,
        "rng_state": get_rng_state("torch_dist", ps.get_tensor_model_parallel_group(),
                                   ps.get_pipeline_model_parallel_group()),
        "num_floating_point_operations_so_far": 0,
    }
    if optimizer is not None:
        with CpuDeviceMode():
            sd["optimizer"] = _STATE["optimizer"].sharded_state_dict(
                model_sd, metadata={"distrib_optim_sharding_type": optimizer})
    folder = os.path.join(run, FOLDER)
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
    dist.barrier()
    # Megatron's writer starts helper processes, which a daemonic pool worker
    # may not: the pool's workers pass for ordinary processes while it saves
    config = mp.current_process()._config  # type: ignore[attr-defined]
    daemon = config.pop("daemon", None)
    try:
        with CpuDeviceMode():
            dist_checkpointing.save(sd, folder, ("torch_dist", 1),
                                    content_metadata={"distrib_optim_sharding_type": optimizer} if optimizer else None)
    finally:
        if daemon is not None:
            config["daemon"] = daemon
    dist.barrier()
    if dist.get_rank() == 0:
        Path(run, "latest_checkpointed_iteration.txt").write_text(str(ITERATION))


def bytecp_load(url: str, *, optimizer: bool = False, **build_kw: Any) -> dict[str, Any]:
    """(all ranks) Build with other weights (and a fresh distributed
    optimizer), load ``url`` with bytecp, report the full tensors."""
    mc.build(**{"dist_opt": optimizer, "seed": 99, **build_kw})
    before = mc.full_model_state()
    state: dict[str, Any] = {"model": _STATE.get("ddp", _STATE["model"]), "iteration": 0}
    if optimizer:
        state["optimizer"] = _STATE["optimizer"]
    with CpuDeviceMode():  # Megatron-LM's other values (args, rng_state) are not asked for
        res = bytecp.load(url, state, strict=False)
    out: dict[str, Any] = {"before": before, "model": mc.full_model_state(), "iteration": state["iteration"],
                           "missing": list(res.missing_keys), "unexpected": list(res.unexpected_keys)}
    if optimizer:
        out["optim"] = mc.full_optimizer_state()
    return out


def bytecp_save(url: str, *, optimizer: bool = False, **build_kw: Any) -> None:
    """(all ranks, exploration) bytecp's own save of the same model."""
    mc.build(**{"dist_opt": optimizer, **build_kw})
    state: dict[str, Any] = {"model": _STATE.get("ddp", _STATE["model"])}
    if optimizer:
        mc.train_step(1)
        state["optimizer"] = _STATE["optimizer"]
    with CpuDeviceMode():
        bytecp.save(url, state)


def timed_loads(url: str, repeat: int = 3, **build_kw: Any) -> dict[str, list[float]]:
    """(all ranks) Seconds per load of ``url`` into the model: bytecp, then
    ``dist_checkpointing.load`` (torch_dist), each ``repeat`` times."""
    from megatron.core import dist_checkpointing

    mc.build(**{"seed": 99, **build_kw})
    model = _STATE["model"]
    out: dict[str, list[float]] = {"bytecp": [], "megatron": []}
    for _ in range(repeat):
        dist.barrier()
        t = time.perf_counter()
        bytecp.load(url, {"model": model})
        dist.barrier()
        out["bytecp"].append(time.perf_counter() - t)
    for _ in range(repeat):
        dist.barrier()
        t = time.perf_counter()
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, url)
        model.load_state_dict(loaded["model"], strict=False)
        dist.barrier()
        out["megatron"].append(time.perf_counter() - t)
    return out


#: an evaluation process: ``load_state_dict`` of a run folder, then ``bytecp inspect`` and
#: ``bytecp verify`` on it; argv: run, output file, "with" (import Megatron-Core first) or "without"
EVAL_PROCESS = """
import sys, torch
if sys.argv[3] == "with":
    import megatron.core  # registers numpy and its classes with torch's safe globals, for the whole process
import bytecp
from bytecp.cli import main
run, out = sys.argv[1:3]
sd = bytecp.load_state_dict(run)
left_out = sorted(bytecp.load_state_dict(run, exclude=["rng_state", "model", "optimizer"]))
codes = [main(["inspect", run]), main(["verify", run])]
torch.save({"sd": sd, "left_out": left_out, "codes": codes,
            "megatron": sorted(m for m in sys.modules if m.split(".")[0] == "megatron")}, out)
"""
