"""torchtitan's text dataloader (``HuggingFaceTextDataLoader``: sequence
packing over a Hugging Face dataset, its per-DP-rank pickled state) for
simulated data-parallel ranks in one process.

The data is a ``c4_test``-style JSON-lines file and a tiny BPE tokenizer
(:func:`tests.integrations.titan_config.write_assets`); a streaming variant
reads the same documents split into JSON-lines shards through
``load_dataset(..., streaming=True)``, registered in torchtitan's
``DATASETS`` as its docs say to add a dataset. Each simulated rank records
its position as the torchtitan adapter does, the positions are merged as
the commit merges them, and each new rank's state comes from the load's
decision. Documents are told apart by their tokens: the check rebuilds, from
what every rank yielded (and what its buffer held), which documents were
trained on and how often.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path
from typing import Any

from bytecp.adapters.torchtitan.state import TorchtitanStateAdapter
from datasets import load_dataset
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets import text_datasets as td
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

from bytecp.data.positions import merge_positions
from bytecp.data.restore import restore_data
from bytecp.format.objects import serialize
from tests.integrations.titan_config import write_assets

__all__ = ["Assets", "assets", "Setup", "make", "save_after", "restore", "resume", "documents"]

SEQ = 32


@dataclasses.dataclass(frozen=True)
class Assets:
    root: Path
    tokenizer: Any
    docs: list[tuple[int, ...]]  # each document's input tokens, as the dataset packs them


def assets(root: Path, docs: int = 60, shards: int = 6) -> Assets:
    write_assets(root, docs=docs)
    lines = (root / "c4_test" / "c4_demo.json").read_text().splitlines()
    stream = root / "c4_stream"
    stream.mkdir(exist_ok=True)
    for s in range(shards):
        (stream / f"part-{s}.jsonl").write_text("".join(x + "\n" for x in lines[s::shards]))
    td.DATASETS["c4_stream_test"] = DatasetConfig(
        path=str(stream), loader=lambda p: load_dataset("json", data_files=sorted(str(x) for x in Path(p).glob("*.jsonl")),
                                                        split="train", streaming=True),
        sample_processor=lambda s: s["text"])
    tok = HuggingFaceTokenizer(tokenizer_path=str(root / "tokenizer"))
    texts = [json.loads(x)["text"] for x in lines]
    return Assets(root, tok, [tuple(tok.encode(t, add_bos=True, add_eos=True)[:-1]) for t in texts])


@dataclasses.dataclass(frozen=True)
class Setup:
    assets: Assets
    dp: int
    batch: int = 2
    streaming: bool = False
    workers: int = 0
    infinite: bool = False

    def with_(self, **kw: Any) -> Setup:
        return dataclasses.replace(self, **kw)


def make(setup: Setup, rank: int) -> HuggingFaceTextDataLoader:
    a = setup.assets
    cfg = HuggingFaceTextDataLoader.Config(
        dataset="c4_stream_test" if setup.streaming else "c4_test",
        dataset_path=str(a.root / ("c4_stream" if setup.streaming else "c4_test")), infinite=setup.infinite,
        num_workers=setup.workers, **({"prefetch_factor": 2} if setup.workers else {}))
    return HuggingFaceTextDataLoader(cfg, dp_world_size=setup.dp, dp_rank=rank, tokenizer=a.tokenizer, seq_len=SEQ,
                                     local_batch_size=setup.batch)


def _tokens(batch: Any) -> list[tuple[list[int], list[int]]]:
    inputs, _labels = batch
    return [(row.tolist(), pos.tolist()) for row, pos in zip(inputs["input"], inputs["positions"], strict=True)]


@dataclasses.dataclass
class Run:
    """What a rank's loader yielded (rows of tokens and positions), in order."""

    rows: list[tuple[list[int], list[int]]] = dataclasses.field(default_factory=list)

    def stream(self) -> tuple[list[int], list[int]]:
        toks = [t for r, _ in self.rows for t in r]
        pos = [p for _, q in self.rows for p in q]
        return toks, pos


@dataclasses.dataclass
class Saved:
    setup: Setup
    runs: list[Run]
    values: list[Any]  # what each rank saved (torchtitan's per-rank dict)
    record: dict[str, Any]
    buffers: list[list[int]]

    def read(self, rank: int) -> Any:
        return serialize_roundtrip(self.values[rank])


def serialize_roundtrip(v: Any) -> Any:
    """What a load reads back of a per-rank value (bytes included)."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(v, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _loader_buffer(dl: Any) -> list[int]:
    from bytecp.adapters.torchtitan.data import loader_state

    st = loader_state(dl.state_dict(), "test")
    sets = [w["dataset_state"] for w in st["_snapshot"]["_worker_snapshots"].values()] if "_snapshot" in st \
        else [st["dataset_state"]]
    return [t for s in sets for t in (s or {}).get("inputs_buffer", [])]


def save_after(setup: Setup, k: int, loaders: list[Any] | None = None) -> Saved:
    """Every rank draws ``k`` batches (from ``loaders``: restored ones), then saves."""
    loaders = [make(setup, r) for r in range(setup.dp)] if loaders is None else loaders
    its = [iter(dl) for dl in loaders]
    runs = [Run([row for _ in range(k) for row in _tokens(next(it))]) for it in its]
    adapter = TorchtitanStateAdapter()
    texts, values = {}, []
    for r, dl in enumerate(loaders):
        tree = adapter.save_tree({"dataloader": dl}, None)
        leaf = tree["dataloader"]
        values.append(leaf.value)
        texts[r] = json.dumps(leaf.data, sort_keys=True)
    return Saved(setup, runs, values, merge_positions(texts, setup.dp), [_loader_buffer(dl) for dl in loaders])


def restore(saved: Saved, new: Setup, mode: str = "exact") -> list[Any]:
    """Each new rank's loader, restored through the load's decision."""
    loaders = [make(new, r) for r in range(new.dp)]
    for r, dl in enumerate(loaders):
        got = restore_data("dataloader", dl, saved.record, saved.setup.dp, r, new.dp, saved.read, mode)
        value = saved.read(r) if got is None else saved.read(r % saved.setup.dp) if got.as_saved else got.value
        dl.load_state_dict(value)
        if got is not None and got.after is not None:
            got.after()
    return loaders


def resume(saved: Saved, new: Setup, mode: str = "exact") -> tuple[list[Run], list[list[int]]]:
    """Each new rank restores through the load's decision, reads to the end;
    -> what each yielded, and what each buffer holds at the end."""
    loaders = restore(saved, new, mode)
    runs = [Run([row for b in dl for row in _tokens(b)]) for dl in loaders]
    return runs, [_loader_buffer(dl) for dl in loaders]


def documents(streams: list[list[int]], bos: int) -> collections.Counter[tuple[int, ...]]:
    """The documents in token streams: each starts with the BOS token (packing drops only the EOS)."""
    out: collections.Counter[tuple[int, ...]] = collections.Counter()
    for toks in streams:
        cur: list[int] = []
        for t in toks:
            if t == bos and cur:
                out[tuple(cur)] += 1
                cur = []
            cur.append(t)
        if cur:
            out[tuple(cur)] += 1
    return out


_ = serialize
