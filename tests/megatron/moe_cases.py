"""Functions the Megatron MoE worker pool runs on every rank: a tiny GPTModel
with 4 SequentialMLP experts (top-2) at a given TP x EP x CP, the distributed
optimizer (Megatron chains a dense and an expert optimizer when EP > 1),
training, bytecp save/load, and the full tensors the tests compare bitwise.

Test-process patches beyond ``megatron_cases``: Megatron-Core 0.16.1's MoE
path names ``te_general_gemm`` without TransformerEngine, so it is defined as
None in ``moe_utils`` first.
"""

from __future__ import annotations

import re
from typing import Any

import megatron_cases as mc
import torch
from megatron_cases import _STATE, CpuDeviceMode

import bytecp

HIDDEN = 32
EXPERTS = 4


def setup(tp: int = 1, ep: int = 1, cp: int = 1, seed: int = 1234) -> None:
    """(all ranks) Fresh model-parallel groups of TP x CP x EP on the pool's gloo group."""
    import warnings

    warnings.filterwarnings("ignore", module="megatron.*")
    mc._patch_cuda()
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core import parallel_state, tensor_parallel

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    mc.renew_groups(lambda: parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, context_parallel_size=cp, expert_model_parallel_size=ep))
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
    _STATE.clear()


def build(
    tp: int = 1, ep: int = 1, cp: int = 1, *, seed: int = 1234, dist_opt: bool = True,
    hidden: int = HIDDEN, ffn: int = 64, layers: int = 2, vocab: int = mc.VOCAB, heads: int = 4,
) -> None:
    """(all ranks) The tiny MoE GPT, Megatron DDP and the distributed optimizer;
    the same seed gives the same full weights at every EP size. ``cp`` sizes
    Megatron's context-parallel groups; the layers are built without context
    parallelism (the local spec's attention refuses it without TransformerEngine)."""
    setup(tp, ep, cp, seed)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=ffn,
        use_cpu_initialization=True, pipeline_dtype=torch.float32, hidden_dropout=0.0,
        attention_dropout=0.0, tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep, num_moe_experts=EXPERTS, moe_router_topk=2,
        moe_grouped_gemm=False, sequence_parallel=False, bias_activation_fusion=False,
        add_bias_linear=False,  # the expert bias is added in place on a view at EP=1 (autograd refuses)
    )
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False),
        vocab_size=vocab, max_sequence_length=mc.SEQ, parallel_output=False,
    )
    _STATE["model"] = model
    _STATE["config"] = cfg
    if dist_opt:
        with CpuDeviceMode():
            ddp = DistributedDataParallel(
                cfg, DistributedDataParallelConfig(use_distributed_optimizer=True, bucket_size=None), model
            )
            opt = get_megatron_optimizer(
                OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True, bf16=False, fp16=False),
                [ddp],
            )
        _STATE["ddp"] = ddp
        _STATE["optimizer"] = opt


def train_step(seed: int = 11) -> float:
    """(all ranks) One optimizer step on a fixed batch, the same on every rank.
    At TP > 1 Megatron refuses MoE training without sequence parallelism, so
    the MoE layers run in eval mode there (see the notes)."""
    model = _STATE["model"]
    if _STATE["config"].tensor_model_parallel_size > 1:
        for m in model.modules():
            if type(m).__name__ == "MoELayer":
                m.eval()
    return mc.train_step(seed)


def full_optimizer_state() -> dict[str, torch.Tensor]:
    """(all ranks) ``megatron_cases.full_optimizer_state`` with the chain index
    Megatron puts in front of each optimizer's keys (``chained_1.``) removed:
    the model-space names are the same whichever optimizer holds a parameter."""
    return {re.sub(r"^chained_\d+\.", "", k): v for k, v in mc.full_optimizer_state().items()}


def state(layout: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"model": _STATE["ddp"], "optimizer": _STATE["optimizer"]}
    if layout is not None:
        from bytecp.adapters.megatron import OptimizerLayout

        out["optimizer"] = OptimizerLayout(_STATE["optimizer"], layout)
    return out


def save_reference(
    url: str, tp: int = 1, ep: int = 1, cp: int = 1, steps: int = 2, layout: str | None = None
) -> dict[str, Any]:
    """(all ranks) Build, train ``steps`` steps, save model and optimizer;
    report the full state, then two more steps' losses a resumed run must match."""
    build(tp, ep, cp)
    for s in range(steps):
        train_step(1 + s)
    ref = {"model": mc.full_model_state(), "optim": full_optimizer_state()}
    with CpuDeviceMode():
        bytecp.save(url, state(layout))
    ref["losses"] = [train_step(11), train_step(12)]
    return ref


def load_and_report(
    url: str, tp: int = 1, ep: int = 1, cp: int = 1, layout: str | None = None, **kw: Any
) -> dict[str, Any]:
    """(all ranks) Build with other weights and a fresh optimizer, load
    ``url`` (strict), report the state, then train the same two steps."""
    build(tp, ep, cp, seed=99)
    before = mc.full_model_state()
    with CpuDeviceMode():
        bytecp.load(url, state(layout), **kw)
    out = {"model": mc.full_model_state(), "optim": full_optimizer_state(), "before": before}
    out["losses"] = [train_step(11), train_step(12)]
    return out


def dump(ep: int = 2) -> list[str]:
    """(exploration) One line per sharded entry of this rank."""
    build(1, ep)
    train_step(1)
    return mc.dump_sharded(True)


def save_model_only(url: str, tp: int = 1, ep: int = 1, cp: int = 1) -> dict[str, torch.Tensor]:
    """(all ranks) Build without training or optimizer, save the model; the full tensors."""
    build(tp, ep, cp, dist_opt=False)
    with CpuDeviceMode():
        bytecp.save(url, {"model": _STATE["model"]})
    return mc.full_model_state()


def plan_votes(tp: int = 1, ep: int = 1) -> dict[str, Any]:
    """(all ranks) Build, train a step, and run the first save's plan vote as
    the save pipeline does: whether the coordinator must gather boxes, and
    how many of this rank's boxes carry no replica hint."""
    import torch.distributed as dist
    from bytecp.adapters.megatron import MegatronAdapter

    from bytecp.plan.exchange import decide, holdings, vote_for
    from bytecp.tree.state import flatten_tree

    build(tp, ep)
    train_step(1)
    with CpuDeviceMode():
        flat = flatten_tree(MegatronAdapter().save_tree(state(), None))  # type: ignore[arg-type]
    rank, world = dist.get_rank(), dist.get_world_size()
    plan, fp = holdings(flat, rank, world)
    votes: list[Any] = [None] * world
    dist.all_gather_object(votes, vote_for(plan, fp, None, "s", None))
    return {"coordinated": decide(votes).coordinated, "unhinted": sum(rs is None for rs in plan.sets),
            "boxes": len(plan.items)}


def load_model_only(url: str, tp: int = 1, ep: int = 1) -> dict[str, torch.Tensor]:
    """(all ranks) Build with other weights, no optimizer; load the model (strict); the full tensors."""
    build(tp, ep, seed=99, dist_opt=False)
    with CpuDeviceMode():
        bytecp.load(url, {"model": _STATE["model"]})
    return mc.full_model_state()


def save_with_other_model(url: str) -> str:
    """(all ranks) Save the EP=2 optimizer beside a model it was not built on;
    returns the error bytecp raised (type: message)."""
    build(1, 2)
    opt = _STATE["optimizer"]
    build(1, 2, seed=5, dist_opt=False)
    try:
        with CpuDeviceMode():
            bytecp.save(url, {"model": _STATE["model"], "optimizer": opt})
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"
