"""Functions the worker pools run on every rank: a Hugging Face streaming
dataset (``split_dataset_by_node`` over local parquet shards) through
torchdata's ``StatefulDataLoader``, and torchtitan's text dataloader (its
per-DP-rank pickles), each saved with ``bytecp.save`` beside a module by W
ranks and loaded by W' ranks. Each returns what its rank read, so the test
process rebuilds the epoch."""

from __future__ import annotations

import logging
import multiprocessing
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import bytecp


def _quiet() -> None:
    logging.getLogger("datasets").setLevel(logging.ERROR)
    logging.getLogger("torchtitan").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*set_vital.*")


def hf_loader(files: list[str], batch: int, workers: int) -> Any:
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node
    from torchdata.stateful_dataloader import StatefulDataLoader

    _quiet()
    if workers:  # the pool's ranks are daemonic processes; a loader's workers are their children
        multiprocessing.current_process()._config["daemon"] = False  # type: ignore[attr-defined]
    ds = split_dataset_by_node(load_dataset("parquet", data_files=files, split="train", streaming=True),
                               rank=dist.get_rank(), world_size=dist.get_world_size())
    kw: dict[str, Any] = {"num_workers": workers}
    if workers:
        kw.update(prefetch_factor=2, multiprocessing_context="fork")
    return StatefulDataLoader(ds, batch_size=batch, **kw)


def hf_save(url: str, files: list[str], batch: int, steps: int, workers: int = 0) -> dict[str, Any]:
    dl = hf_loader(files, batch, workers)
    it = iter(dl)
    before = [[int(x) for x in next(it)["id"]] for _ in range(steps)]
    torch.manual_seed(0)  # the module is replicated: alike on every rank
    bytecp.save(url, {"model": nn.Linear(2, 2), "extra": {"dataloader": dl}})
    return {"before": before}


def hf_load(url: str, files: list[str], batch: int, workers: int = 0, mode: str | None = None) -> dict[str, Any]:
    dl = hf_loader(files, batch, workers)
    model = nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.zero_()
    try:
        bytecp.load(url, {"model": model, "extra": {"dataloader": dl}}, **({} if mode is None else {"data_reshard": mode}))
    except bytecp.BytecpError as e:
        return {"error": str(e), "untouched": bool(model.weight.eq(0).all())}
    return {"after": [int(x) for b in dl for x in b["id"]]}


def _titan(root: str, dp: int, rank: int) -> Any:
    from tests.data.titan_sim import Setup, assets, make

    _quiet()
    return make(Setup(assets(Path(root) / f"r{dist.get_rank()}"), dp), rank)


def titan_save(url: str, root: str, steps: int) -> dict[str, Any]:
    """torchtitan's loader saved through the torchtitan adapter (``framework="torchtitan"``)."""
    dl = _titan(root, dist.get_world_size(), dist.get_rank())
    it = iter(dl)
    rows = [row.tolist() for _ in range(steps) for row in next(it)[0]["input"]]
    bytecp.save(url, {"dataloader": dl}, framework="torchtitan")
    return {"rows": rows}


def titan_load(url: str, root: str) -> dict[str, Any]:
    dl = _titan(root, dist.get_world_size(), dist.get_rank())
    bytecp.load(url, {"dataloader": dl}, framework="torchtitan")
    rows = [row.tolist() for b in dl for row in b[0]["input"]]
    return {"rows": rows, "buffer": list(dl.dataset._inputs_buffer)}

