"""Data positions at scale: what recording a data loader's position costs each
rank and the coordinator of a W-rank save, and what resharding it costs each
rank of a load on another number of ranks (``python -m benchmarks.scale_data``).

Every step is the real code on real torchdata loaders
(``StatefulDataLoader`` + ``DistributedSampler`` over ``64 * W`` samples,
batch 4 per rank, 6 steps drawn); the W ranks are simulated in one process,
as :mod:`benchmarks.scale` does: what a rank would send is built as it builds
it and measured.

- ``rank: position``: one rank's ``position_of`` (the adapter, at describe)
  and its JSON text (what it sends to the commit), beside its whole loader
  state (what it saves per rank anyway, read back only by a load at the
  same world size);
- ``coordinator: merge``: ``merge_positions`` over the W texts (ranks at one
  point of a synchronous run send the same text; and, for the worst case,
  every rank a different ``samples`` value), the merged record's size in
  ``metadata.json`` (``data``): what every loading rank receives;
- ``rank: reshard``: a loading rank of W' = 3W/4 ranks (and 2W) decides
  from the merged record (``restore_data``): the saved ranks' states it
  reads (one: the seeds) and their bytes, the time; beside what reading
  every saved rank's state would read, and the size of the per-rank table
  of the loader's whole states in ``metadata.json`` (every rank's, as for any
  per-rank value: what a load at the same world size restores);
- ``every loading rank: per_rank table``: what that table costs each
  loading rank, whatever it restores: the coordinator parses it out of
  ``metadata.json`` (its JSON into one ``ObjectRecord`` per rank, as
  ``Metadata.from_bytes`` does) and broadcasts the parsed metadata, which
  every rank unpickles; both timed on the table alone, for the torchdata
  loader's states and for Megatron-LM's counters (``MegatronLMData``: three
  integers per rank).

Times are the median of ``--repeats``; memory the peak of Python allocations
(tracemalloc) of one traced run.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time
import tracemalloc
import warnings
from collections.abc import Callable
from typing import Any

from bytecp.adapters.megatron.data import MegatronLMData
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from bytecp.data import position_of
from bytecp.data.positions import merge_positions
from bytecp.data.restore import restore_data
from bytecp.format.metadata import ObjectRecord
from bytecp.format.objects import serialize
from bytecp.format.rank_records import RankRecords

__all__ = ["main", "run"]

PER_RANK = 64
BATCH = 4
STEPS = 6  # 24 samples per rank: a multiple of the new world sizes


def _loader(world: int, rank: int, n: int) -> StatefulDataLoader:
    data = range(n)
    s = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=3)  # type: ignore[arg-type]
    s.set_epoch(2)
    return StatefulDataLoader(data, batch_size=BATCH, sampler=s)  # type: ignore[arg-type]


def _timed(fn: Callable[[], Any], repeats: int) -> tuple[Any, float, int]:
    """(result, median seconds, peak bytes of Python allocations)."""
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


def run(world: int, repeats: int) -> dict[str, Any]:
    n = PER_RANK * world
    # -- every rank at its save: a real loader 5 steps in
    saved_rank = world // 2
    dl = _loader(world, saved_rank, n)
    it = iter(dl)
    for _ in range(STEPS):
        next(it)
    state = dl.state_dict()

    def describe() -> str:
        return json.dumps(position_of(dl, state), sort_keys=True, separators=(",", ":"))

    text, t_pos, m_pos = _timed(describe, repeats)
    whole = serialize("extra.dataloader", state, False)
    whole_bytes = len(json.dumps(whole.json)) if whole.blob is None else len(whole.blob)
    # the loader's states as metadata.json's per_rank member lists them (inline JSON records, every rank's)
    table = len(json.dumps({"extra.dataloader": {str(r): {"json": whole.json} for r in range(world)}},
                           separators=(",", ":"))) if whole.blob is None else None
    # ranks at the same point send the same text (checked on a few real ones)
    for r in (0, world - 1):
        other = _loader(world, r, n)
        oi = iter(other)
        for _ in range(STEPS):
            next(oi)
        assert json.dumps(position_of(other, other.state_dict()), sort_keys=True, separators=(",", ":")) == text
    texts = {r: text.encode().decode() for r in range(world)}  # one string per rank, as unpickled at the commit
    record, t_merge, m_merge = _timed(lambda: merge_positions(texts, world), repeats)
    gathered = world * len(pickle.dumps(text))  # each rank's text in its own message
    member = len(json.dumps(record, separators=(",", ":")))
    pos = json.loads(text)
    uneven = {r: json.dumps({**pos, "samples": pos["samples"] - (r % 2)}, sort_keys=True) for r in range(world)}
    rec_uneven, t_uneven, m_uneven = _timed(lambda: merge_positions(uneven, world), repeats)
    out: dict[str, Any] = {
        "world": world,
        "rank: position": {"seconds": t_pos, "peak_bytes": m_pos, "sent_bytes": len(text),
                           "whole_state_bytes": whole_bytes, "per_rank_table_bytes": table},
        "coordinator: merge": {"seconds": t_merge, "peak_bytes": m_merge, "gathered_bytes": gathered,
                               "member_bytes": member},
        "coordinator: merge, every rank apart": {"seconds": t_uneven, "peak_bytes": m_uneven,
                                                 "member_bytes": len(json.dumps(rec_uneven, separators=(",", ":")))},
        "loads": [],
    }
    megatron = MegatronLMData(argparse.Namespace(consumed_train_samples=24 * world, skipped_train_samples=0,
                                                  consumed_valid_samples=0, micro_batch_size=BATCH,
                                                  data_parallel_size=world)).state_dict()
    out["every loading rank: per_rank table"] = {
        "torchdata": _table_cost("extra.dataloader", whole.json, world, repeats) if whole.blob is None else None,
        "megatron_lm": _table_cost("data", megatron, world, repeats)}
    stored = json.loads(json.dumps(state))
    for new_world in (world * 3 // 4, world * 2):
        out["loads"].append(_load(record, stored, world, new_world, n, repeats, member, whole_bytes))
    return out


def _table_cost(fqn: str, value: Any, world: int, repeats: int) -> dict[str, Any]:
    """The per_rank table of ``world`` alike inline states: its JSON parsed
    into records (the coordinator), the parsed table pickled and unpickled
    (the broadcast every rank receives)."""
    text = json.dumps({fqn: {str(r): {"json": value} for r in range(world)}}, separators=(",", ":")).encode()

    def parse() -> dict[str, dict[int, ObjectRecord]]:
        return {k: {int(r): ObjectRecord.from_json(rec) for r, rec in v.items()} for k, v in json.loads(text).items()}

    table, t_parse, m_parse = _timed(parse, repeats)
    blob = pickle.dumps(table)  # the records themselves (bytecp before RankRecords)
    _, t_unpickle, m_unpickle = _timed(lambda: pickle.loads(blob), repeats)
    records = {k: RankRecords(v, ObjectRecord.from_json) for k, v in table.items()}  # what Metadata.from_bytes holds now
    packed, t_pack, _ = _timed(lambda: pickle.dumps(records), repeats)

    def receive() -> Any:  # a loading rank: unpickle, then look up its own record
        got = pickle.loads(packed)
        return got[fqn][world // 2]

    _, t_receive, m_receive = _timed(receive, repeats)
    return {"json_bytes": len(text), "parse_seconds": t_parse, "parse_peak_bytes": m_parse,
            "broadcast_bytes": len(blob), "unpickle_seconds": t_unpickle, "unpickle_peak_bytes": m_unpickle,
            "rank_records": {"broadcast_bytes": len(packed), "pickle_seconds": t_pack,
                             "receive_seconds": t_receive, "receive_peak_bytes": m_receive}}


def _load(record: dict[str, Any], stored: Any, world: int, new_world: int, n: int, repeats: int, member: int,
          whole_bytes: int) -> dict[str, Any]:
    """A middle rank of ``new_world`` decides and builds its state from the merged record."""
    reads: list[int] = []

    def read(r: int) -> Any:
        reads.append(r)
        return stored  # (every saved rank's state has this size)

    new = _loader(new_world, new_world // 2, n)

    def reshard() -> Any:
        reads.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return restore_data("extra.dataloader", new, record, world, new_world // 2, new_world, read, "exact")

    got, seconds, peak = _timed(reshard, repeats)
    assert got is not None and not got.as_saved
    return {"new_world": new_world, "seconds": seconds, "peak_bytes": peak, "states_read": len(reads),
            "bytes_read": member + len(reads) * whole_bytes, "every_state_would_read": world * whole_bytes}


def _show(r: dict[str, Any]) -> None:
    p, m, u = r["rank: position"], r["coordinator: merge"], r["coordinator: merge, every rank apart"]
    print(f"W={r['world']}: rank position {p['seconds'] * 1e6:.0f} us, sends {p['sent_bytes']} B "
          f"(its whole loader state {p['whole_state_bytes']} B); coordinator merge {m['seconds'] * 1e3:.2f} ms, "
          f"{m['peak_bytes'] / 1e6:.2f} MB peak, gathered {m['gathered_bytes'] / 1e6:.2f} MB, record "
          f"{m['member_bytes']} B; every rank apart: {u['seconds'] * 1e3:.1f} ms, record {u['member_bytes'] / 1e3:.1f} kB; "
          f"the states' per_rank table in metadata.json {(p['per_rank_table_bytes'] or 0) / 1e6:.2f} MB")
    for kind, c in r["every loading rank: per_rank table"].items():
        if c is not None:
            print(f"  per_rank table of {kind}: {c['json_bytes'] / 1e6:.2f} MB JSON, parsed in "
                  f"{c['parse_seconds'] * 1e3:.1f} ms ({c['parse_peak_bytes'] / 1e6:.1f} MB peak); broadcast "
                  f"{c['broadcast_bytes'] / 1e6:.2f} MB, unpickled by every rank in {c['unpickle_seconds'] * 1e3:.1f} ms "
                  f"({c['unpickle_peak_bytes'] / 1e6:.1f} MB peak); as RankRecords: broadcast "
                  f"{c['rank_records']['broadcast_bytes'] / 1e6:.2f} MB (pickled in "
                  f"{c['rank_records']['pickle_seconds'] * 1e3:.1f} ms), unpickled and its own record read by a rank "
                  f"in {c['rank_records']['receive_seconds'] * 1e3:.1f} ms "
                  f"({c['rank_records']['receive_peak_bytes'] / 1e6:.1f} MB peak)")
    for ld in r["loads"]:
        print(f"  load on {ld['new_world']}: {ld['seconds'] * 1e6:.0f} us, {ld['peak_bytes'] / 1e3:.1f} kB peak, "
              f"{ld['states_read']} saved state(s) read, {ld['bytes_read']} B in all "
              f"(every saved state: {ld['every_state_would_read'] / 1e6:.2f} MB)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1024, 16384, 131072])
    ap.add_argument("--repeats", type=int, default=5)
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
