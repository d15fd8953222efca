"""Pieces of a state flattened apart (``prebuild``) and spliced by
``flatten_tree`` give exactly what a walk of the whole state gives: the same
skeleton, names, leaves and aliases, whatever shares memory with what."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from bytecp.errors import ConfigError
from bytecp.tree.state import FlatTree, PerRank, Whole, flatten_tree, prebuild


def same_flat(a: FlatTree, b: FlatTree) -> None:
    assert a.skeleton.to_json() == b.skeleton.to_json()
    assert list(a.tensors) == list(b.tensors)
    for k in a.tensors:
        x, y = a.tensors[k], b.tensors[k]
        assert (x.global_shape, x.dtype, [s.region for s in x.shards]) == (y.global_shape, y.dtype, [s.region for s in y.shards])
        assert all(s.tensor.data_ptr() == t.tensor.data_ptr() for s, t in zip(x.shards, y.shards, strict=True))
    assert a.aliases == b.aliases and list(a.objects) == list(b.objects) and a.per_rank == b.per_rank


def split(tree: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: prebuild(v, k) if k in keys else v for k, v in tree.items()}


def test_pieces_splice_as_the_walk_makes_them() -> None:
    w, v, u = torch.randn(3, 4), torch.randn(5), torch.randn(2)
    tree = {"model": {"w": w, "tied": w, "v": v, "view": w[1]}, "optim": {"state": {"w": {"m": u, "step": 3}},
            "param_groups": Whole([{"lr": 0.1, "params": ["w"]}])}, "extra": {"n": 1, "rng": PerRank([1, 2])}}
    want = flatten_tree(tree)
    got = flatten_tree(split(tree, ("model", "optim")))
    same_flat(got, want)
    assert [p.fqn for p in got.pieces] == ["model", "optim"] and got.loose == []
    assert got.aliases == {"model.tied": "model.w"}


@pytest.mark.parametrize("order", ["piece first", "piece last"])
def test_a_tensor_shared_across_pieces_is_an_alias_as_in_the_walk(order: str) -> None:
    w = torch.randn(4, 4)
    entries = [("model", {"w": w}), ("ema", {"w": w}), ("loose", w)]
    tree = dict(entries if order == "piece first" else entries[::-1])
    want = flatten_tree(tree)
    got = flatten_tree(split(tree, ("model", "ema")))
    same_flat(got, want)
    assert len(got.tensors) == 1 and len(got.aliases) == 2


def test_a_name_two_entries_share_is_refused_as_in_the_walk() -> None:
    tree = {"a": {"b": torch.zeros(1)}, "a.b": torch.ones(1)}
    with pytest.raises(ConfigError, match="same key 'a.b'"):
        flatten_tree(tree)
    with pytest.raises(ConfigError, match="same key 'a.b'"):
        flatten_tree(split(tree, ("a",)))


def test_a_piece_at_another_place_is_walked_there() -> None:
    w = torch.randn(2)
    piece = prebuild({"w": w}, "model")
    got = flatten_tree({"other": piece})
    same_flat(got, flatten_tree({"other": {"w": w}}))
    assert not got.pieces
