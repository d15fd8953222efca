# The args part of Megatron-LM's megatron/training/global_vars.py (core_v0.16.1), verbatim:
# ``set_global_variables`` also builds the tokenizer, timers and loggers, which the tests do not use.

_GLOBAL_ARGS = None


def get_args():
    """Return arguments."""
    _ensure_var_is_initialized(_GLOBAL_ARGS, 'args')
    return _GLOBAL_ARGS


def set_args(args):
    global _GLOBAL_ARGS
    _GLOBAL_ARGS = args


def _ensure_var_is_initialized(var, name):
    """Make sure the input variable is not None."""
    assert var is not None, '{} is not initialized.'.format(name)
