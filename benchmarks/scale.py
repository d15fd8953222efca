"""Scale benchmark: what a save or a load costs each rank and the coordinator
at 512 to 16,384 ranks, simulated in one process (``make bench``,
``python -m benchmarks.scale``).

Every step a rank or the coordinator runs is the real code (plan votes and
the decision, the commit's index build, the per-rank index reads and load
plan, the zero-redundancy assignment); what would cross the network is
built as the ranks build it and measured pickled. Beside it, DCP's
``.metadata`` for the same chunks: its size, the time and memory to unpickle
it (every DCP rank does) and DCP's per-rank read plan.

Cases (a LLaMA-7B-shaped model, FSDP row sharding; a 1.3B GPT under DDP):

- ``save plan``: one rank's first-save plan (describe its boxes, vote,
  decide from every rank's vote, its share) and the votes' payload;
- ``cached save``: the same when every rank's plan is cached;
- ``commit``: the coordinator's index build from every rank's chunk records;
- ``load plan``: per rank, the index segments its targets meet (read,
  checked, decoded) and its read plan, for a middle rank, the last rank and
  a rank with nothing to load; the coordinator's metadata read;
- ``zero-redundancy``: per rank, the digest exchange and the assignment.

Times are the median of ``--repeats``; memory is the peak of Python and
NumPy allocations during the step (tracemalloc).
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bytecp.format import index_read
from bytecp.format import metadata as fmt
from bytecp.format.index_build import build_index
from bytecp.format.index_check import check_rows
from bytecp.loading.zero_redundancy import candidates_digest
from bytecp.plan.exchange import decide, local_plan, plan_key, planned_locally, vote_for
from bytecp.plan.load_plan import plan_load
from bytecp.plan.planner import assign_shared
from bytecp.storage_api import open_storage
from bytecp.tree.regions import Region, full_region
from bytecp.tree.skeleton import Node

from . import scale_sim as sim

__all__ = ["main", "run"]


def measure(fn: Callable[[], Any], repeats: int) -> tuple[float, int, Any]:
    """(median seconds of ``repeats`` runs, peak bytes allocated in one more
    run under tracemalloc -- which slows Python down, so it is not timed --,
    the result)."""
    times, out = [], None
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    gc.collect()
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return statistics.median(times), peak, out


def save_plan(model: dict[str, tuple[int, ...]], world: int, repeats: int) -> dict[str, Any]:
    rank = world // 2
    votes = sim.fsdp_votes(model, world)
    flat = sim.fsdp_rank_tree(model, world, rank)
    payload = pickle.dumps(votes, protocol=pickle.HIGHEST_PROTOCOL)

    def first() -> Any:
        plan = local_plan(flat, rank, world)
        vote_for(plan, plan_key(plan), None, "s", None)
        d = decide(pickle.loads(payload))  # the all-gather's decode, then the decision
        return planned_locally(plan, d, split_bytes=4 << 20)

    t, mem, mine = measure(first, repeats)
    digest = decide(votes).digest
    cached_payload = pickle.dumps(sim.fsdp_votes(model, world, cached=digest), protocol=pickle.HIGHEST_PROTOCOL)
    cached_votes = pickle.loads(cached_payload)
    tc, memc, d = measure(lambda: decide(cached_votes), repeats)
    assert d.reuse
    td, _, _ = measure(lambda: pickle.loads(cached_payload), repeats)
    return {
        "first_save_s": t, "first_save_peak_mb": mem / 1e6, "boxes_written": len(mine),
        "cached_save_s": tc, "cached_save_peak_mb": memc / 1e6, "votes_decode_s": td,
        "vote_bytes_per_rank": len(payload) // world, "votes_received_bytes": len(payload),
        "coordinator_gathers_plans": decide(votes).coordinated,
    }


def commit(model: dict[str, tuple[int, ...]], world: int, adam: bool, repeats: int) -> tuple[dict[str, Any], Any]:
    batches = sim.fsdp_batches(model, world, adam=adam)
    wire = [pickle.dumps(b, protocol=pickle.HIGHEST_PROTOCOL) for b in batches]
    tensors, files = sim.specs(model, adam), sim.data_files(batches)

    def build() -> Any:
        got = [pickle.loads(w) for w in wire]
        return build_index(got, tensors, files, "20261123T000000-00000000")

    t, mem, built = measure(build, repeats)
    rows = sum(len(b) for b in batches)
    return {
        "chunks": rows, "commit_s": t, "commit_peak_mb": mem / 1e6,
        "chunk_bytes_per_rank": sum(map(len, wire)) // world, "gathered_mb": sum(map(len, wire)) / 1e6,
        "index_mb": built.directory.nbytes / 1e6, "segments": built.directory.segments,
        "buckets": built.directory.buckets,
    }, (built, tensors, files)


def write_checkpoint(root: Path, built: Any, tensors: dict[str, Any], files: dict[str, int], world: int) -> Path:
    for fqn, d in built.band_dims.items():
        tensors[fqn] = {**tensors[fqn], "band_dim": d}
    md = fmt.Metadata(save_id="20261123T000000-00000000", world_size=world, framework="fsdp2", parallelism={},
                      skeleton=Node.container("dict", ()), tensors=tensors, objects={}, per_rank={},
                      index_files=[], data_files=files, index=built.directory)
    (root / "index" / md.save_id).mkdir(parents=True)
    (root / built.directory.file).write_bytes(b"".join(built.blobs))
    (root / "metadata.json").write_bytes(md.to_bytes())
    return root


def load_plan(root: Path, model: dict[str, tuple[int, ...]], world: int, adam: bool, repeats: int) -> dict[str, Any]:
    storage = open_storage(str(root))
    tc, memc, md = measure(lambda: fmt.Metadata.from_bytes(storage.read_bytes(fmt.METADATA_FILE), storage.url), repeats)
    out: dict[str, Any] = {"coordinator_metadata_s": tc, "coordinator_peak_mb": memc / 1e6,
                           "metadata_json_mb": len(storage.read_bytes(fmt.METADATA_FILE)) / 1e6}

    def targets(rank: int) -> list[tuple[str, Region]]:
        return [(fqn, sim.row_box(shape, world, rank) if sharded else full_region(shape))
                for fqn, shape, sharded in sim.fsdp_tensors(model, adam)]

    for label, rank in (("middle", world // 2), ("last", world - 1), ("nothing", None)):
        own = [t for t in targets(rank) if t[1].numel] if rank is not None else []

        def plan(own: list[tuple[str, Region]] = own) -> tuple[int, int]:
            wanted: dict[str, list[Region]] = {}
            for fqn, box in own:
                wanted.setdefault(fqn, []).append(box)
            segs = index_read.wanted_segments(md, wanted)
            chunks = index_read.read_segments(storage, md, segs, fqns=set(wanted))
            check_rows(storage.url, md, chunks)
            sizes = {fqn: 4 for fqn in wanted}
            reqs = plan_load(own, chunks, itemsizes=sizes)
            d = md.index
            nb = len(d.band["bucket"])
            read = sum((d.band if s < nb else d.wide)["nbytes"][s if s < nb else s - nb] for s in segs)
            return read, len(reqs)

        t, mem, (read, nreq) = measure(plan, repeats)
        out[label] = {"s": t, "peak_mb": mem / 1e6, "index_read_mb": read / 1e6, "reads": nreq}
    return out


def zero_redundancy(world: int, repeats: int) -> dict[str, Any]:
    model = sim.ddp_model()
    mine = sorted((f"model.{n}", full_region(s)) for n, s in model.items())
    sizes = {f: 4 for f, _ in mine}
    digests = pickle.dumps([candidates_digest(mine)] * world, protocol=pickle.HIGHEST_PROTOCOL)

    def assign() -> int:
        got = pickle.loads(digests)
        assert all(g == got[0] for g in got)
        return len(assign_shared(mine, world, sizes)[world // 2])

    t, mem, pieces = measure(assign, repeats)
    return {"s": t, "peak_mb": mem / 1e6, "digest_bytes_received": len(digests), "pieces_of_middle_rank": pieces,
            "model_gb": sim.nbytes(model) / 1e9}


def dcp_metadata(model: dict[str, tuple[int, ...]], world: int, adam: bool, repeats: int) -> dict[str, Any]:
    """DCP's ``.metadata`` for the same chunks: size, unpickle, a rank's read plan."""
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

    sd_md: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for fqn, shape, sharded in sim.fsdp_tensors(model, adam):
        chunks = []
        for r in range(world) if sharded else [0]:
            box = sim.row_box(shape, world, r) if sharded else full_region(shape)
            if sharded and not box.numel:
                continue
            off, size = torch.Size(box.offsets), torch.Size(box.lengths)
            chunks.append(ChunkStorageMetadata(off, size))
            storage[MetadataIndex(fqn, off)] = _StorageInfo(f"__{r}_0.distcp", 0, 4 * box.numel)
        sd_md[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), chunks)
    blob = pickle.dumps(Metadata(sd_md, storage_data=storage), protocol=pickle.HIGHEST_PROTOCOL)
    del sd_md, storage
    t, mem, md = measure(lambda: pickle.loads(blob), max(1, repeats - 1))
    rank = world // 2

    def plan() -> int:
        n = 0
        for fqn, shape, sharded in sim.fsdp_tensors(model, adam):
            box = sim.row_box(shape, world, rank) if sharded else full_region(shape)
            if box.numel:
                local = [ChunkStorageMetadata(torch.Size(box.offsets), torch.Size(box.lengths))]
                n += len(create_read_items_for_chunk_list(fqn, md.state_dict_metadata[fqn], local))
        return n

    tp, memp, _ = measure(plan, repeats)
    return {"metadata_mb": len(blob) / 1e6, "unpickle_s": t, "unpickle_peak_mb": mem / 1e6,
            "rank_plan_s": tp, "rank_plan_peak_mb": memp / 1e6}


def run(worlds: list[int], repeats: int, dcp: bool, adam_worlds: list[int]) -> dict[str, Any]:
    model = sim.llama7b()
    results: dict[str, Any] = {"model": "LLaMA-7B shapes (291 weights), FSDP row sharding", "worlds": {}}
    for world in worlds:
        row: dict[str, Any] = {"save_plan": save_plan(model, world, repeats),
                               "zero_redundancy": zero_redundancy(world, repeats)}
        for adam in (False, True) if world in adam_worlds else (False,):
            key = "model_adam" if adam else "model"
            c, built = commit(model, world, adam, max(1, repeats - 1))
            with tempfile.TemporaryDirectory() as tmp:
                root = write_checkpoint(Path(tmp) / "ck", *built, world)
                del built
                c["load_plan"] = load_plan(root, model, world, adam, repeats)
            if dcp:
                c["dcp"] = dcp_metadata(model, world, adam, repeats)
            row[key] = c
            print(json.dumps({"world": world, key: c}, indent=None)[:2000], flush=True)
        results["worlds"][str(world)] = row
        print(json.dumps({"world": world, "save_plan": row["save_plan"], "zr": row["zero_redundancy"]}), flush=True)
    return results


def table(results: dict[str, Any]) -> str:
    lines = ["| W | chunks | first save plan (rank) | cached save (rank) | commit (coordinator) | "
             "load: coordinator | load: middle rank | load: rank with nothing | zero-redundancy (rank) | "
             "DCP .metadata unpickle (every rank) | DCP read plan (rank) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for world, row in results["worlds"].items():
        sp, zr = row["save_plan"], row["zero_redundancy"]
        for key in ("model", "model_adam"):
            c = row.get(key)
            if c is None:
                continue
            lp, dcp = c["load_plan"], c.get("dcp")
            lines.append(
                f"| {world} | {c['chunks'] / 1e6:.2f}M{' (+Adam)' if key == 'model_adam' else ''} "
                f"| {sp['first_save_s'] * 1e3:.0f} ms, {sp['first_save_peak_mb']:.1f} MB "
                f"| {sp['cached_save_s'] * 1e3:.1f} ms (+{sp['votes_decode_s'] * 1e3:.0f} ms decoding {sp['votes_received_bytes'] / 1e6:.1f} MB of votes) "
                f"| {c['commit_s']:.2f} s, {c['commit_peak_mb']:.0f} MB ({c['gathered_mb']:.0f} MB gathered) "
                f"| {lp['coordinator_metadata_s'] * 1e3:.0f} ms ({lp['metadata_json_mb']:.1f} MB metadata.json) "
                f"| {lp['middle']['s'] * 1e3:.0f} ms, {lp['middle']['peak_mb']:.1f} MB, {lp['middle']['index_read_mb']:.2f} MB read "
                f"| {lp['nothing']['s'] * 1e3:.2f} ms "
                f"| {zr['s'] * 1e3:.0f} ms, {zr['digest_bytes_received'] / 1e3:.0f} kB in "
                + (f"| {dcp['unpickle_s']:.1f} s, {dcp['unpickle_peak_mb']:.0f} MB ({dcp['metadata_mb']:.0f} MB file) "
                   f"| {dcp['rank_plan_s']:.2f} s |" if dcp else "| – | – |")
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="512,4096,16384", help="simulated world sizes")
    p.add_argument("--adam-worlds", default="4096", help="world sizes also run with Adam state (4x the chunks)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-dcp", action="store_true", help="skip DCP's metadata (slow to build at large W)")
    p.add_argument("--out", default="scale.json")
    args = p.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    adam = [int(w) for w in args.adam_worlds.split(",") if w]
    results = run(worlds, args.repeats, not args.no_dcp, adam)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
