"""Which tensors ``bytecp export`` takes from each kind of checkpoint when
the user names no ``--prefix``, and the fp32 master weights ``--masters``
exports in place of a bf16/fp16 model's.

Called by :func:`bytecp.interop.export.select_tensors` (one process, while
an export plans what it writes). The defaults, by the framework recorded in
the checkpoint's metadata (a foreign source's reader records its own):

- a bytecp checkpoint, a DeepSpeed or a Megatron torch_dist checkpoint:
  the tensors under ``model.`` (the names bytecp's adapters give a
  ``{"model": ..., "optimizer": ...}`` state);
- a DCP checkpoint: under ``model.`` when any tensor is there (Lightning,
  Accelerate, ``get_state_dict``), else the top level less the keys of
  training state (:data:`TRAINING_KEYS`: torchtitan puts the model's
  tensors at the top, beside ``optimizer``, ``lr_scheduler``,
  ``dataloader``, ``train_state``);
- a Hugging Face directory: every tensor, as named.
"""

from __future__ import annotations

from bytecp.errors import ConfigError
from bytecp.format import metadata as fmt

__all__ = ["TRAINING_KEYS", "MASTER_SUFFIX", "default_selection", "masters_of"]

#: top-level keys of a DCP checkpoint that hold training state, not the model (torchtitan's, DCP's examples')
TRAINING_KEYS = ("optimizer", "optim", "optimizers", "lr_scheduler", "lr_schedulers", "scheduler", "dataloader",
                 "train_state", "rng_state", "extra_state")
#: ``optimizer.state.<name>.fp32``: the fp32 master of parameter ``<name>`` (bytecp's DeepSpeed names)
MASTER_SUFFIX = ".fp32"


def default_selection(md: fmt.Metadata) -> tuple[str, tuple[str, ...]]:
    """``(prefix, top-level keys left out)`` of an export that names no prefix."""
    if md.framework == "huggingface":
        return "", ()
    if md.framework == "dcp" and not any(f.startswith("model.") for f in md.tensors):
        return "", TRAINING_KEYS
    return "model.", ()


def masters_of(md: fmt.Metadata, where: str) -> dict[str, str]:
    """``model.<name>`` -> ``optimizer.state.<name>.fp32``: the fp32 master
    weights a DeepSpeed bf16/fp16 run keeps apart from the model's (what
    ``zero_to_fp32`` writes); a clear error when the checkpoint has none."""
    head = "optimizer.state."
    out = {f"model.{k[len(head):-len(MASTER_SUFFIX)]}": k for k in md.tensors
           if k.startswith(head) and k.endswith(MASTER_SUFFIX)}
    if not out:
        raise ConfigError(f"{where}: holds no fp32 master weights apart from the model's "
                          f"({head}<name>{MASTER_SUFFIX}: a DeepSpeed bf16/fp16 run's); its model tensors are "
                          "what it has: export without --masters")
    return out
