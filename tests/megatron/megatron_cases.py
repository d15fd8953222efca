"""Functions the Megatron worker pool runs on every rank: set up Megatron-Core
on CPU, build a tiny GPTModel at a given TP/PP (optionally with the
distributed optimizer), train, save and load with bytecp, and report full
tensors the tests compare bitwise.

The CPU patches live here (test processes only, never in the library):
``torch.cuda.current_device``/``synchronize`` point at the CPU, and
:class:`CpuDeviceMode` redirects the ``cuda`` devices Megatron's pipeline
schedule and distributed optimizer ask for.

One pool of ranks serves every check: ``setup(tp, pp)`` tears the previous
model-parallel groups down and builds new ones on the same gloo group.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import bytecp

_STATE: dict[str, Any] = {}
SEQ = 8
BATCH = 2
VOCAB = 128
HIDDEN = 64


def _patch_cuda() -> None:
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]


class CpuDeviceMode(TorchFunctionMode):
    """Megatron asks for ``cuda`` tensors in its schedules and distributed
    optimizer: keep them on the CPU, and answer ``Tensor.type()`` with the cuda
    name the distributed optimizer checks for."""

    @staticmethod
    def _cpu(dev: Any) -> Any:
        if isinstance(dev, torch.device) and dev.type == "cuda":
            return torch.device("cpu")
        if isinstance(dev, str) and dev.startswith("cuda"):
            return "cpu"
        if isinstance(dev, int) and not isinstance(dev, bool):
            return "cpu"
        return dev

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = self._cpu(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1:
            first = args[1]
            if isinstance(first, (torch.device, str, int)) and not isinstance(first, bool):
                args = (args[0], self._cpu(first), *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if "cuda" not in name else name
        return func(*args, **kwargs)


def renew_groups(make: Any) -> None:
    """``make()`` (an ``initialize_model_parallel``), the groups the last one
    made destroyed first (tests/dist/groups.py: a pool's ranks live the whole
    session). Imported here, not at the top: ``benchmarks/load_stress_megatron.py``
    imports this module with ``tests/`` on its path, not the repository."""
    try:
        from tests.dist import groups
    except ImportError:
        from dist import groups  # type: ignore[no-redef]
    groups.renew("megatron", make)


def setup(tp: int, pp: int = 1, seed: int = 1234, vpp: int | None = None) -> None:
    """(all ranks) Fresh model-parallel groups of TP x PP on the pool's gloo group."""
    import warnings

    warnings.filterwarnings("ignore", module="megatron.*")
    _patch_cuda()
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    renew_groups(lambda: parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp))
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
    _STATE.clear()


def build(
    tp: int,
    pp: int = 1,
    *,
    swiglu: bool = False,
    layers: int = 2,
    seed: int = 1234,
    dist_opt: bool = False,
    plain_opt: bool = False,
    vocab: int = VOCAB,
    hidden: int = HIDDEN,
    ffn: int = 128,
    heads: int = 4,
) -> None:
    """(all ranks) A tiny GPTModel (and, with ``dist_opt``, Megatron DDP and the
    distributed optimizer) at TP x PP; the same seed gives the same full weights
    at every TP size."""
    setup(tp, pp, seed)
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=ffn,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        gated_linear_unit=swiglu,
        activation_func=torch.nn.functional.silu if swiglu else torch.nn.functional.gelu,
        bias_activation_fusion=False,
    )
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=vocab,
        max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=False,
    )
    _STATE["model"] = model
    _STATE["config"] = cfg
    if dist_opt or plain_opt:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        with CpuDeviceMode():
            ddp = DistributedDataParallel(
                cfg,
                DistributedDataParallelConfig(use_distributed_optimizer=dist_opt, bucket_size=None),
                model,
            )
            opt = get_megatron_optimizer(
                OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=dist_opt, bf16=False, fp16=False),
                [ddp],
            )
        _STATE["ddp"] = ddp
        _STATE["optimizer"] = opt


def batch(seed: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ).expand(BATCH, 1, SEQ, SEQ)
    return tokens, pos, mask


def forward() -> torch.Tensor | None:
    """(all ranks) Logits of the fixed batch (PP=1 only), on every rank."""
    model = _STATE["model"]
    tokens, pos, mask = batch()
    with torch.no_grad():
        return model(tokens, pos, mask).detach().clone()


def train_step(seed: int = 11) -> float:
    """(all ranks) One optimizer step on a fixed batch (PP=1); returns the loss
    before the step."""
    model = _STATE["model"]
    opt = _STATE["optimizer"]
    ddp = _STATE.get("ddp")
    # the same batch on every data-parallel rank: the averaged gradient is then
    # exactly the single-rank one, so runs at different DP sizes compare
    tokens, pos, mask = batch(seed)
    with CpuDeviceMode():
        if ddp is not None:
            ddp.zero_grad_buffer()
        opt.zero_grad()
        logits = (ddp or model)(tokens, pos, mask)
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1)
        )
        loss.backward()
        if ddp is not None:
            ddp.finish_grad_sync()
        opt.step()
    return float(loss.detach())


def _global_full(sd_keyed: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Gather a ``{key: ShardedTensor}`` description into full tensors on every rank."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out: dict[str, torch.Tensor] = {}
    pieces: list[tuple[str, tuple[int, ...], tuple[int, ...], int, torch.Tensor]] = []
    for st in sd_keyed:
        assert isinstance(st, ShardedTensor)
        pieces.append((st.key, tuple(st.global_shape), tuple(st.global_offset), st.prepend_axis_num, st.data.detach().clone()))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, pieces)
    for rank_pieces in gathered:
        for key, gshape, goff, prepend, data in rank_pieces:
            full = out.setdefault(key, torch.full(gshape, float("nan"), dtype=data.dtype))
            box = data.reshape((1,) * prepend + tuple(data.shape))
            full[tuple(slice(o, o + n) for o, n in zip(goff, box.shape, strict=True))] = box
    return out


def full_model_state() -> dict[str, torch.Tensor]:
    """(all ranks) Every tensor of the model's sharded state dict as a full
    (global) tensor keyed like Megatron's checkpoint keys, assembled from all
    ranks' shards with Megatron's own sharding description (factories built)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    sts: list[Any] = []
    model = _STATE["model"]
    chunks = model if isinstance(model, list) else [model]
    for v in (x for c in chunks for x in nested_values(c.sharded_state_dict())):
        if isinstance(v, ShardedTensorFactory):
            sts += [x for x in nested_values(v.build()) if isinstance(x, ShardedTensor)]
        elif isinstance(v, ShardedTensor):
            sts.append(v)
    return _global_full(sts)


def save(url: str, with_optimizer: bool = False, **kw: Any) -> None:
    state: dict[str, Any] = {"model": _STATE.get("ddp", _STATE["model"])}
    if with_optimizer:
        state["optimizer"] = _STATE["optimizer"]
    with CpuDeviceMode():
        bytecp.save(url, state, **kw)


def load(url: str, with_optimizer: bool = False, **kw: Any) -> None:
    state: dict[str, Any] = {"model": _STATE.get("ddp", _STATE["model"])}
    if with_optimizer:
        state["optimizer"] = _STATE["optimizer"]
    with CpuDeviceMode():
        bytecp.load(url, state, **kw)


def dump_sharded(with_optimizer: bool = False, sharding_type: str = "fully_reshardable") -> list[str]:
    """(exploration) One line per sharded entry of this rank."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    model = _STATE["model"]
    sd = model.sharded_state_dict()
    lines = [f"rank {dist.get_rank()}"]
    if with_optimizer:
        with CpuDeviceMode():
            osd = _STATE["optimizer"].sharded_state_dict(sd, metadata={"distrib_optim_sharding_type": sharding_type})
        vals = list(nested_values(osd))
    else:
        vals = list(nested_values(sd))
    for v in vals:
        d = getattr(v, "data", None)
        lines.append(
            f"{type(v).__name__} {getattr(v, 'key', '')} gs={getattr(v, 'global_shape', '')} "
            f"off={getattr(v, 'global_offset', '')} rep={getattr(v, 'replica_id', '')} "
            f"pre={getattr(v, 'prepend_axis_num', '')} asm={getattr(v, 'allow_shape_mismatch', '')} "
            f"data={type(d).__name__ if not isinstance(d, torch.Tensor) else tuple(d.shape)}"
        )
    return lines


def env_pid() -> int:
    return os.getpid()


def save_reference(url: str, **build_kw: Any) -> dict[str, Any]:
    """(all ranks) Build, save, and report the full tensors and logits saved."""
    build(**build_kw)
    ref = {"model": full_model_state()}
    if build_kw.get("pp", 1) == 1:
        ref["logits"] = forward()
    save(url)
    return ref


def load_and_report(url: str, **build_kw: Any) -> dict[str, Any]:
    """(all ranks) Build with other weights, load ``url`` in place, report."""
    build(**build_kw)
    before = full_model_state()
    load(url)
    out = {"model": full_model_state(), "before": before}
    if build_kw.get("pp", 1) == 1:
        out["logits"] = forward()
    return out


def full_optimizer_state() -> dict[str, torch.Tensor]:
    """(all ranks) The distributed optimizer's state (fp32 main params, Adam
    moments) as full model-space tensors, from Megatron's fully_reshardable
    description gathered over all ranks; plus the step of each param group."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    opt = _STATE["optimizer"]
    with CpuDeviceMode():
        osd = opt.sharded_state_dict(
            _STATE["model"].sharded_state_dict(), metadata={"distrib_optim_sharding_type": "fully_reshardable"}
        )
    sts: list[Any] = []
    for v in nested_values(osd):
        if isinstance(v, ShardedTensorFactory):
            sts += [x for x in nested_values(v.build()) if isinstance(x, ShardedTensor)]
        elif isinstance(v, ShardedTensor):
            sts.append(v)
    out = _global_full(sts)
    steps = {
        float(st["step"])
        for o in getattr(opt, "chained_optimizers", [opt])
        for st in o.optimizer.state.values()
        if "step" in st
    }
    out["__steps__"] = torch.tensor(sorted(steps))
    return out


def save_optimizer_reference(url: str, layout: str | None = None, **build_kw: Any) -> dict[str, Any]:
    """(all ranks) Build with the distributed optimizer, train two steps, save
    model and optimizer, then train two more steps: the losses a resumed run
    must reproduce."""
    vocab_size = build_kw.pop("vocab_size", None)
    build(**{"dist_opt": not build_kw.get("plain_opt"), **build_kw})
    train_step(1)
    train_step(2)
    ref = {"model": full_model_state(), "optim": full_optimizer_state()}
    state: dict[str, Any] = {"model": _STATE["ddp"], "optimizer": _STATE["optimizer"]}
    if vocab_size is not None:
        from bytecp.adapters.megatron import MegatronModel

        state["model"] = MegatronModel(_STATE["ddp"], vocab_size)
    if layout is not None:
        from bytecp.adapters.megatron import OptimizerLayout

        state["optimizer"] = OptimizerLayout(_STATE["optimizer"], layout)
    with CpuDeviceMode():
        bytecp.save(url, state)
    ref["losses"] = [train_step(3), train_step(4)]
    return ref


def load_optimizer_and_report(url: str, layout: str | None = None, **build_kw: Any) -> dict[str, Any]:
    """(all ranks) Build with other weights and a fresh distributed optimizer,
    load ``url``, report the state, then train the same two steps."""
    build(**{"dist_opt": not build_kw.get("plain_opt"), "seed": 99, **build_kw})
    state: dict[str, Any] = {"model": _STATE["ddp"], "optimizer": _STATE["optimizer"]}
    if layout is not None:
        from bytecp.adapters.megatron import OptimizerLayout

        state["optimizer"] = OptimizerLayout(_STATE["optimizer"], layout)
    with CpuDeviceMode():
        bytecp.load(url, state)
    out = {"model": full_model_state(), "optim": full_optimizer_state()}
    out["losses"] = [train_step(3), train_step(4)]
    return out


def save_with_bad_entry(url: str, kind: str) -> str:
    """(all ranks) Save a model whose sharded state dict holds an entry bytecp
    cannot handle; returns the error bytecp raised (type: message)."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedTensorFactory

    model = _STATE["model"]
    real = model.sharded_state_dict

    class CustomSharded(ShardedBase):  # a ShardedBase kind bytecp does not know
        key = "custom.thing"
        data = None
        replica_id = 0

        def validate_metadata_integrity(self) -> None:
            pass

        def without_data(self) -> Any:
            return self

    def broken_build(key: str, data: Any, replica_id: Any, flattened_range: Any) -> Any:
        raise RuntimeError("this factory cannot build")

    def patched(*a: Any, **k: Any) -> Any:
        sd = real(*a, **k)
        if kind == "unknown":
            sd["decoder.custom"] = CustomSharded()
        else:
            sd["decoder.broken"] = ShardedTensorFactory(
                "decoder.broken.weight", torch.zeros(2), broken_build, lambda x: x
            )
        return sd

    model.sharded_state_dict = patched
    try:
        save(url)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        del model.sharded_state_dict
    return "no error"


def save_load_dp_reshardable(url: str) -> dict[str, Any]:
    """(all ranks) Megatron's per-bucket flat layout: save at DP=2, reload at
    DP=2 into a fresh optimizer; full state before and after."""
    ref = save_optimizer_reference(url, layout="dp_reshardable", tp=1)
    got = load_optimizer_and_report(url, layout="dp_reshardable", tp=1)
    return {"ref": ref, "got": got}


def load_padded(url: str, vocab: int) -> dict[str, Any]:
    """(all ranks) Load into a TP=1 model whose vocabulary is padded to
    ``vocab`` rows; report the embedding and output rows before and after."""
    build(1, seed=99, vocab=vocab)
    before = full_model_state()
    load(url)
    return {"before": before, "model": full_model_state()}


def build_vpp(seed: int = 1234) -> None:
    """(all ranks) PP=2 with two virtual pipeline chunks per rank (4 layers:
    rank 0 holds layers 0 and 2, rank 1 layers 1 and 3)."""
    setup(1, 2, seed, vpp=2)
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=4, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=128,
        use_cpu_initialization=True, pipeline_dtype=torch.float32, hidden_dropout=0.0,
        attention_dropout=0.0, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
    )
    chunks = []
    for i in range(2):
        chunks.append(GPTModel(
            config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
            max_sequence_length=SEQ,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=i),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=i),
            parallel_output=False, vp_stage=i,
        ))
    _STATE["model"] = chunks


def save_vpp_reference(url: str) -> dict[str, Any]:
    build_vpp()
    ref = {"model": full_model_state()}
    save(url)
    return ref


def lazy_save_then_step(url: str) -> dict[str, Any]:
    """(all ranks) A lazy asynchronous save of model + distributed optimizer,
    then at once a training step: the step must wait until the state is
    staged, so the checkpoint holds the state before the step."""
    build(1, dist_opt=True)
    train_step(1)
    ref = {"model": full_model_state(), "optim": full_optimizer_state()}
    state: dict[str, Any] = {"model": _STATE["ddp"], "optimizer": _STATE["optimizer"]}
    with CpuDeviceMode():
        handle = bytecp.async_save(url, state, lazy=True)
    train_step(2)
    handle.wait(timeout=120)
    moved = not torch.equal(full_model_state()["output_layer.weight"], ref["model"]["output_layer.weight"])
    got = load_optimizer_and_report(url, tp=2)
    return {"ref": ref, "got": got, "moved": moved}


def _lm_args(url: str, tp: int, consumed: int, kind: str) -> Any:
    """Megatron-LM's own ``args`` (its ``parse_args`` and ``validate_args``,
    tests/megatron/megatron_lm) at TP=``tp``, its data settings as the
    command line would give them: a global batch of 12 on this job's
    data-parallel ranks, ``--dataloader-type kind`` (data sharding its
    default); the counters as a resumed job had them."""
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    from interop.torch_dist_cases import megatron_lm_args

    args = megatron_lm_args(url, tp)
    assert args.dataloader_type == "single" and args.data_sharding and args.consumed_train_samples == 0
    args.micro_batch_size, args.global_batch_size = 12 // args.data_parallel_size, 12
    args.dataloader_type, args.consumed_train_samples, args.consumed_valid_samples = kind, consumed, 4
    return args


def save_lm_data(url: str, tp: int, consumed: int, kind: str) -> None:
    """(all ranks) A Megatron-LM job at TP=``tp`` saves its model and data position."""
    from bytecp.adapters.megatron import MegatronLMData

    build(tp)
    state = {"model": _STATE["model"], "data": MegatronLMData(_lm_args(url, tp, consumed, kind), total_samples=144)}
    with CpuDeviceMode():
        bytecp.save(url, state)


def load_lm_data(url: str, tp: int, kind: str, mode: str = "exact") -> dict[str, Any]:
    """(all ranks) A fresh job at TP=``tp`` loads: its counters after the
    load, or the refusal (then whether the model kept its own weights)."""
    from bytecp.adapters.megatron import MegatronLMData

    build(tp, seed=99)
    before = full_model_state()
    args = _lm_args(url, tp, 0, kind)
    args.consumed_valid_samples = 0
    try:
        with CpuDeviceMode():
            bytecp.load(url, {"model": _STATE["model"], "data": MegatronLMData(args, total_samples=144)},
                        data_reshard=mode)
    except bytecp.BytecpError as e:  # the refusal, as every rank receives it
        after = full_model_state()
        return {"error": str(e), "unchanged": all(torch.equal(before[k], after[k]) for k in before),
                "consumed": args.consumed_train_samples}
    return {"consumed": args.consumed_train_samples, "valid": args.consumed_valid_samples}
