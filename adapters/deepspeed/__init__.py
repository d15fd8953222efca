"""DeepSpeed engines (``deepspeed.initialize``): ZeRO stages 0-3, pipelines, MoE, online,
in the names every other adapter uses.

``bytecp.save(url, {"model": engine})`` saves the whole engine, as
``engine.save_checkpoint`` does: its module under ``model.<fqn>``, its
optimizer under ``optimizer`` (the same as ``{"model": engine, "optimizer":
engine.optimizer}``) and its own state under ``engine``
(:class:`.engine.EngineState`: ``global_steps``, ``global_samples``,
``skipped_steps``, the LR scheduler, the data sampler, the loss scaler);
``bytecp.load`` restores all of it, less what ``exclude=`` names
(``["engine.lr_scheduler"]``, ``["optimizer"]``, ...). The module and
optimizer are the ones a plain, DDP or FSDP2 job saves, so they load there
(``exclude=["engine"]``: no such job has an engine) and any ZeRO stage at any
data-parallel size loads them back, with no conversion step:

- model: ZeRO-1/2 keep the full module on every rank (written once, split
  across the replicas); ZeRO-3 keeps ``ceil(numel / dp)`` elements of each
  parameter per rank (``param.ds_tensor``), saved as the flat range's boxes
  without the padding at the end of the last piece.
- optimizer: ``optimizer.state.<fqn>.<key>`` for every tensor of the wrapped
  optimizer shaped like the flat partition (``exp_avg``, ``exp_avg_sq``),
  each rank writing the boxes of its fragments (:mod:`._zero`); per-group
  values (``step``) under every parameter of the group, as ``torch.optim``
  keeps them; ``optimizer.param_groups`` with parameters named by FQN. The
  fp32 master weights equal the module's parameters when the model is fp32
  and are not stored twice; under bf16 they are ``optimizer.state.<fqn>.fp32``.

Loading fills the module's parameters, the master partitions and the
optimizer's state tensors in place (creating them before the first step),
refreshes the master weights from the loaded module where the checkpoint
has no fp32 copy. ZeRO-3's persistent parameters (whole on every rank) are
read whole and their pieces copied from them: no collective runs in a load.

CPU offload (optimizer, ZeRO-3 parameters) works alike, and so do fp16
(its fp32 masters as under bf16, its loss scaler's numbers in the engine
state) and ZeRO-3's hpZ (its secondary partitions live only between backward
and step: the primary ones are saved; a load drops the secondary copies of
the old weights). AutoTP shards are saved as boxes of the full tensors
(:mod:`.tp`). Settings the fragment map cannot describe (NVMe offload,
tensor parallelism other than AutoTP, MiCS, ZeRO-0 mixed precision outside a
pipeline) fail
at save and load on every rank with the setting named
(:func:`.zero.check_supported`).

Pipelines (``PipelineEngine``, ZeRO 0/1, ``BF16_Optimizer``): each stage
saves the layers it built under the ``PipelineModule``'s names, which are the
same model's as an ``nn.Sequential`` (``<layer index>.<param>``); a load
tells the core the other stages' names are loaded elsewhere
(``LoadTarget.elsewhere``), so each stage reads its own under a strict load,
at any stage count.

Called through the adapter registry on every rank (``detect``, then
``save_tree`` or ``load_tree``). This module never imports DeepSpeed:
detection reads class names, and only once ``deepspeed`` is imported.
"""

from .adapter import DeepSpeedAdapter, expand_engines

__all__ = ["DeepSpeedAdapter", "expand_engines"]
