"""DCP's ``.metadata`` for the scale benchmark's chunks: its size, the time
and memory to unpickle it (every DCP rank does) and one rank's read plan.
Built from every rank's chunks, so only where they fit in memory."""

from __future__ import annotations

import pickle
from typing import Any

from .scale_jobs import Job


def dcp_metadata(job: Job, repeats: int) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    from .scale import measure

    specs = job.specs()
    chunks: dict[str, list[Any]] = {f: [] for f in specs}
    storage: dict[Any, Any] = {}
    order = sorted(range(job.world), key=lambda r: r % max(1, job.ep))  # one EP index's plan at a time
    for r in order:
        for fqn, box in job.chunks(r):
            off, size = torch.Size(box.offsets), torch.Size(box.lengths)
            chunks[fqn].append(ChunkStorageMetadata(off, size))
            storage[MetadataIndex(fqn, off)] = _StorageInfo(f"__{r}_0.distcp", 0, 4 * box.numel)
    sd_md: dict[str, Any] = {f: TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(specs[f]["shape"]), c)
             for f, c in chunks.items()}
    blob = pickle.dumps(Metadata(sd_md, storage_data=storage), protocol=pickle.HIGHEST_PROTOCOL)
    del sd_md, storage, chunks
    t, mem, md = measure(lambda: pickle.loads(blob), max(1, repeats - 1))
    rank = job.world // 2

    def plan() -> int:
        n = 0
        for fqn, box in job.targets(rank):
            if box.numel:
                local = [ChunkStorageMetadata(torch.Size(box.offsets), torch.Size(box.lengths))]
                n += len(create_read_items_for_chunk_list(fqn, md.state_dict_metadata[fqn], local))
        return n

    tp, memp, _ = measure(plan, repeats)
    return {"metadata_mb": len(blob) / 1e6, "unpickle_s": t, "unpickle_peak_mb": mem / 1e6,
            "rank_plan_s": tp, "rank_plan_peak_mb": memp / 1e6, "mb_per_chunk": len(blob) / 1e6 / job.chunk_count(),
            "peak_mb_per_chunk": mem / 1e6 / job.chunk_count(), "s_per_chunk": t / job.chunk_count()}
