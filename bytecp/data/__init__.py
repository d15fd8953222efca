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

The built-in resharder: torchdata's ``StatefulDataLoader`` over a map-style
dataset with torch's ``DistributedSampler`` or torchdata's
``StatefulDistributedSampler`` (:mod:`bytecp.adapters.data.torchdata`).
"""

from __future__ import annotations

from bytecp.data.positions import SavedData
from bytecp.data.registry import (
           Resharded,
           Resharder,
           claims,
           position_of,
           register_resharder,
           resharder_for,
)
from bytecp.errors import DataReshardError

__all__ = ["Resharder", "Resharded", "SavedData", "DataReshardError", "register_resharder", "resharder_for",
           "position_of", "claims"]
