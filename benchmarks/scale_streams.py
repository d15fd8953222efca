"""Streaming data positions at scale: a Hugging Face ``datasets.IterableDataset``
split over W simulated ranks (``split_dataset_by_node``, read through
torchdata's ``StatefulDataLoader``), what recording its position costs each
rank and the coordinator, and what resharding it costs a rank of a load on
2W ranks and on W/2 (``python -m benchmarks.scale_streams``).

Every step is the real code on real ``datasets`` objects: a generator
dataset of ``2 * W`` shards of 8 examples (no files: the shards' readers are
``datasets``' own), batch 4, 4 steps (each rank stands at the end of its
first shard: a shrink must read those shards' lengths, the worst case of
an exact merge). Ranks of a synchronous run stand at the same cursor, so one
rank's position is built for real and the others' are the same text (a
rank leaves out its data-parallel rank where it is its own: checked on real
ranks 0 and W-1, whose texts differ only there in this one process).

- ``rank: position``: one rank's ``position_of`` and its JSON text;
- ``coordinator: merge``: ``merge_positions`` over the W texts, the merged
  record's size in ``metadata.json``;
- ``rank: reshard``: a middle rank of the new job decides from the record
  (:func:`bytecp.data.restore.restore_data`): the saved positions it looks
  up, the saved states it reads (one, for the seeds), the shards whose
  length it reads, the time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import tracemalloc
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from bytecp.adapters.data import hf_streams
from datasets import IterableDataset
from datasets.distributed import split_dataset_by_node
from torchdata.stateful_dataloader import StatefulDataLoader

from bytecp.data import position_of
from bytecp.data.positions import SavedData, merge_positions
from bytecp.data.restore import restore_data

__all__ = ["main", "run"]

ROWS, BATCH, STEPS = 8, 4, 2


def _gen(shards: list[int]) -> Iterator[dict[str, int]]:
    for s in shards:
        for i in range(ROWS):
            yield {"id": s * ROWS + i}


def _loader(base: IterableDataset, world: int, rank: int) -> StatefulDataLoader:
    return StatefulDataLoader(split_dataset_by_node(base, rank, world), batch_size=BATCH)


def _timed(fn: Callable[[], Any], repeats: int) -> tuple[Any, float, int]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return out, statistics.median(times), peak


def _text(base: IterableDataset, world: int, rank: int) -> tuple[str, Any]:
    dl = _loader(base, world, rank)
    it = iter(dl)
    for _ in range(STEPS):
        next(it)
    state = dl.state_dict()
    return json.dumps(position_of(dl, state), sort_keys=True, separators=(",", ":")), state


def run(world: int, repeats: int) -> dict[str, Any]:
    base = IterableDataset.from_generator(_gen, gen_kwargs={"shards": list(range(2 * world))})
    mid = world // 2
    text, state = _text(base, world, mid)
    dl = _loader(base, world, mid)
    it = iter(dl)
    for _ in range(STEPS):
        next(it)
    st = dl.state_dict()
    _, t_pos, m_pos = _timed(lambda: json.dumps(position_of(dl, st), sort_keys=True, separators=(",", ":")), repeats)
    pos = json.loads(text)
    for r in (0, world - 1):  # the other ranks' texts differ only in dp_rank (left out by a real rank: its own)
        assert json.loads(_text(base, world, r)[0]) == {**pos, "dp_rank": r}
    pos.pop("dp_rank")
    text = json.dumps(pos, sort_keys=True, separators=(",", ":"))
    texts = {r: text.encode().decode() for r in range(world)}
    _ = text
    record, t_merge, m_merge = _timed(lambda: merge_positions(texts, world), repeats)
    member = len(json.dumps(record, separators=(",", ":")))
    stored = json.loads(json.dumps(state))
    out: dict[str, Any] = {"world": world, "shards": 2 * world,
                           "rank: position": {"seconds": t_pos, "peak_bytes": m_pos, "sent_bytes": len(text)},
                           "coordinator: merge": {"seconds": t_merge, "peak_bytes": m_merge, "member_bytes": member},
                           "loads": []}
    for new_world in (world * 2, world // 2):
        out["loads"].append(_load(base, record, stored, world, new_world, repeats))
    return out


def _load(base: IterableDataset, record: dict[str, Any], stored: Any, world: int, new_world: int,
          repeats: int) -> dict[str, Any]:
    reads: list[int] = []
    looked: set[int] = set()
    rows: list[int] = []
    orig_position, orig_rows = SavedData.position, hf_streams.shard_rows

    def position(self: SavedData, r: int) -> dict[str, Any]:
        looked.add(r)
        return orig_position(self, r)

    def shard_rows(ds: Any, shard: int) -> int:
        rows.append(shard)
        return orig_rows(ds, shard)

    def read(r: int) -> Any:
        reads.append(r)
        return stored

    rank = new_world // 2
    new = _loader(base, new_world, rank)

    def reshard() -> Any:
        reads.clear()
        looked.clear()
        rows.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return restore_data("extra.dataloader", new, record, world, rank, new_world, read, "exact")

    SavedData.position, hf_streams.shard_rows = position, shard_rows  # type: ignore[method-assign]
    try:
        got, seconds, peak = _timed(reshard, repeats)
    finally:
        SavedData.position, hf_streams.shard_rows = orig_position, orig_rows  # type: ignore[method-assign]
    assert got is not None and not got.as_saved
    return {"new_world": new_world, "seconds": seconds, "peak_bytes": peak, "positions_looked_up": len(looked),
            "states_read": len(reads), "shard_lengths_read": len(rows),
            "shards_of_the_rank": len(new.dataset._ex_iterable.split_shard_indices_by_worker(new_world, rank, False))}


def _show(r: dict[str, Any]) -> None:
    p, m = r["rank: position"], r["coordinator: merge"]
    print(f"W={r['world']} ({r['shards']} shards): rank position {p['seconds'] * 1e3:.2f} ms, sends {p['sent_bytes']} B; "
          f"coordinator merge {m['seconds'] * 1e3:.1f} ms, {m['peak_bytes'] / 1e6:.2f} MB peak, record "
          f"{m['member_bytes'] / 1e3:.1f} kB")
    for ld in r["loads"]:
        print(f"  load on {ld['new_world']}: {ld['seconds'] * 1e3:.2f} ms, {ld['peak_bytes'] / 1e3:.1f} kB peak, "
              f"{ld['positions_looked_up']} saved position(s) looked up, {ld['states_read']} saved state(s) read, "
              f"{ld['shard_lengths_read']} shard length(s) read (the rank reads {ld['shards_of_the_rank']} shards)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1024, 16384])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", help="write the results as JSON")
    args = ap.parse_args(argv)
    results = []
    for w in args.worlds:
        r = run(w, args.repeats)
        _show(r)
        results.append(r)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
