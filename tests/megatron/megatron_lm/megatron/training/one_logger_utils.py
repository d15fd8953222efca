# Megatron-LM's one-logger hooks (megatron/training/one_logger_utils.py, core_v0.16.1):
# without a one-logger (no --enable-one-logger) they record nothing and return None.


def on_save_checkpoint_start(async_save):
    return None


def on_save_checkpoint_success(productive_metrics, async_save):
    pass
