"""Resharders of data loaders (``bytecp.adapters.data``): the data positions of
the loaders bytecp knows, recorded at every save and continued exactly
under another data-parallel layout (:mod:`bytecp.data`).

- :mod:`bytecp.adapters.data.torchdata`: torchdata's ``StatefulDataLoader``
  over a map-style dataset with torch's ``DistributedSampler`` or
  torchdata's ``StatefulDistributedSampler``;
- :mod:`bytecp.adapters.data.hf_datasets`: ``StatefulDataLoader`` over a
  Hugging Face ``datasets.IterableDataset`` (its streams' cursors:
  :mod:`bytecp.adapters.data.hf_streams`).

torchtitan's dataloader has its own (:mod:`bytecp.adapters.torchtitan.data`).

The core's registry names each one as a lazy string with the module its
objects need (``torchdata.stateful_dataloader``), so nothing here is
imported by a job that does not use it.
"""

from __future__ import annotations

__all__: list[str] = []
