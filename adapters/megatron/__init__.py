"""Megatron-Core: tensor, pipeline and data parallelism, and the distributed optimizer.

Input is Megatron's own description of its state: ``model.sharded_state_dict()``
and the optimizer's ``sharded_state_dict(model_sd, metadata=...)``, so any model
Megatron itself can checkpoint works. Each entry maps to the core's tree:

- ``ShardedTensor`` -> a :class:`~bytecp.tree.state.TensorLeaf` keyed by its
  checkpoint key, with one box per local piece: ``global_offset`` and the local
  shape with ``prepend_axis_num`` axes of length 1 (layer-stacked keys); a view
  of the live tensor, never a copy. Replicas (``replica_id`` != 0: DP ranks,
  TP ranks of a replicated layernorm) describe the same box, so the planner
  writes it once and balances the writers over the replicas.
- ``ShardedObject`` -> one object keyed by its ``unique_key`` (``key/shard_...``);
  replicas share the key and are written once.
- ``ShardedTensorFactory`` (gated MLP, fused QKV, ...) -> built on save; on
  load the built pieces are filled and the factory's ``merge_fn`` gives the
  tensor, copied into the live one in place.
- ``LocalNonpersistentObject`` -> not saved; on load the local value is used.
- anything else in the dict (Megatron's "common" state: optimizer param
  groups, the sharding type) -> one object, written by the coordinator, as
  Megatron writes it from rank 0.

Loading fills the live tensors in place (model) or the tensors the optimizer's
``sharded_state_dict(is_loading=True)`` asks for, then hands the optimizer the
state dict Megatron's own loader would (``optimizer.load_state_dict``). A
tensor with ``allow_shape_mismatch`` (padded vocabulary) whose saved first
dimension differs from the target's loads the rows both have; other rows keep
their values.

The distributed optimizer is saved in the ``model_space`` layout by default:
each DP rank writes the flat ranges of the parameters it owns (main params,
Adam moments) as boxes of the model-space tensors
``optimizer.state.<name>.<model key>`` (the core's flat-range decomposition;
factories such as the gated fc1 are followed piece by piece), with no gather
and no full-size copy; a load reads only the ranges each rank owns, straight
into the optimizer's shards. The tensors and keys are those of Megatron's
``fully_reshardable`` layout (which gathers the state over DP first), so a
checkpoint of either loads the other, under any TP, PP and DP. Pass
``OptimizerLayout(opt, "fully_reshardable")`` or ``"dp_reshardable"``
(Megatron's per-bucket flat buffers: DP changes only) to use Megatron's own
producers. The layout is recorded; a load uses the saved one.

Megatron-LM's data position (``args.consumed_train_samples``, which its
samplers read) goes in the state as ``MegatronLMData(args)`` (``data``): it
continues under another data-parallel size, or the load refuses naming the
samples that would repeat or be skipped.

Modules: ``translate`` (sharded state dict <-> tree), ``optimizer_layout``
(the distributed optimizer's layouts and model-space ranges), ``adapter``
(the registry's ``MegatronAdapter``), ``data`` (Megatron-LM's data
position); this package re-exports their public names.

This package imports Megatron only when the state may hold Megatron objects
(``megatron.core`` already imported), so detection costs nothing elsewhere.
"""

from .adapter import MegatronAdapter, MegatronModel
from .data import MegatronLMData
from .optimizer_layout import (
    DEFAULT_OPTIMIZER_LAYOUT,
    LAYOUTS,
    OptimizerLayout,
    flat_range_boxes,
    model_space_leaves,
)
from .optimizer_layout import _Piece as _Piece  # the translate tests build pieces by hand
from .translate import (
    COMMON,
    Translation,
    clip_to_saved,
    rebuild,
    sharded_tensor_region,
    sharded_tensor_view,
    translate,
)
from .translate import _Types as _Types  # the translate tests stand in for Megatron's classes

__all__ = [
    "MegatronAdapter",
    "OptimizerLayout",
    "MegatronModel",
    "MegatronLMData",
    "DEFAULT_OPTIMIZER_LAYOUT",
    "LAYOUTS",
    "COMMON",
    "Translation",
    "translate",
    "sharded_tensor_region",
    "sharded_tensor_view",
    "clip_to_saved",
    "rebuild",
    "flat_range_boxes",
    "model_space_leaves",
]
