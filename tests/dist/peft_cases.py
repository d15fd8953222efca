"""LoRA fine-tunes with the real peft on a tiny transformers Llama (built from
a config, no downloads), checkpointed by CheckpointManager's incremental
saves; run in one process and on every gloo rank of FSDP2 x2."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import bytecp

ALIGN = 4096


def llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                       tie_word_embeddings=False)


def base_model(hf_dir: str | None = None) -> Any:
    """The base: from Hugging Face weights at ``hf_dir``, else seeded from the config."""
    from transformers import LlamaForCausalLM

    if hf_dir is not None:
        return LlamaForCausalLM.from_pretrained(hf_dir)
    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config())


def lora(model: Any) -> Any:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                     init_lora_weights=False)  # nonzero B: every adapter changes the output
    return get_peft_model(model, cfg)


def shard(model: Any) -> Any:
    """FSDP2 over every rank: each decoder layer, then the whole model (a peft
    model's or a plain Llama's)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    for layer in inner.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def optimizer(model: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def train(model: Any, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(100 * step + (dist.get_rank() if dist.is_initialized() else 0))
    x = torch.randint(0, 512, (2, 16), generator=g)
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def snapshot(model: Any, opt: torch.optim.Optimizer) -> dict[str, Any]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {"model": {k: full(v) for k, v in model.state_dict().items()},
            "optim": {names[id(p)]: {k: full(v) for k, v in st.items()} for p, st in opt.state.items()}}


def assert_same(got: Any, want: Any, where: str = "state") -> None:
    """Bitwise equal, tensor by tensor (nested dicts of full tensors)."""
    if isinstance(want, dict):
        assert set(got) == set(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    else:
        assert torch.equal(got, want), where


def padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def own_bytes(url: str) -> int:
    md = json.loads((Path(url) / "metadata.json").read_text())
    return sum(n for f, n in md["data_files"].items() if not f.startswith("../"))


def adapter_budget(model: Any, world: int) -> int:
    """The most a save of adapters plus their AdamW state may write: each
    trainable tensor and its two moments (a box per rank, padded to 4 KiB),
    the step counters, and a page of JSON-less objects per rank."""
    per = sum(padded(math.ceil(p.numel() / world) * p.element_size())
              for p in model.parameters() if p.requires_grad)
    steps = sum(1 for p in model.parameters() if p.requires_grad) * ALIGN
    return world * (3 * per + steps + 2 * ALIGN)


def lora_run(run: str, steps: int = 4, sharded: bool = False) -> dict[str, Any]:
    """Fine-tune with LoRA, saving every step through CheckpointManager
    (keep_last=2, incremental); returns what each save wrote, the final
    state (full tensors) and the model's size."""
    model = lora(base_model())
    if sharded:
        shard(model)
    opt = optimizer(model)
    mgr = bytecp.CheckpointManager(run, every_n_steps=1, keep_last=2)
    written = {}
    for step in range(1, steps + 1):
        train(model, opt, step)
        mgr.save(step, {"model": model, "optim": opt})
        written[step] = own_bytes(f"{run}/step-{step}")
    world = dist.get_world_size() if dist.is_initialized() else 1
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # global numel for DTensors
    return {"written": written, "state": snapshot(model, opt), "budget": adapter_budget(model, world),
            "total": total}


def load_newest(run: str, sharded: bool = False) -> dict[str, Any]:
    """A fresh LoRA model (other adapter init) and optimizer restored by the manager."""
    torch.manual_seed(7)
    model = lora(base_model())
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)  # every tensor differs from the saved one until loaded
    if sharded:
        shard(model)
    opt = optimizer(model)
    train(model, opt, 99)  # the optimizer has state to be replaced
    step = bytecp.CheckpointManager(run, every_n_steps=1).restore({"model": model, "optim": opt})
    return {"step": step, "state": snapshot(model, opt)}


def adapter_only(url: str, hf_dir: str, sharded: bool = False) -> dict[str, Any]:
    """Train a LoRA on the base loaded from Hugging Face weights, save only
    the adapters (a dict of tensors, DTensors under FSDP2, outside their
    module), load them onto a fresh copy of that base; logits of both."""
    model = lora(base_model(hf_dir))
    if sharded:
        shard(model)
    opt = optimizer(model)
    train(model, opt, 1)
    md = bytecp.save(url, {"adapter": bytecp.trainable(model)})
    fresh = lora(base_model(hf_dir))
    with torch.no_grad():
        for p in bytecp.trainable(fresh).values():
            p.zero_()
    if sharded:
        shard(fresh)
    bytecp.load(url, {"adapter": bytecp.trainable(fresh)})
    x = torch.arange(32).reshape(2, 16)
    with torch.no_grad():
        want, got = model(input_ids=x).logits, fresh(input_ids=x).logits
    return {"framework": md.framework, "tensors": sorted(md.tensors), "equal": bool(torch.equal(want, got)),
            "adapters": {k: full(v) for k, v in bytecp.trainable(fresh).items()},
            "trained": {k: full(v) for k, v in bytecp.trainable(model).items()}}


def frozen_embedding_run(run: str, steps: int = 3, sharded: bool = False, async_save: bool = False) -> dict[str, Any]:
    """A full fine-tune whose embedding is frozen: the embedding is written once
    (``async_save``: by the manager's asynchronous saves, waited for each step)."""
    model = base_model()
    model.model.embed_tokens.weight.requires_grad_(False)
    if sharded:
        shard(model)
    opt = optimizer(model)
    mgr = bytecp.CheckpointManager(run, every_n_steps=1, keep_last=2, async_save=async_save)
    written = {}
    for step in range(1, steps + 1):
        train(model, opt, step)
        mgr.save(step, {"model": model, "optim": opt})
        mgr.wait()
        written[step] = own_bytes(f"{run}/step-{step}")
    emb = model.model.embed_tokens.weight
    refs = {}
    for step in range(max(2, steps - 1), steps + 1):  # (the older ones are gone: keep_last=2)
        md = json.loads((Path(run) / f"step-{step}" / "metadata.json").read_text())
        refs[step] = sorted(md.get("references", {}))
    return {"refs": refs, "embedding_bytes": emb.numel() * emb.element_size(),
            "written": written,
            "total": sum(p.numel() * p.element_size() for p in model.parameters()),
            "state": snapshot(model, opt)}


def load_frozen_embedding(run: str, sharded: bool = False) -> dict[str, Any]:
    """A fresh full model and optimizer restored from the run's newest checkpoint."""
    torch.manual_seed(9)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(llama_config())
    model.model.embed_tokens.weight.requires_grad_(False)
    if sharded:
        shard(model)
    opt = optimizer(model)
    train(model, opt, 99)
    step = bytecp.CheckpointManager(run, every_n_steps=1).restore({"model": model, "optim": opt})
    return {"step": step, "state": snapshot(model, opt)}
