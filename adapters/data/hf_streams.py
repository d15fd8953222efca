"""The reading streams of a Hugging Face ``datasets.IterableDataset`` split with
``split_dataset_by_node``, and their cursors: which shards each stream reads,
where its saved state says it stands, and the state that starts a stream at
a given cursor.

What ``datasets`` (5.x) does, and this module mirrors:

- the dataset is a list of ``N`` shards (files, or a generator's lists of
  data sources); in epoch ``e > 0`` the list is permuted by
  ``numpy.random.default_rng(e)`` (``_shuffle_gen_kwargs``), unless the
  dataset forbids it (``skip``/``take``);
- ``split_dataset_by_node(ds, r, W)``: when ``W`` divides ``N`` (or
  ``strategy="shards"``) rank ``r`` reads the shards at positions ``r, r+W,
  ...`` of that list ("shards"); otherwise every rank reads every shard and
  keeps the examples ``r, r+W, ...`` of the stream ("examples");
- ``num_workers = n`` splits a rank's list again: worker ``w`` reads
  positions ``w, w+n, ...`` of it;
- each stream's state is one cursor, ``(shard_idx, shard_example_idx)`` in
  the stream's own list, wrapped by the iterables that read it: arrow
  rebatching (a table boundary and the rows read since), the node's step
  (``StepExamplesIterable``). A shard read to its last example is marked
  done only when the next example is asked for.

Called by :mod:`bytecp.adapters.data.hf_datasets` (every rank): at a save to
turn a saved state into cursors (:func:`decode`), at a load to read a
shard's length where a cursor is ambiguous (:func:`shard_rows`) and to build
the state that starts a stream at a cursor (:func:`encode`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from bytecp.plugins import missing_extra

try:  # (imported by hf_datasets, once datasets is imported)
    from datasets import IterableDataset
    from datasets.iterable_dataset import (
        ArrowExamplesIterable,
        DataSourcesShufflingDisallowed,
        ExamplesIterable,
    )
    from datasets.utils.sharding import _shuffle_gen_kwargs
except ModuleNotFoundError as e:
    raise missing_extra(e, "datasets", __name__) from None

__all__ = ["Layout", "layout", "order", "stream_positions", "decode", "encode", "shard_rows", "Unknown",
           "LEAVES"]

#: the iterables whose state is a cursor (the shards' readers)
LEAVES = ("ExamplesIterable", "ArrowExamplesIterable")


class Unknown(ValueError):
    """A state this module cannot read as cursors (another ``datasets`` pipeline:
    ``map``, ``filter``, a shuffle buffer, interleaved sources)."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one rank's dataset is read."""

    num_shards: int  # of the whole dataset
    dp_size: int  # the node split's world size (1: not split)
    dp_rank: int
    strategy: str  # "shards", "examples" or "whole" (not split)
    workers: int  # reading streams of the rank (the loader's workers, at least 1)
    epoch: int

    def streams(self) -> list[list[int]]:
        """Each stream's shards, as positions in the epoch's order (see :func:`order`)."""
        return stream_positions(self.num_shards, self.dp_size, self.dp_rank, self.strategy, self.workers)


def stream_positions(n: int, dp: int, rank: int, strategy: str, workers: int) -> list[list[int]]:
    """The positions (in the epoch's shard order) each of a rank's ``workers`` streams reads."""
    mine = list(range(rank, n, dp)) if strategy == "shards" else list(range(n))
    return [mine[w::workers] for w in range(workers)]


def _base(ds: IterableDataset) -> Any:
    base = ds._ex_iterable
    if type(base) not in (ExamplesIterable, ArrowExamplesIterable):
        raise Unknown(f"its pipeline ends in {type(base).__name__} (map, filter, shuffle buffers and interleaved "
                      "datasets keep positions bytecp does not read)")
    return base


def layout(ds: IterableDataset, num_workers: int) -> Layout:
    """(every rank) The live dataset's layout; :class:`Unknown` for pipelines
    whose state is not a plain cursor."""
    base = _base(ds)
    n = int(base.num_shards)
    d = ds._distributed
    if d is None:
        dp, rank, strategy = 1, 0, "whole"
    else:
        dp, rank = int(d.world_size), int(d.rank)
        strategy = "shards" if d.strategy == "shards" or (d.strategy == "auto" and n % dp == 0) else "examples"
    return Layout(n, dp, rank, strategy, max(1, int(num_workers)), int(ds.epoch))


def order(ds: IterableDataset, epoch: int, n: int) -> list[int]:
    """The shards' order in ``epoch``: position -> shard (``datasets``' own
    permutation of the data sources, or none where shuffling is disallowed)."""
    if not epoch:
        return list(range(n))
    try:
        ds._ex_iterable.shuffle_data_sources(np.random.default_rng(epoch))
    except DataSourcesShufflingDisallowed:
        return list(range(n))
    return list(_shuffle_gen_kwargs(np.random.default_rng(epoch), {"shards": list(range(n))})["shards"])


def shard_rows(ds: IterableDataset, shard: int) -> int:
    """(load, where a cursor is ambiguous) How many examples shard ``shard``
    holds: it is read through ``datasets``' own reader (one shard, not the dataset)."""
    base = _base(ds)
    one = base.shard_data_sources(int(base.num_shards), shard, contiguous=True)
    if isinstance(one, ArrowExamplesIterable):
        return sum(len(t) for _, t in one._iter_arrow())
    return sum(1 for _ in one)


# ---------------------------------------------------------------------------------- saved states -> cursors

def _leaf(x: Any) -> tuple[int, int]:
    if not isinstance(x, dict) or x.get("type") not in LEAVES:
        raise Unknown(f"a state of type {x.get('type') if isinstance(x, dict) else type(x).__name__}")
    return int(x["shard_idx"]), int(x["shard_example_idx"])


def decode(state: Any, dp: int, rank: int) -> dict[str, Any]:
    """(save) One stream's cursor from its saved ``datasets`` state (the
    dataset's ``state_dict()``, ``{"examples_iterable": ..., "epoch": e}``).

    -> ``{"at": [i, k]}``: the stream read shards ``0..i-1`` of its list and
    ``k`` examples of shard ``i`` (for the node's step: the stream position
    after this rank's last example); or ``{"cross": [i, k, j, rows]}``: the
    stream read ``rows`` examples from ``k`` of shard ``i`` into shard ``j``,
    over shards whose lengths only a read tells (right after a resume);
    ``"count"``: examples this rank read from the stream (when the state says);
    ``"step"``: ``"arrow"``/``"python"`` for a stream every rank reads (the node's step).
    """
    if not isinstance(state, dict) or "examples_iterable" not in state:
        raise Unknown("a dataset state without examples_iterable")
    x = state["examples_iterable"]
    kind = x.get("type") if isinstance(x, dict) else None
    if kind in LEAVES:
        return {"at": list(_leaf(x))}
    if kind == "StepExamplesIterable":  # (python rows) the cursor is where the rank's last group ended
        return {"at": list(_leaf(x["examples_iterable"])), "step": "python"}
    if kind != "RebatchedArrowExamplesIterable":
        raise Unknown(f"a state of type {kind}")
    if x.get("cropped_chunk_length"):
        raise Unknown("rebatched arrow rows read in batches of more than one example")
    inner, prev, rows = x["examples_iterable"], x.get("previous_state"), int(x["num_chunks_since_previous_state"])
    count = int(x.get("batch_idx", 0))
    step = isinstance(inner, dict) and inner.get("type") == "StepExamplesIterable"
    live = _leaf(inner["examples_iterable"] if step else inner)
    if prev is None:  # nothing read since the state was loaded: the loaded cursor
        out: dict[str, Any] = {"at": list(live)}
        if step:
            out.update(step="arrow", at=list(live), fresh=True)
        return {**out, "count": count}
    start = _leaf(prev["examples_iterable"] if step else prev)
    if step:  # the rows counted are this rank's: every dp-th of the stream's, from the table's start
        carry = int(prev.get("stepped", 0))
        rows = (rank - carry) % dp + (rows - 1) * dp + 1 if rows else 0
    out = {"count": count, **({"step": "arrow"} if step else {})}
    if live[0] == start[0] or rows == 0:
        return {**out, "at": [start[0], start[1] + rows]}
    return {**out, "cross": [start[0], start[1], live[0], rows]}


# ---------------------------------------------------------------------------------- cursors -> a state

def encode(template: Any, cursor: tuple[int, int], dp: int, rank: int, epoch: int) -> dict[str, Any]:
    """(load) The ``datasets`` state that starts a stream at ``cursor`` (for
    the node's step: this rank's first example is the stream's ``k + rank``-th
    from shard ``i``), in the nesting of ``template`` (the live dataset's own
    initial state: its iterables)."""
    i, k = cursor
    t = copy.deepcopy(template)

    def leaf(x: dict[str, Any], at: int) -> dict[str, Any]:
        if x.get("type") not in LEAVES:
            raise Unknown(f"a state of type {x.get('type')}")
        return {**x, "shard_idx": i, "shard_example_idx": at}

    kind = t.get("type")
    if kind in LEAVES:
        return {"examples_iterable": leaf(t, k), "epoch": epoch}
    if kind == "StepExamplesIterable":  # python rows: the groups of dp start at the cursor
        return {"examples_iterable": {**t, "examples_iterable": leaf(t["examples_iterable"], k), "stepped": 0},
                "epoch": epoch}
    if kind != "RebatchedArrowExamplesIterable":
        raise Unknown(f"a state of type {kind}")
    inner = t["examples_iterable"]
    if inner.get("type") == "StepExamplesIterable":
        # from the shard's start, the stream's rows this rank keeps are those = k + rank (mod dp); it skips
        # the ones before k + rank
        at = {**inner, "examples_iterable": leaf(inner["examples_iterable"], 0), "stepped": (-k) % dp}
        skip = (k + rank) // dp
    else:
        at, skip = leaf(inner, 0), k
    return {"examples_iterable": {**t, "examples_iterable": copy.deepcopy(at), "previous_state": at,
                                  "num_chunks_since_previous_state": skip, "cropped_chunk_length": 0,
                                  "batch_idx": 0},
            "epoch": epoch}


def template(ds: IterableDataset) -> Any:
    """The live dataset's initial state nesting (its iterables, as iterating builds them)."""
    st = getattr(ds, "_state_dict", None)
    if not isinstance(st, dict) or "examples_iterable" not in st:
        raise Unknown("a dataset without an initial state")
    return copy.deepcopy(st["examples_iterable"])


def positions_of(streams: Sequence[Sequence[int]]) -> dict[int, tuple[int, int]]:
    """position -> (stream, index in it)."""
    return {p: (s, i) for s, ps in enumerate(streams) for i, p in enumerate(ps)}


__all__ += ["template", "positions_of"]
