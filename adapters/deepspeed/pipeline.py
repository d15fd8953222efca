"""DeepSpeed pipelines: which layers a ``PipelineModule`` stage builds and
what its stages are called.

Used by :mod:`.adapter` on every rank at load (the other stages' names are
loaded elsewhere) and by :mod:`.zero` (a stage's data-parallel group is the
job's less its pipeline stages). A ``PipelineModule`` names a layer by its
index in the whole layer list (``<index>.<param>``, the names the same
layers have as an ``nn.Sequential``) and a tied one ``tied_modules.<key>``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["is_pipeline_module", "other_stages", "pipeline_stages", "tensor_parallel_size"]


def is_pipeline_module(v: Any) -> bool:
    """Whether ``v`` is a built ``deepspeed.pipe.PipelineModule`` (one stage of it)."""
    return isinstance(v, nn.Module) and type(v).__name__ == "PipelineModule" and hasattr(v, "_layer_specs")


def other_stages(key: str, module: Any, optimizers: list[str]) -> list[str]:
    """The names of the layers other pipeline stages build (a ``PipelineModule``
    names a layer by its index in the whole list, a tied one
    ``tied_modules.<key>``), under the module's key and its optimizers' state."""
    specs = module._layer_specs
    start = module._local_start
    stop = len(specs) if module._local_stop is None else module._local_stop
    names = [str(i) for i in range(len(specs)) if not start <= i < stop]
    mine = set(getattr(module, "tied_modules", {}) or {})
    names += sorted({f"tied_modules.{s.key}" for s in specs if type(s).__name__ == "TiedLayerSpec"} -
                    {f"tied_modules.{k}" for k in mine})
    return [f"{key}.{n}" for n in names] + [f"{o}.state.{n}" for o in optimizers for n in names]


def pipeline_stages(engine: Any) -> int:
    """The pipeline stages of a ``PipelineEngine`` (1 for any other engine)."""
    grid = getattr(engine, "grid", None)
    return int(grid.get_pipe_parallel_world_size()) if grid is not None else 1


def tensor_parallel_size(engine: Any) -> int:
    """The tensor-parallel size an engine runs with (a pipeline's grid, else its model-parallel size)."""
    grid = getattr(engine, "grid", None)
    if grid is not None and type(engine).__name__ == "PipelineEngine":
        return int(grid.get_slice_parallel_world_size())
    return int(getattr(engine, "mp_world_size", 1) or 1)
