"""What the pool's fork server imports once per session besides torch and
bytecp (:data:`dist.pool.PRELOAD`): Megatron-Core's modules the Megatron
cases build from, 2.6-5 s of CPU per rank otherwise, its import-time
warnings (no Apex, no Transformer Engine) silenced; and what the other
cases' ranks import (bytecp's save and load, transformers, datasets, s3fs).
None of them reads anything a pool sets when it is imported; DeepSpeed does
(it picks its accelerator at import, from ``DS_ACCELERATOR``), so DeepSpeed
is imported by the ranks that use it. A module that is not installed is
left out. ``tests/dist/test_pool_preload.py`` checks that the ranks hold them.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import warnings

#: imported after Megatron-Core's modules (each left out where it is not installed)
PRELOADED = ("bytecp.api", "transformers", "transformers.models.llama.modeling_llama",
             "transformers.models.gpt2.modeling_gpt2", "datasets", "s3fs", "pyarrow.compute", "numpy.ma")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    try:
        import megatron.core  # noqa: F401
        import megatron.core.dist_checkpointing.mapping  # noqa: F401
        import megatron.core.distributed  # noqa: F401
        import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
        import megatron.core.optimizer  # noqa: F401
        import megatron.core.transformer.moe.moe_utils  # noqa: F401
    except ImportError:
        pass
    # what the ranks of the other cases import (1-2 s of CPU per rank each): bytecp's
    # save and load (``import bytecp`` alone is lazy), transformers and the two models
    # the cases build, datasets, s3fs, and what pyarrow and numpy import on first use
    # (pyarrow.compute: the parts index; numpy.ma); none of them imports DeepSpeed
    for name in PRELOADED:
        try:
            importlib.import_module(name)
        except ImportError:
            pass

# the last module the fork server preloads: what it imported is frozen out of the
# collector's sight, so no rank's collection walks those objects again (tenths of a second
# each with half a million of them); thawed when the server ends normally (objects still
# frozen then are never freed, and triton's bindings print a leak report for theirs)
gc.freeze()
atexit.register(gc.unfreeze)
