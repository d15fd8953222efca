"""The Megatron translation as pure functions, in one process: Megatron's own
ShardedTensor/ShardedObject/factory objects built by hand, turned into the
core's leaves and back (no torch.distributed, no model)."""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed (make test installs it)", allow_module_level=True)

from bytecp.adapters import megatron as mg  # noqa: E402

with warnings.catch_warnings():  # Megatron warns at import that Apex/TE are missing
    warnings.simplefilter("ignore")
    from megatron.core.dist_checkpointing.mapping import (
        LocalNonpersistentObject,
        ShardedBase,
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

from bytecp.errors import ConfigError  # noqa: E402
from bytecp.tree.regions import Region  # noqa: E402
from bytecp.tree.state import Shard, TensorLeaf, Whole  # noqa: E402

TYPES = mg._Types(
    ShardedBase, ShardedTensor, ShardedObject, ShardedTensorFactory, LocalNonpersistentObject,
    type("NoModule", (), {}), type("NoDDP", (), {}), type("NoOptimizer", (), {}),
)


def st(key: str, data: torch.Tensor, gshape: tuple[int, ...], offset: tuple[int, ...], *,
       prepend: int = 0, replica: object = 0, asm: bool = False) -> ShardedTensor:
    frag = tuple(g // n for g, n in zip(gshape, (1,) * prepend + tuple(data.shape), strict=True))
    return ShardedTensor(key, data, data.dtype, tuple(data.shape), gshape, offset, frag,
                         replica_id=replica, prepend_axis_num=prepend, allow_shape_mismatch=asm)


def test_layer_stacked_tensor_is_a_box_with_the_layer_axis() -> None:
    w = torch.arange(12.0).view(3, 4)
    tr = mg.translate({"l1.w": st("layers.w", w, (2, 6, 4), (1, 3, 0), prepend=1)}, TYPES, where="model")
    leaf = tr.tensors["layers.w"]
    assert leaf.global_shape == (2, 6, 4)
    [shard] = leaf.shards
    assert shard.region == Region((1, 3, 0), (1, 3, 4))
    shard.tensor[0, 0, 0] = -1.0  # a view of the live tensor, not a copy
    assert w[0, 0] == -1.0


def test_replicas_and_one_box_held_twice() -> None:
    a = torch.ones(4)
    b = torch.ones(4)
    tr = mg.translate(
        {"x": st("norm", a, (4,), (0,), replica=(0, 1, 0)), "y": st("norm", b, (4,), (0,))},
        TYPES, where="model",
    )
    assert len(tr.tensors["norm"].shards) == 1
    assert len(tr.duplicates) == 1  # b is filled from a on load


def test_objects_factories_local_and_common() -> None:
    full = torch.arange(8.0)

    def build(key: str, data: torch.Tensor, replica_id: object, fr: object) -> dict[str, ShardedTensor]:
        lo, hi = torch.chunk(data, 2)
        return {"lo": st(key, lo, (16,), (0,)), "hi": st(key, hi, (16,), (8,))}

    merged: list[torch.Tensor] = []

    def merge(sub: dict[str, torch.Tensor]) -> torch.Tensor:
        merged.append(torch.cat([sub["lo"], sub["hi"]]))
        return merged[-1]

    sd = {
        "fc1": ShardedTensorFactory("fc1.weight", full, build, merge),
        "extra": ShardedObject("fc1._extra_state", {"a": 1}, (2,), (1,)),
        "local": LocalNonpersistentObject("mine"),
        "groups": [{"lr": 0.1, "betas": (0.9, 0.95)}],
        "kind": "fully_reshardable",
    }
    tr = mg.translate(sd, TYPES, where="optimizer")
    assert sorted(r.region.offsets for r in tr.tensors["fc1.weight"].shards) == [(0,), (8,)]
    assert tr.objects == {"fc1._extra_state/shard_1_2": {"a": 1}}
    assert tr.common == {"groups": [{"lr": 0.1, "betas": (0.9, 0.95)}], "kind": "fully_reshardable"}
    tree = tr.tree(target=False)
    assert isinstance(tree["fc1._extra_state/shard_1_2"], Whole)
    assert isinstance(tree[mg.COMMON], Whole)

    loaded = mg.rebuild(sd, tr, {"fc1._extra_state/shard_1_2": {"a": 2}},
                        {"groups": [{"lr": 0.5, "betas": [0.8, 0.9]}], "kind": "saved"}, TYPES)
    assert torch.equal(loaded["fc1"], full)
    assert loaded["extra"] == {"a": 2}
    assert loaded["local"] == "mine"
    assert loaded["groups"] == [{"lr": 0.5, "betas": [0.8, 0.9]}]
    assert loaded["kind"] == "saved"


def test_unknown_sharded_kind_names_key_and_remedy() -> None:
    class Odd(ShardedBase):
        key = "odd.key"
        data = None
        replica_id = 0

        def validate_metadata_integrity(self) -> None:
            pass

        def without_data(self) -> Odd:
            return self

    with pytest.raises(ConfigError, match=r"decoder\.odd.*Odd.*odd\.key.*ShardedTensorFactory"):
        mg.translate({"decoder": {"odd": Odd()}}, TYPES, where="model")


def test_factory_building_plain_values_is_refused() -> None:
    f = ShardedTensorFactory("k", torch.zeros(2), lambda *a: {"t": 1}, lambda x: x)
    with pytest.raises(ConfigError, match="plain values"):
        mg.translate({"f": f}, TYPES, where="model")


def test_region_outside_global_shape_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="outside its global shape"):
        mg.sharded_tensor_region("k", (4, 4), (2, 0), (4, 4), 0)
    with pytest.raises(ConfigError, match="do not match"):
        mg.sharded_tensor_region("k", (4, 4), (0, 0), (4,), 0)


def test_clip_to_saved_keeps_the_saved_rows() -> None:
    t = torch.zeros(6, 2)
    leaf = TensorLeaf((12, 2), t.dtype, [Shard(Region((6, 0), (6, 2)), t)])
    clipped = mg.clip_to_saved(leaf, (8, 2))
    assert clipped.global_shape == (8, 2)
    [shard] = clipped.shards
    assert shard.region == Region((6, 0), (2, 2))
    shard.tensor.fill_(1.0)
    assert t[:2].eq(1).all() and t[2:].eq(0).all()
    assert mg.clip_to_saved(leaf, (4, 2)).shards == []


def test_optimizer_layout_is_checked() -> None:
    with pytest.raises(ConfigError, match="fully_reshardable"):
        mg.OptimizerLayout(object(), "fully_sharded_model_space")


def test_flat_range_of_a_layer_stacked_tensor_as_global_boxes() -> None:
    # local (3, 4) block of layer 1 at rows 4..7 of a (2, 12, 4) tensor; elements [2, 9)
    boxes = mg.flat_range_boxes((3, 4), (1, 4, 0), 1, 2, 9)
    assert boxes == [
        (Region((1, 4, 2), (1, 1, 2)), 0),
        (Region((1, 5, 0), (1, 1, 4)), 2),
        (Region((1, 6, 0), (1, 1, 1)), 6),
    ]


def test_model_space_leaves_follow_factory_pieces() -> None:
    """A DP rank's flat range of a gated fc1 ([gate_r; up_r] locally) lands in
    both halves of the global tensor, as views of the optimizer's flat shard."""
    pieces = [
        mg._Piece("fc1", (16,), (0,), (4,), 0, 0, 4),
        mg._Piece("fc1", (16,), (8,), (4,), 0, 4, 4),
    ]
    flat = torch.arange(4.0)  # local elements [2, 6)
    leaves: dict[str, TensorLeaf] = {}
    asm: set[str] = set()
    mg.model_space_leaves(pieces, 2, flat, "optimizer.state.exp_avg.", leaves, asm)
    leaf = leaves["optimizer.state.exp_avg.fc1"]
    assert [s.region for s in leaf.shards] == [Region((2,), (2,)), Region((8,), (2,))]
    assert [s.tensor.tolist() for s in leaf.shards] == [[0.0, 1.0], [2.0, 3.0]]
    leaf.shards[1].tensor.fill_(9.0)
    assert flat.tolist() == [0.0, 1.0, 9.0, 9.0]
    assert not asm
