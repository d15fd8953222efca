"""Data positions that reshard with the tensors: a job resumed under another
data-parallel size continues its data stream exactly where the saved job
stopped.

Users need nothing of this module: a data loader in the state
(``{"dataloader": loader}``) is found by the adapters, its position recorded
at every save and resharded at a load under another world size (the guide's
"Data loaders across a world-size change"). It is for those who teach bytecp
a new kind of loader (docs/extending.md "Data loaders"):

- :class:`Resharder` and :func:`register_resharder` (or a
  ``bytecp.resharders`` entry point): one kind of loader, sampler or
  stateful dataset: its small position at a save, and the state that
  continues it at a load;
- or, on one's own class, the ``reshard(saved, rank, world_size)`` method
  (and optionally ``data_position()``): the object reshards itself;
- :class:`SavedData`: what a resharder receives at a load (the merged
  positions, any saved rank's state on demand);
- :class:`Resharded`: a state with an action after the load, or a warning;
- :class:`~bytecp.errors.DataReshardError`: what a resharder raises when the
  position cannot continue exactly, naming the samples that would repeat or
  be skipped.

The built-in resharders: torchdata's ``StatefulDataLoader`` over a map-style
dataset with torch's ``DistributedSampler`` or torchdata's
``StatefulDistributedSampler`` (:mod:`bytecp.adapters.data.torchdata`), over
a Hugging Face ``datasets.IterableDataset``
(:mod:`bytecp.adapters.data.hf_datasets`), torchtitan's dataloader
(:mod:`bytecp.adapters.torchtitan.data`), Megatron-LM's consumed-samples
counters (:mod:`bytecp.adapters.megatron.data`) and a DeepSpeed engine's
training loader (:mod:`bytecp.adapters.deepspeed.data`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from bytecp.errors import DataReshardError

if TYPE_CHECKING:
    from bytecp.data.positions import SavedData
    from bytecp.data.registry import (
        Resharded,
        Resharder,
        claims,
        position_of,
        register_resharder,
        resharder_for,
    )

__all__ = ["Resharder", "Resharded", "SavedData", "DataReshardError", "register_resharder", "resharder_for",
           "position_of", "claims"]

#: imported on first use: ``metadata.json``'s reader needs only :mod:`bytecp.data.positions`, and
#: commands that read metadata only (``bytecp ls``) must not import torch
_LAZY = {"SavedData": "bytecp.data.positions", "Resharder": "bytecp.data.registry",
         "Resharded": "bytecp.data.registry", "register_resharder": "bytecp.data.registry",
         "resharder_for": "bytecp.data.registry", "position_of": "bytecp.data.registry",
         "claims": "bytecp.data.registry"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'bytecp.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
