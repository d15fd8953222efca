"""Functions the Megatron worker pool runs on every rank for the partial-load
checks (``test_megatron_partial.py``): a tiny bf16 GPTModel (Float16Module)
with Megatron DDP and an optimizer keeping fp32 main (master) parameters
apart from the model's (the distributed optimizer, or
Float16OptimizerWithFloat16Params), loaded with the model but not the
optimizer, then stepped.

The CPU patches and the fixed batches are ``megatron_cases``'s.
"""

from __future__ import annotations

from typing import Any

import megatron_cases as mc
import torch
from megatron_cases import CpuDeviceMode

import bytecp

_STATE = mc._STATE


def build_bf16(seed: int = 1234, dist_opt: bool = True, bf16: bool = True) -> None:
    """(all ranks) TP=1 (DP = world size): GPTModel in bf16 under
    Float16Module and Megatron DDP, with an optimizer holding fp32 mains."""
    mc.setup(1, 1, seed)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    cfg = TransformerConfig(
        num_layers=2, hidden_size=mc.HIDDEN, num_attention_heads=4, ffn_hidden_size=128,
        use_cpu_initialization=True, pipeline_dtype=dtype, params_dtype=dtype, bf16=bf16,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
    )
    model: Any = GPTModel(
        config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=mc.VOCAB,
        max_sequence_length=mc.SEQ, parallel_output=False,
    )
    if bf16:
        model = Float16Module(cfg, model)
    with CpuDeviceMode():
        ddp = DistributedDataParallel(
            cfg, DistributedDataParallelConfig(use_distributed_optimizer=dist_opt, bucket_size=None), model
        )
        opt = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=dist_opt, bf16=bf16,
                            params_dtype=dtype),
            [ddp],
        )
    _STATE.clear()
    _STATE.update(model=model, ddp=ddp, optimizer=opt, config=cfg)


def weights() -> dict[str, torch.Tensor]:
    """(all ranks) The model's parameters (full: TP=1), cloned."""
    return {k: p.detach().clone() for k, p in _STATE["ddp"].module.named_parameters()}


def save_trained(url_full: str, url_model: str) -> dict[str, Any]:
    """(all ranks) Build, train two steps, save model + optimizer to
    ``url_full`` and the model alone to ``url_model``; the weights saved."""
    build_bf16()
    mc.train_step(1)
    mc.train_step(2)
    with CpuDeviceMode():
        bytecp.save(url_full, {"model": _STATE["ddp"], "optimizer": _STATE["optimizer"]})
        bytecp.save(url_model, {"model": _STATE["ddp"]})
    return {"model": weights()}


def load_partial(url: str, case: str, *, dist_opt: bool = True, reload: bool = False) -> dict[str, Any]:
    """(all ranks) A fresh job (other weights, a fresh optimizer) loads the
    model but not the optimizer's state -- ``case``: "exclude" (model and
    optimizer passed, ``exclude=["optimizer"]``), "model_only" (``{"model":
    m}``), "not_saved" (model and optimizer, ``strict=False``, a checkpoint
    without optimizer state) -- then trains one step. ``reload`` calls
    Megatron's own ``reload_model_params()`` after the load, as Megatron's
    loader does when it loads no optimizer (the reference). Reports the
    weights right after the load and after the step."""
    build_bf16(seed=99, dist_opt=dist_opt)
    ddp, opt = _STATE["ddp"], _STATE["optimizer"]
    with CpuDeviceMode():
        if case == "exclude":
            bytecp.load(url, {"model": ddp, "optimizer": opt}, exclude=["optimizer"])
        elif case == "model_only":
            bytecp.load(url, {"model": ddp})
        elif case == "not_saved":
            bytecp.load(url, {"model": ddp, "optimizer": opt}, strict=False)
        else:  # pragma: no cover - a test's typo
            raise ValueError(case)
        if reload:
            opt.reload_model_params()
    loaded = weights()
    mc.train_step(3)
    return {"loaded": loaded, "stepped": weights()}


def load_bare(url: str) -> str:
    """(all ranks) Load into the bare module (no DDP wrapper, no optimizer)
    while a distributed optimizer holds sharded mains of its parameters: the
    error bytecp raised (type: message), or "no error"."""
    build_bf16(seed=99)
    try:
        with CpuDeviceMode():
            bytecp.load(url, {"model": _STATE["model"]})
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def load_dp_reshardable_part(url: str) -> str:
    """(all ranks) Load a ``dp_reshardable`` checkpoint (fp32, distributed
    optimizer) with its flat buffers excluded: the error bytecp raised
    (type: message), or "no error"."""
    from bytecp.adapters.megatron import OptimizerLayout

    mc.build(1, dist_opt=True, seed=99)
    state = {"model": _STATE["ddp"], "optimizer": OptimizerLayout(_STATE["optimizer"], "dp_reshardable")}
    try:
        with CpuDeviceMode():
            bytecp.load(url, state, strict=False, exclude=["optimizer.optimizer.distributed"])
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"
