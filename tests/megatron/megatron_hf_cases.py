"""Functions the Megatron worker pool runs for the Megatron <-> transformers
specs: a tiny GPTModel of each family (GPT-2, Llama, Qwen2, Mixtral) at a
given TP/EP, its logits, a bytecp save carrying its Hugging Face config, and
a load of a checkpoint written from Hugging Face weights."""

from __future__ import annotations

from typing import Any

import torch

import bytecp

HIDDEN = 32
FFN = 64
HEADS = 4
GROUPS = 2
LAYERS = 2
EXPERTS = 4
ROPE_BASE = 10000.0
_STATE: dict[str, Any] = {}


def config(family: str, tp: int = 1, ep: int = 1) -> Any:
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    gpt2 = family == "gpt2"
    kw: dict[str, Any] = {}
    if family == "mixtral":
        # the allgather dispatcher: alltoall asks for CUDA streams
        kw = dict(num_moe_experts=EXPERTS, moe_router_topk=2, expert_model_parallel_size=ep,
                  moe_token_dispatcher_type="allgather")
    return TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
        num_query_groups=HEADS if gpt2 else GROUPS, use_cpu_initialization=True, pipeline_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp, bias_activation_fusion=False,
        normalization="LayerNorm" if gpt2 else "RMSNorm", gated_linear_unit=not gpt2,
        activation_func=F.gelu if gpt2 else F.silu, add_bias_linear=gpt2, add_qkv_bias=family in ("gpt2", "qwen2"),
        **kw,
    )


def build(family: str, tp: int, ep: int = 1, seed: int = 1234) -> None:
    """(all ranks) Fresh TP x EP groups and a GPTModel of ``family``."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron_cases as mc
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    mc._patch_cuda()
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # 0.16.1 without TransformerEngine (see the notes)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    mc.renew_groups(lambda: parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep))
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)
    torch.manual_seed(seed)
    cfg = config(family, tp, ep)
    moe = family == "mixtral"
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS if moe else None, moe_grouped_gemm=False,
                                    normalization=cfg.normalization)
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=mc.VOCAB, max_sequence_length=mc.SEQ,
                     position_embedding_type="learned_absolute" if family == "gpt2" else "rope",
                     rotary_base=int(ROPE_BASE), parallel_output=False, share_embeddings_and_output_weights=False)
    model.eval()
    _STATE.update(model=model, config=cfg)


def forward() -> torch.Tensor:
    import megatron_cases as mc

    tokens, pos, mask = mc.batch()
    with torch.no_grad():
        return _STATE["model"](tokens, pos, mask).detach().clone()


def hf_config(family: str) -> dict[str, Any]:
    import megatron_cases as mc
    from bytecp.adapters.megatron.hf import hf_config as make

    return make(family, _STATE["config"], vocab_size=mc.VOCAB, max_position_embeddings=mc.SEQ, rotary_base=ROPE_BASE)


def save_family(url: str, family: str, tp: int, ep: int = 1) -> dict[str, Any]:
    """(all ranks) Build, save with the Hugging Face config in the metadata, report the logits."""
    build(family, tp, ep)
    cfg = hf_config(family)
    bytecp.save(url, {"model": _STATE["model"]}, metadata={"hf_config": cfg})
    return {"logits": forward(), "hf_config": cfg}


def load_family(url: str, family: str, tp: int, ep: int = 1, strict: bool = True) -> torch.Tensor:
    """(all ranks) Build with other weights, load ``url`` (written from Hugging Face weights), report the logits."""
    build(family, tp, ep, seed=99)
    bytecp.load(url, {"model": _STATE["model"]}, strict=strict)
    return forward()


def load_families(urls: dict[str, str], tp: int, ep: int = 1) -> dict[str, torch.Tensor]:
    return {f: load_family(u, f, tp, ep) for f, u in urls.items()}


def save_families(root: str, families: list[str], tp: int) -> dict[str, Any]:
    return {f: save_family(f"{root}/{f}", f, tp) for f in families}
