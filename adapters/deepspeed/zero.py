"""Where a DeepSpeed ZeRO optimizer keeps each parameter's state on this rank.

ZeRO splits the fp32 master weights and the optimizer state into one flat
partition per rank and per parameter group (a sub-group under ZeRO-3); the
tensors of the wrapped optimizer (``torch.optim.AdamW``: ``exp_avg``,
``exp_avg_sq``) are flat tensors shaped like those partitions. A
:class:`Fragment` says which elements of which parameter a partition holds:

- ZeRO-1/2 (``DeepSpeedZeroOptimizer``, and ``BF16_Optimizer``, which
  DeepSpeed runs for bf16 at stage 0 in a pipeline): the group's parameters are
  concatenated and cut into equal ranges, one per rank; DeepSpeed's own map
  (``param._hp_mapping``) gives each parameter's piece (element ``start`` of
  the parameter at ``offset`` of the partition). Alignment padding between
  parameters and at the end of the last range belongs to no parameter.
- ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``): every parameter is cut on its
  own into ``ceil(numel / dp)`` elements per rank (``param.ds_tensor``), and a
  sub-group's partition is the concatenation of its parameters' pieces
  (``grad_position``). The last rank's piece of a parameter ends in padding
  whose memory is uninitialised: a fragment covers only the real elements
  (``ds_numel``).

A fragment is a flat ``[start, start+numel)`` range of a row-major parameter,
saved as the boxes of the core's flat-range decomposition, so a partition is
saved without any gather and loads from any other layout.

Called by :mod:`.adapter` on every rank, on save and load;
:func:`check_supported` runs first and refuses what this map does not cover.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from bytecp.errors import ConfigError

from .moe import expert_parallel_size
from .pipeline import pipeline_stages, tensor_parallel_size
from .tp import autotp_size

__all__ = ["Fragment", "ZeroLayout", "check_supported", "zero_layout", "is_zero_optimizer", "is_stage3"]


@dataclasses.dataclass(frozen=True)
class Fragment:
    """Elements ``[start, start+numel)`` of parameter ``fqn`` (row-major) are
    elements ``[offset, offset+numel)`` of flat partition ``group``."""

    fqn: str
    shape: tuple[int, ...]
    group: int
    start: int
    numel: int
    offset: int


@dataclasses.dataclass
class ZeroLayout:
    """One ZeRO optimizer's partitions on this rank."""

    stage: int
    #: the fp32 master partition of each (sub-)group: the wrapped optimizer's parameters
    flats: list[torch.Tensor]
    #: the wrapped optimizer's param group of each flat partition
    group_of_flat: list[int]
    #: every trainable parameter (in group order), with an empty fragment where this rank holds none of it
    fragments: list[Fragment]
    #: the FQNs of each param group of the wrapped optimizer
    group_fqns: list[list[str]]
    #: fqn -> the model parameter
    params: dict[str, torch.Tensor]
    #: the wrapped optimizer (``torch.optim.AdamW``, ...) whose parameters are ``flats``
    inner: Any

    def state(self, flat: int) -> dict[str, Any]:
        """The wrapped optimizer's state of flat partition ``flat`` (empty before the first step)."""
        st: dict[str, Any] = self.inner.state.setdefault(self.flats[flat], {})
        return st


#: DeepSpeed's optimizers that partition fp32 masters over the data-parallel ranks; ``BF16_Optimizer``
#: (bf16 at ZeRO stage 0 in a pipeline, or with fp32 gradient accumulation) is laid out as ZeRO-1
_ZERO_OPTIMIZERS = ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3", "BF16_Optimizer")


def is_zero_optimizer(v: Any) -> bool:
    """Whether ``v`` is DeepSpeed's ZeRO-1/2, ZeRO-3 or BF16 optimizer (DeepSpeed already imported)."""
    return type(v).__name__ in _ZERO_OPTIMIZERS and hasattr(v, "optimizer")


def is_stage3(opt: Any) -> bool:
    return type(opt).__name__ == "DeepSpeedZeroOptimizer_Stage3"


def _fail(where: str, what: str, advice: str) -> ConfigError:
    return ConfigError(f"DeepSpeed {where}: {what}, which bytecp cannot checkpoint; {advice}")


def _bad(where: str, fqn: str, group: int, what: str) -> ConfigError:
    return ConfigError(
        f"DeepSpeed {where}: parameter {fqn!r} of param group {group}: {what}, a layout bytecp's ZeRO map "
        "does not describe; save this engine with engine.save_checkpoint and report the DeepSpeed version"
    )


def check_supported(opt: Any, engine: Any, world_size: int, where: str) -> None:
    """(every rank, before anything is read or written) Refuse layouts the
    fragment map does not describe, with one error naming the setting. The
    settings are the same on every rank, so every rank raises alike."""
    pipeline = engine is not None and type(engine).__name__ == "PipelineEngine"
    tp = 1
    if engine is not None:
        tp = tensor_parallel_size(engine)
        if tp > 1 and autotp_size(engine) != tp:  # AutoTP describes its shards; a Megatron mpu does not here
            raise _fail(where, f"runs with tensor parallelism (tensor-parallel size {tp}) outside AutoTP",
                        "bytecp's DeepSpeed adapter handles data, pipeline and AutoTP tensor parallelism")
    if getattr(opt, "swap_optimizer", False) or getattr(opt, "swap_param", False):
        raise _fail(where, "offloads to NVMe (\"offload_optimizer\"/\"offload_param\": {\"device\": \"nvme\"})",
                    "offload to \"cpu\" (supported) or not at all, or use engine.save_checkpoint")
    if type(opt).__name__.startswith("MiCS"):
        raise _fail(where, "uses MiCS sharding", "use ZeRO stage 3 without MiCS")
    groups = getattr(opt, "real_dp_process_group", None) or [getattr(opt, "dp_process_group", None)]
    stages = pipeline_stages(engine) if pipeline else 1
    param_groups = getattr(getattr(opt, "optimizer", None), "param_groups", [])
    for i, g in enumerate(groups):
        size = torch.distributed.get_world_size(group=g) if torch.distributed.is_initialized() else 1
        # a pipeline stage's parameters are partitioned over its data-parallel group, a
        # DeepSpeed-MoE layer's experts over their expert-data-parallel group
        experts = expert_parallel_size(param_groups[i]) if i < len(param_groups) else 1
        if size * stages * experts * tp != world_size:
            raise _fail(where, f"partitions param group {i} over {size} ranks while the checkpoint's "
                        f"process group has {world_size} (expert or sub-group partitioning)",
                        "save with the data-parallel group as the checkpoint's process group")


def _dp_rank(opt: Any) -> int:
    g = getattr(opt, "dp_process_group", None)
    return torch.distributed.get_rank(group=g) if torch.distributed.is_initialized() else 0


def zero_layout(opt: Any, names: dict[int, str], where: str) -> ZeroLayout:
    """(every rank, no communication) The fragments of every trainable
    parameter of ``opt``; ``names`` maps ``id(param)`` to its FQN."""

    def name(p: torch.Tensor) -> str:
        n = names.get(id(p))
        if n is None:
            raise ConfigError(
                f"DeepSpeed {where}: a parameter of the ZeRO optimizer (shape "
                f"{list(getattr(p, 'ds_shape', p.shape))}) belongs to no module of the state; pass the "
                "engine (or its module) with the optimizer"
            )
        return n

    inner = opt.optimizer
    frags: list[Fragment] = []
    params: dict[str, torch.Tensor] = {}
    if is_stage3(opt):
        rank = _dp_rank(opt)
        flats = list(opt.fp32_partitioned_groups_flat)
        group_of_flat = [int(opt.sub_group_to_group_id[i]) for i in range(len(flats))]
        group_fqns: list[list[str]] = [[] for _ in inner.param_groups]
        for i, group in enumerate(opt.fp16_groups):
            for p in group:
                fqn = name(p)
                params[fqn] = p
                gi, offset, n = (int(x) for x in opt.grad_position[opt.get_param_id(p)])
                if p.ds_tensor.numel() != n or offset + n > flats[gi].numel():
                    raise _bad(where, fqn, group_of_flat[i], f"its ZeRO-3 piece ({p.ds_tensor.numel()} elements) "
                               f"is not elements [{offset}, {offset + n}) of the flat partition of "
                               f"{flats[gi].numel()}")
                start = rank * n
                valid = max(0, min(n, int(p.ds_numel) - start))
                frags.append(Fragment(fqn, tuple(p.ds_shape), gi, start, valid, offset))
                group_fqns[group_of_flat[i]].append(fqn)
        return ZeroLayout(3, flats, group_of_flat, frags, group_fqns, params, inner)
    bf16 = type(opt).__name__ == "BF16_Optimizer"  # ZeRO-1's layout under other attribute names
    flats = list(opt.fp32_groups_flat_partition if bf16 else opt.single_partition_of_fp32_groups)
    group_fqns = []
    for i, group in enumerate(opt.bf16_groups if bf16 else opt.bit16_groups):
        group_fqns.append([])
        for p in group:
            fqn = name(p)
            params[fqn] = p
            m = getattr(p, "_hp_mapping", None)
            if m is None:
                frags.append(Fragment(fqn, tuple(p.shape), i, 0, 0, 0))
            else:
                f = Fragment(fqn, tuple(p.shape), i, int(m.lp_fragment_address.start),
                             int(m.lp_fragment_address.numel), int(m.hp_fragment_address.start))
                if f.start + f.numel > p.numel() or f.offset + f.numel > flats[i].numel():
                    raise _bad(where, fqn, i, f"DeepSpeed maps its elements [{f.start}, {f.start + f.numel}) "
                               f"to [{f.offset}, {f.offset + f.numel}) of a flat partition of {flats[i].numel()}")
                frags.append(f)
            group_fqns[i].append(fqn)
    stage = 2 if getattr(opt, "partition_gradients", False) else 1
    return ZeroLayout(stage, flats, list(range(len(flats))), frags, group_fqns, params, inner)
