# Megatron-LM's ``megatron.training`` (NVIDIA/Megatron-LM at tag core_v0.16.1,
# commit 55ac7082517c3878ae653c07c09c534b8aed49f6), the part the tests run:
# ``arguments.py`` (its ``parse_args``/``validate_args``: the ``args`` every
# checkpoint stores) and ``checkpointing.py`` (its ``save_checkpoint``), with
# the config modules ``arguments.py`` imports, all verbatim. The megatron-core
# wheel does not ship this package. The other modules here are the few names
# those two import from Megatron-LM's training loop, reduced to what they do
# when their features (async saves, fault tolerance, one-logger, wandb) are
# off, which is how the tests run. LICENSE (one level up) is Megatron-LM's.
# Megatron-LM's own ``__init__`` imports its whole training loop; this one
# exposes what ``checkpointing.py`` and ``arguments.py`` use.

from .global_vars import get_args, set_args

__all__ = ["get_args", "set_args"]
