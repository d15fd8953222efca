"""A MoE-like GPT: one rank's many small tensors (experts x layers x Adam state).

An expert-parallel rank of a mixture-of-experts model holds tens of
thousands of tensors: every expert of every layer has its own weights, and
Adam keeps three state tensors per parameter (``step``, ``exp_avg``,
``exp_avg_sq``). What a save costs per tensor -- describing the state,
planning it -- dominates such a rank's checkpoint calls, not the bytes.

Each block is attention (``qkv``, ``proj`` with biases, two LayerNorms) and a
top-1 routed MoE of ``experts`` SwiGLU experts (``w1``, ``w2``, ``w3``, no
biases) behind a ``router``; ``config_for_tensors`` sizes the layers so that
parameters plus Adam state come to about the number of tensors asked for.
Used by :mod:`benchmarks.lazy_call` (``--moe N``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MoEConfig", "MoEGPT", "config_for_tensors", "build", "forward_backward", "tensor_count"]

#: tensors of a block outside its experts: ln1 (2), qkv (2), proj (2), ln2 (2), router (1)
_BLOCK_TENSORS = 9
#: outside the blocks: token and position embeddings, final LayerNorm (2), head
_OUTER_TENSORS = 5


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Shape of the model."""

    #: transformer blocks
    layers: int
    #: experts per block
    experts: int
    #: hidden size (a multiple of 16: heads of 16)
    hidden: int = 32
    #: each expert's inner size
    ffn: int = 32
    vocab: int = 512
    seq: int = 64

    @property
    def params(self) -> int:
        """Parameter tensors."""
        return self.layers * (_BLOCK_TENSORS + 3 * self.experts) + _OUTER_TENSORS


def tensor_count(cfg: MoEConfig) -> int:
    """The state's tensors once Adam has stepped: each parameter and its three state tensors."""
    return 4 * cfg.params


def config_for_tensors(n: int, experts: int = 64) -> MoEConfig:
    """The config (``experts`` experts a block) whose state comes closest to ``n`` tensors."""
    per_layer = 4 * (_BLOCK_TENSORS + 3 * experts)
    layers = max(1, round((n - 4 * _OUTER_TENSORS) / per_layer))
    return MoEConfig(layers=layers, experts=experts)


class Expert(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        h = cfg.hidden
        self.heads = max(1, h // 16)
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.router = nn.Linear(h, cfg.experts, bias=False)
        self.experts = nn.ModuleList(Expert(h, cfg.ffn) for _ in range(cfg.experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, -1, 3, h // self.heads).unbind(3)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, -1))
        y = self.ln2(x).reshape(b * t, h)
        gate = F.softmax(self.router(y), dim=-1)
        weight, choice = gate.max(dim=-1)
        out = torch.zeros_like(y)
        for e in choice.unique().tolist():  # top-1: each token through its expert only
            rows = (choice == e).nonzero().squeeze(1)
            out = out.index_add(0, rows, self.experts[e](y[rows]) * weight[rows, None])
        return x + out.view(b, t, h)


class MoEGPT(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq, cfg.hidden)
        self.blocks = nn.ModuleList(MoEBlock(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def forward_backward(model: nn.Module, cfg: MoEConfig, *, seed: int = 0, tokens: int = 32) -> None:
    g = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(cfg.vocab, (1, min(tokens, cfg.seq) + 1), generator=g)
    logits = model(idx[:, :-1])
    F.cross_entropy(logits.reshape(-1, cfg.vocab), idx[:, 1:].reshape(-1)).backward()


def build(cfg: MoEConfig, *, seed: int = 0) -> tuple[MoEGPT, torch.optim.Optimizer]:
    """The model and its Adam optimizer, every parameter's state made (experts a
    step's tokens missed get zero gradients, as a real MoE step leaves them
    once each has been routed to)."""
    torch.manual_seed(seed)
    model = MoEGPT(cfg)
    optim = torch.optim.Adam(model.parameters(), lr=1e-4)
    forward_backward(model, cfg, seed=seed)
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    optim.step()
    optim.zero_grad(set_to_none=True)
    return model, optim
