"""The declarative mapping engine (bytecp.interop.mapping) on hand-made tensors."""

from __future__ import annotations

import pytest
import torch

from bytecp.errors import ConfigError, StateMismatchError
from bytecp.interop.mapping import convert_state_dict, split_interleaved_qkv


def fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """Megatron's order: per query group, its query heads, then one key and one value head."""
    per_q = q.shape[0] // groups
    per_kv = k.shape[0] // groups
    parts = []
    for g in range(groups):
        parts += [q[g * per_q : (g + 1) * per_q], k[g * per_kv : (g + 1) * per_kv], v[g * per_kv : (g + 1) * per_kv]]
    return torch.cat(parts)


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (4, 1)])
def test_split_interleaved_qkv_inverts_megatron_order(heads: int, groups: int) -> None:
    hd, hidden = 3, 5
    q = torch.randn(heads * hd, hidden)
    k = torch.randn(groups * hd, hidden)
    v = torch.randn(groups * hd, hidden)
    got = split_interleaved_qkv(fused(q, k, v, groups), heads, groups)
    for want, g in zip((q, k, v), got, strict=True):
        assert torch.equal(want, g)
    bias = split_interleaved_qkv(fused(q[:, 0], k[:, 0], v[:, 0], groups), heads, groups)
    assert torch.equal(bias[0], q[:, 0])


def test_split_refuses_a_shape_that_does_not_divide() -> None:
    with pytest.raises(ConfigError, match="does not split"):
        split_interleaved_qkv(torch.zeros(10, 2), 4, 4)


SPEC = {
    "rules": [
        {"from": "emb", "to": "wte.weight", "rows": "vocab_size"},
        {"from": "layers.w", "to": "h.{layer}.w"},
        {"from": "out", "fallback": "emb", "to": "lm_head.weight", "rows": "vocab_size"},
    ],
    "ignore": ["*_extra_state*"],
}


def test_convert_unstacks_unpads_and_unties() -> None:
    emb = torch.randn(8, 2)
    stacked = torch.randn(3, 2, 2)
    out = convert_state_dict({"emb": emb, "layers.w": stacked, "x._extra_state/shard_0_1": None}, SPEC, vocab_size=6)
    assert sorted(out) == ["h.0.w", "h.1.w", "h.2.w", "lm_head.weight", "wte.weight"]
    assert torch.equal(out["wte.weight"], emb[:6]) and torch.equal(out["lm_head.weight"], emb[:6])
    assert torch.equal(out["h.2.w"], stacked[2])


def test_convert_names_what_it_cannot_map() -> None:
    sd = {"emb": torch.zeros(4, 2), "layers.w": torch.zeros(1, 2), "stray": torch.zeros(1)}
    with pytest.raises(StateMismatchError, match="stray"):
        convert_state_dict(sd, SPEC, vocab_size=4)
    with pytest.raises(StateMismatchError, match="layers.w"):
        convert_state_dict({"emb": torch.zeros(4, 2)}, SPEC, vocab_size=4)
    with pytest.raises(ConfigError, match="vocab_size"):
        convert_state_dict({"emb": torch.zeros(4, 2), "layers.w": torch.zeros(1, 2)}, SPEC)
