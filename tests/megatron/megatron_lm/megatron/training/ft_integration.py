# Megatron-LM's fault-tolerance hooks (megatron/training/ft_integration.py, core_v0.16.1):
# without an initialised rank-monitor client (no --enable-ft-package) they do nothing.


def on_checkpointing_start():
    pass


def on_checkpointing_end(is_async_finalization: bool):
    pass
