"""Simulated large jobs for the scale benchmark and the simulated-scale tests.

Everything a rank or the coordinator computes is run for real, on shapes of
real models, in one process; what crosses the network is built as the
ranks would build it (votes, chunk batches) and measured by its pickled
size. Nothing here starts a process group.

- :func:`llama7b` -- the 291 weights of a LLaMA-7B-shaped model;
- :func:`fsdp_rank_tree` -- one rank's state under FSDP row sharding (with
  Adam's ``exp_avg``/``exp_avg_sq`` sharded like the weights and ``step``
  replicated on every rank), as the FSDP2 adapter describes it;
- :func:`fsdp_votes` -- every rank's plan vote, synthesized without
  building every rank's plan;
- :func:`fsdp_batches` -- every rank's chunk records after its write, as
  :class:`~bytecp.format.chunk_batch.ChunkBatch` columns (NumPy, no objects);
- :func:`ddp_model` -- a DDP job's tensors (every rank holds them all);
- :func:`deepseek_v3` -- a DeepSeek-V3-shaped mixture of experts (dense
  weights and, per expert, its three weights); :mod:`benchmarks.scale_jobs`
  lays it out under EP and data parallelism.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from bytecp.format.checksum import writer_block_bytes
from bytecp.format.chunk_batch import ChunkBatch, fqn_hash
from bytecp.format.metadata import ALIGNMENT
from bytecp.plan.exchange import PlanVote
from bytecp.tree.regions import Region
from bytecp.tree.skeleton import Node
from bytecp.tree.state import EVERY_RANK, FlatTree, ReplicaSet, Shard, TensorLeaf

__all__ = [
    "llama7b",
    "row_box",
    "fsdp_tensors",
    "fsdp_rank_tree",
    "fsdp_votes",
    "fsdp_batches",
    "ddp_model",
    "deepseek_v3",
]

STATES = ("param", "exp_avg", "exp_avg_sq")


def llama7b(layers: int = 32, hidden: int = 4096, ffn: int = 11008, vocab: int = 32000) -> dict[str, tuple[int, ...]]:
    """Weight name -> shape, LLaMA-7B (6.7e9 parameters) by default."""
    out: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        for w in ("wq", "wk", "wv", "wo"):
            out[f"{p}attention.{w}.weight"] = (hidden, hidden)
        out[f"{p}feed_forward.w1.weight"] = (ffn, hidden)
        out[f"{p}feed_forward.w3.weight"] = (ffn, hidden)
        out[f"{p}feed_forward.w2.weight"] = (hidden, ffn)
        out[f"{p}attention_norm.weight"] = (hidden,)
        out[f"{p}ffn_norm.weight"] = (hidden,)
    out["norm.weight"] = (hidden,)
    out["output.weight"] = (vocab, hidden)
    return out


def row_box(shape: tuple[int, ...], world: int, rank: int) -> Region:
    """Rank ``rank``'s rows of ``shape`` under FSDP's row sharding (torch.chunk sizes; may be empty)."""
    step = -(-shape[0] // world)
    lo = min(rank * step, shape[0])
    hi = min(lo + step, shape[0])
    return Region((lo, *[0] * (len(shape) - 1)), (hi - lo, *shape[1:]))


def fsdp_tensors(model: dict[str, tuple[int, ...]], adam: bool) -> Iterator[tuple[str, tuple[int, ...], bool]]:
    """(fqn, shape, sharded) of every tensor of the saved state."""
    for name, shape in model.items():
        yield f"model.{name}", shape, True
        if adam:
            for st in STATES[1:]:
                yield f"optimizer.state.{name}.{st}", shape, True
            yield f"optimizer.state.{name}.step", (), False


def fsdp_rank_tree(model: dict[str, tuple[int, ...]], world: int, rank: int, *, adam: bool = True) -> FlatTree:
    """One rank's flattened state (zero-strided views: no memory)."""
    mine = ReplicaSet.of((rank,))
    tensors: dict[str, TensorLeaf] = {}
    for fqn, shape, sharded in fsdp_tensors(model, adam):
        if not sharded:
            tensors[fqn] = TensorLeaf.full(torch.zeros(()), EVERY_RANK)
            continue
        box = row_box(shape, world, rank)
        local = torch.zeros(1).expand(box.lengths)
        tensors[fqn] = TensorLeaf(shape, torch.float32, [Shard(box, local)], mine)
    return FlatTree(Node.container("dict", ()), tensors, {}, {}, {})


def _hex(*parts: Any) -> str:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).hexdigest()


def fsdp_votes(model: dict[str, tuple[int, ...]], world: int, *, adam: bool = True,
               cached: str | None = None) -> list[bytes]:
    """Every rank's vote as :func:`bytecp.plan.exchange.ballot` sends it,
    encoded (fingerprints differ per rank; ``step`` tensors form one world set)."""
    every = ReplicaSet.world(world)
    steps = _hex("steps", sorted(model)) if adam else None
    votes = []
    for r in range(world):
        own = sum(4 * row_box(s, world, r).numel * (3 if adam else 1) for s in model.values())
        sets = ((every.key, world, steps),) if steps else ()
        votes.append(PlanVote(_hex("fp", r), cached, _hex("skeleton"), "20261123T000000-00000000" if r == 0 else None,
                              own, sets, False).encode())
    return votes


def fsdp_batches(model: dict[str, tuple[int, ...]], world: int, *, adam: bool = True) -> list[ChunkBatch]:
    """Every rank's chunk records after an FSDP save: its rows of every
    sharded tensor (``step`` tensors written by rank ``i % world``)."""
    rows = [(fqn, shape, sharded) for fqn, shape, sharded in fsdp_tensors(model, adam)]
    hashes = np.asarray([fqn_hash(f) for f, _, _ in rows], np.uint64)
    ndims = np.asarray([len(s) for _, s, _ in rows], np.uint8)
    out = []
    for r in range(world):
        keep: list[int] = []
        offs: list[int] = []
        lens: list[int] = []
        sizes: list[int] = []
        for i, (_, shape, sharded) in enumerate(rows):
            if not sharded:
                if i % world == r:
                    keep.append(i)
                    sizes.append(4)
                continue
            box = row_box(shape, world, r)
            if box.numel:
                keep.append(i)
                offs.extend(box.offsets)
                lens.extend(box.lengths)
                sizes.append(4 * box.numel)
        nb = np.asarray(sizes, np.int64)
        pos = np.concatenate([[0], np.cumsum((nb + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT)])
        block = writer_block_bytes()
        nblocks = np.where(nb > block, -(-nb // block), 0)  # format version 5: one block checksum per block
        out.append(ChunkBatch(
            fqn_hash=hashes[keep], ndim=ndims[keep], offsets=np.asarray(offs, np.int64),
            lengths=np.asarray(lens, np.int64), file=np.zeros(len(keep), np.int32),
            files=[f"data/20261123T000000-00000000/{r}-0.bin"], byte_offset=pos[:-1].astype(np.int64),
            nbytes=nb, crc32c=np.full(len(keep), 1234, np.uint32),
            nblocks=nblocks, blocks=np.full(int(nblocks.sum()), 4321, np.uint32),
        ))
    return out


def specs(model: dict[str, tuple[int, ...]], adam: bool) -> dict[str, dict[str, Any]]:
    return {fqn: {"dtype": "float32", "shape": list(shape)} for fqn, shape, _ in fsdp_tensors(model, adam)}


def data_files(batches: list[ChunkBatch]) -> dict[str, int]:
    out = {}
    for b in batches:
        end = int((b.byte_offset + b.nbytes).max()) if len(b) else 0
        out[b.files[0]] = -(-end // ALIGNMENT) * ALIGNMENT
    return out


def ddp_model(layers: int = 24, hidden: int = 2048, vocab: int = 32000) -> dict[str, tuple[int, ...]]:
    """A 1.3e9-parameter GPT-like model, as DDP holds it on every rank."""
    out: dict[str, tuple[int, ...]] = {"wte.weight": (vocab, hidden), "wpe.weight": (2048, hidden)}
    for i in range(layers):
        out[f"h.{i}.attn.qkv.weight"] = (3 * hidden, hidden)
        out[f"h.{i}.attn.proj.weight"] = (hidden, hidden)
        out[f"h.{i}.mlp.fc.weight"] = (4 * hidden, hidden)
        out[f"h.{i}.mlp.proj.weight"] = (hidden, 4 * hidden)
        for n in ("ln1", "ln2"):
            out[f"h.{i}.{n}.weight"] = (hidden,)
            out[f"h.{i}.{n}.bias"] = (hidden,)
    return out


def nbytes(model: dict[str, tuple[int, ...]]) -> int:
    return 4 * sum(math.prod(s) for s in model.values())


def deepseek_v3(layers: int = 61, dense_layers: int = 3, hidden: int = 7168, experts: int = 256,
                expert_ffn: int = 2048, dense_ffn: int = 18432, vocab: int = 129280, heads: int = 128,
                q_lora: int = 512 * 3, kv_lora: int = 512, nope: int = 128, rope: int = 64, v_dim: int = 128,
                ) -> tuple[dict[str, tuple[int, ...]], list[dict[str, tuple[int, ...]]]]:
    """DeepSeek-V3's weights (6.7e11 parameters by default), Hugging Face
    names: (the dense weights -- MLA attention, the first ``dense_layers``
    layers' FFN, each MoE layer's router and shared expert, embeddings --,
    per routed expert ``e`` its weights in every MoE layer)."""
    dense: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (vocab, hidden)}
    routed: list[dict[str, tuple[int, ...]]] = [{} for _ in range(experts)]
    for i in range(layers):
        p = f"layers.{i}."
        dense |= {
            f"{p}input_layernorm.weight": (hidden,), f"{p}post_attention_layernorm.weight": (hidden,),
            f"{p}self_attn.q_a_proj.weight": (q_lora, hidden), f"{p}self_attn.q_a_layernorm.weight": (q_lora,),
            f"{p}self_attn.q_b_proj.weight": (heads * (nope + rope), q_lora),
            f"{p}self_attn.kv_a_proj_with_mqa.weight": (kv_lora + rope, hidden),
            f"{p}self_attn.kv_a_layernorm.weight": (kv_lora,),
            f"{p}self_attn.kv_b_proj.weight": (heads * (nope + v_dim), kv_lora),
            f"{p}self_attn.o_proj.weight": (hidden, heads * v_dim),
        }
        if i < dense_layers:
            ffn, mlp = dense_ffn, f"{p}mlp."
        else:
            ffn, mlp = expert_ffn, f"{p}mlp.shared_experts."
            dense |= {f"{p}mlp.gate.weight": (experts, hidden), f"{p}mlp.gate.e_score_correction_bias": (experts,)}
            for e in range(experts):
                q = f"{p}mlp.experts.{e}."
                routed[e] |= {f"{q}gate_proj.weight": (expert_ffn, hidden), f"{q}up_proj.weight": (expert_ffn, hidden),
                              f"{q}down_proj.weight": (hidden, expert_ffn)}
        dense |= {f"{mlp}gate_proj.weight": (ffn, hidden), f"{mlp}up_proj.weight": (ffn, hidden),
                  f"{mlp}down_proj.weight": (hidden, ffn)}
    dense |= {"norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    return dense, routed
