"""The pool's ranks hold what its fork server was asked to import once
(:data:`dist.pool.PRELOAD`, ``tests/dist/preload.py``), and not DeepSpeed.

Python 3.11's fork server imports its preload before it takes the
``sys.path`` it is handed and drops a module it cannot import without a
word: ``dist.preload`` (under ``tests/``) went unimported for a long time,
and every Megatron, DeepSpeed and Hugging Face rank imported those modules
again. Nothing failed; the suite was only slower. This test fails instead."""

from __future__ import annotations

import importlib.util
import sys


def held() -> dict[str, list[str]]:
    """(on every rank) The preload's modules this rank does not hold, and
    whether DeepSpeed is held (it must not be: it reads the pool's
    environment when it is imported)."""
    from dist.pool import PRELOAD

    preload = sys.modules.get("dist.preload")
    wanted = list(PRELOAD) + list(getattr(preload, "PRELOADED", ()))
    if importlib.util.find_spec("megatron") is not None:
        wanted.append("megatron.core.models.gpt.gpt_layer_specs")
    installed = [m for m in wanted if m == "dist.preload" or importlib.util.find_spec(m.split(".")[0]) is not None]
    return {"missing": [m for m in installed if m not in sys.modules],
            "deepspeed": sorted(m for m in sys.modules if m.split(".")[0] == "deepspeed")}


def test_every_rank_holds_the_preload_and_not_deepspeed(pools) -> None:
    for rank, got in enumerate(pools(2).run(held)):
        assert got == {"missing": [], "deepspeed": []}, (rank, got)
