"""``torch.distributed.checkpoint`` (DCP), set up the way its documentation shows.

The state dict comes from ``get_state_dict`` (sharded for FSDP, prefix-free
for DDP) and goes back through ``set_state_dict``; both are inside the timed
region, since a training loop using DCP must call them. Background saves use
their own gloo group (``process_group=``): checkpoint collectives on the
training group collide with training's own. Cases:

- ``dcp.save``: synchronous; durable when it returns (FileSystemWriter fsyncs).
- ``dcp.async_save thread``: thread executor, default stager (a fresh copy per call).
- ``dcp.async_save thread reused stager``: one ``DefaultStager`` kept across
  saves (its staging buffers are reused); blocking = until staging completes.
- ``dcp.async_save process``: process executor, default stager.
- ``dcp.load``: ``get_state_dict`` -> ``dcp.load`` -> ``set_state_dict``.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .harness import Case

if TYPE_CHECKING:
    from .harness import Ctx

__all__ = ["CASES", "rank_bytes", "close"]


def _state_dict(ctx: Ctx) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(ctx.model, ctx.optim)
    return {"model": msd, "optim": osd}


def save(ctx: Ctx) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    path = ctx.path("dcp-save")
    ctx.fresh_dir(path)
    t0 = time.perf_counter()
    dcp.save(_state_dict(ctx), checkpoint_id=path)
    t1 = time.perf_counter()
    ctx.expected["dcp"] = ctx.fingerprint()
    ctx.load_from.setdefault("dcp", path)
    return {"blocking_s": t1 - t0, "total_s": t1 - t0, "path": path}


def async_thread(ctx: Ctx) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    path = ctx.path("dcp-async-thread")
    ctx.fresh_dir(path)
    t0 = time.perf_counter()
    fut = dcp.async_save(_state_dict(ctx), checkpoint_id=path, process_group=ctx.ckpt_pg)
    t1 = time.perf_counter()
    fut.result()
    t2 = time.perf_counter()
    return {"blocking_s": t1 - t0, "total_s": t2 - t0, "path": path}


def _stager(ctx: Ctx, *, shared: bool) -> Any:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    key = f"dcp-stager-{'shm' if shared else 'plain'}"
    if key not in ctx.scratch:
        ctx.scratch[key] = DefaultStager(StagingOptions(
            use_pinned_memory=False, use_shared_memory=shared,
            use_async_staging=False, use_non_blocking_copy=False))
    return ctx.scratch[key]


def async_thread_reused(ctx: Ctx) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    path = ctx.path("dcp-async-reused")
    ctx.fresh_dir(path)
    t0 = time.perf_counter()
    resp = dcp.async_save(_state_dict(ctx), checkpoint_id=path, process_group=ctx.ckpt_pg,
                          async_stager=_stager(ctx, shared=False))
    staged = getattr(resp, "staging_completion", None)
    if staged is not None:
        staged.result()
    t1 = time.perf_counter()
    getattr(resp, "upload_completion", resp).result()
    t2 = time.perf_counter()
    return {"blocking_s": t1 - t0, "total_s": t2 - t0, "path": path}


def async_process(ctx: Ctx) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    path = ctx.path("dcp-async-process")
    ctx.fresh_dir(path)
    t0 = time.perf_counter()
    fut = dcp.async_save(_state_dict(ctx), checkpoint_id=path, process_group=ctx.ckpt_pg,
                         async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    t1 = time.perf_counter()
    fut.result()
    t2 = time.perf_counter()
    return {"blocking_s": t1 - t0, "total_s": t2 - t0, "path": path}


def load(ctx: Ctx) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = ctx.load_path("dcp")
    t0 = time.perf_counter()
    sd = _state_dict(ctx)
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(ctx.model, ctx.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    t1 = time.perf_counter()
    return {"blocking_s": t1 - t0, "total_s": t1 - t0, "verified": ctx.check_loaded("dcp")}


_DATA = re.compile(r"__(\d+)_\d+\.distcp$")


def rank_bytes(path: str, rank: int) -> int:
    """Bytes of the ``__<rank>_<n>.distcp`` files at ``path``."""
    total = 0
    for f in Path(path).iterdir():
        m = _DATA.match(f.name)
        if m and int(m.group(1)) == rank:
            total += f.stat().st_size
    return total


def close(ctx: Ctx) -> None:
    """Release the reused stagers and the process executor's daemon (end of a group)."""
    for key in [k for k in ctx.scratch if k.startswith("dcp-stager")]:
        try:
            ctx.scratch.pop(key).close()
        except Exception:
            pass


def _async_unsupported(framework: str) -> str | None:
    # torch 2.13: the stager calls data_ptr() on FSDP1's ShardedTensor values, which raises
    if framework == "fsdp1":
        return "n/a (DCP's async_save stager cannot copy FSDP1's ShardedTensor state dict)"
    return None


CASES = {
    c.name: c
    for c in (
        Case("dcp.save", "dcp", "save", save),
        Case("dcp.async_save thread", "dcp", "async", async_thread, unavailable=_async_unsupported),
        Case("dcp.async_save thread reused stager", "dcp", "async", async_thread_reused,
             unavailable=_async_unsupported),
        Case("dcp.async_save process", "dcp", "async", async_process, unavailable=_async_unsupported),
        Case("dcp.load cold", "dcp", "load", load, cold=True),
        Case("dcp.load warm", "dcp", "load", load),
    )
}
