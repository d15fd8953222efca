"""Scale benchmark: what a save or a load costs each rank and the coordinator
at 512 to 131,072 ranks, simulated in one process (``make bench``,
``python -m benchmarks.scale``).

Every step a rank or the coordinator runs is the real code of format
version 4; what would cross the network is built as the ranks build it and
measured pickled. Two jobs with Adam (:mod:`benchmarks.scale_jobs`): LLaMA-7B
under FSDP row sharding, and a DeepSeek-V3-like MoE (671B parameters, 256
routed experts, EP 64 x data parallel, dense weights FSDP-sharded over
every rank, the experts' replicas deduplicated by the real planner); a
third on request (``--models moe_fsdp``): the same MoE with each expert
FSDP-sharded over the ``W / 64`` data-parallel ranks of its EP index, as
torchtitan lays it out (no replicas: 281M chunks at 131,072 ranks).

- ``save plan``: one rank's vote (``vote_for``), the decoding of every
  rank's vote and the decision (``decide``), its first-save share
  (``planned_locally``); the votes' payload;
- ``commit, rank``: a middle rank's and the most loaded rank's
  ``ChunkBatch.of`` + ``build_part`` (time, memory, part size);
- ``union``: at a job's first save, the skeletons and specs the ranks send
  at its plan phase (``gather_union``) unpickled by the coordinator, and
  their union merged (``described_union``: on a thread while the ranks
  write; measured alone);
- ``commit, coordinator``: a first save's commit (the union merged) and a
  later save's (the union kept), each decoding every rank's encoded ``PartEntries``,
  adding up their elements, ``build_directory`` over W of them,
  ``metadata.json`` built and serialized, and the outcome it broadcasts
  (``outcome_of``) as every other rank unpickles it (the entries of ranks whose parts
  are not built are synthesized from real ones: :mod:`benchmarks.scale_parts`);
- ``load``: ``metadata.json`` parsed (every rank), then per rank
  ``read_parts`` + ``plan_load`` on a checkpoint in a temporary directory
  holding the real parts of the ranks the reader touches
  (:mod:`benchmarks.scale_load`; a reader touching more than ``--max-parts``
  parts is only counted), a middle rank and a rank with nothing to load;
- ``zero-redundancy``: per rank, the digest exchange and the assignment;
- beside it, DCP's ``.metadata`` for the same chunks where it fits in memory.

Times are the median of ``--repeats``; memory is the peak of Python and
NumPy allocations during the step (tracemalloc).
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import pickle
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bytecp.format import metadata as fmt
from bytecp.format.member_text import dumps
from bytecp.format.parts_build import build_directory
from bytecp.format.parts_schema import buckets_for
from bytecp.format.parts_wire import decode_all
from bytecp.loading.zero_redundancy import candidates_digest
from bytecp.plan.exchange import decide, local_plan, plan_key, planned_locally, vote_for
from bytecp.plan.planner import assign_shared
from bytecp.saving.outcome import outcome_of
from bytecp.saving.union import described_union
from bytecp.storage_api import open_storage
from bytecp.tree.bulk import gc_paused
from bytecp.tree.regions import full_region

from . import scale_jobs as jobs
from . import scale_load as sl
from . import scale_sim as sim
from .scale_dcp import dcp_metadata
from .scale_parts import Entries, real_part

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


def save_plan(job: jobs.Job, repeats: int) -> dict[str, Any]:
    rank = job.world // 2
    votes = jobs.votes(job)
    flat = jobs.rank_tree(job, rank)
    payload = pickle.dumps(votes, protocol=pickle.HIGHEST_PROTOCOL)
    del votes

    def vote() -> Any:
        plan = local_plan(flat, rank, job.world)
        return plan, vote_for(plan, plan_key(plan), None, "s", None).encode()

    tv, memv, (plan, _) = measure(vote, repeats)
    td, memd, d = measure(lambda: decide(pickle.loads(payload)), repeats)  # the all-gather's decode, the decision
    assert not d.coordinated, "the replica hints must let every rank plan alone"
    tp, memp, mine = measure(lambda: planned_locally(plan, d, split_bytes=4 << 20), max(1, repeats - 1))
    cached = pickle.dumps(jobs.votes(job, cached=d.digest), protocol=pickle.HIGHEST_PROTOCOL)
    tc, memc, dc = measure(lambda: decide(pickle.loads(cached)), repeats)
    assert dc.reuse
    return {"vote_s": tv, "vote_peak_mb": memv / 1e6, "decide_s": td, "decide_peak_mb": memd / 1e6,
            "share_s": tp, "share_peak_mb": memp / 1e6, "boxes_written": len(mine),
            "cached_s": tc, "cached_peak_mb": memc / 1e6, "votes_received_bytes": len(payload)}


def commit_ranks(job: jobs.Job, entries: Entries, repeats: int) -> dict[str, Any]:
    """A middle rank's and the most loaded rank's part (of the sampled ranks, by rows)."""
    load = {r: len(job.chunks(r)) for r in {*entries.band, job.world // 2}}
    out = {}
    for label, rank in (("middle", job.world // 2), ("most_loaded", max(load, key=lambda r: (load[r], -r)))):
        boxes = job.chunks(rank)
        t, mem, built = measure(functools.partial(real_part, job, rank, entries.buckets), repeats)
        out[label] = {"rank": rank, "rows": len(boxes), "s": t, "peak_mb": mem / 1e6,
                      "part_kb": built.entries.nbytes / 1e3, "segments": len(built.entries.rows),
                      "wide_segments": built.entries.wide_segments}
    return out


def coordinator(job: jobs.Job, entries: Entries, repeats: int) -> dict[str, Any]:
    every = entries.all()
    wire = [e.encode() for e in every]  # what each rank sends in the commit's gather
    del every
    files = sl.data_files(job)
    own, own_specs = jobs.described(job, 0)
    # one rank of every other skeleton sends its own (the MoE: the lowest rank of each other EP index)
    sent = [s[:3] for s in jobs.sent(job)]

    saves = itertools.count()

    def merged(key: str) -> Any:
        """A job's first save, at its plan phase: the union of what the ranks
        sent, merged (on the coordinator's thread while the ranks write: here waited for)."""
        union = described_union(lambda: (own, dict(own_specs), {}), [(*x, {}) for x in sent], 0, key)
        union.encoded  # noqa: B018
        return union

    @gc_paused()  # as build_metadata runs
    def build(union: Any) -> tuple[Any, int, tuple[int, fmt.Metadata]]:
        got = decode_all(wire)
        held = got.elements - union.elements  # build_metadata's check (not 0 here: entries are synthesized)
        pages, directory = build_directory(got, jobs.SAVE_ID, entries.buckets, union.tensors, union.hashes)
        md = sl.metadata_for(job, directory, files, union.skeleton, union.tensors, union.encoded)
        return directory, len(md.to_bytes()), (held, md)

    # what the coordinator receives at that plan phase (gather_union), as it unpickles it
    sent = [(r, dumps(sk), table) for r, sk, table in sent]  # (described_by: the skeleton as its text)
    payload = [pickle.dumps((sk, table, {}), protocol=pickle.HIGHEST_PROTOCOL) for _, sk, table in sent]
    t_recv, mem_recv, _ = measure(lambda: [pickle.loads(b) for b in payload], repeats)
    t_union, mem_union, union = measure(lambda: merged(f"first-{next(saves)}"), repeats)
    # the first save's commit finds the union merged; every later save of the same state reuses it
    t, mem, (directory, md_bytes, (_, md)) = measure(lambda: build(union), repeats)
    t_again, mem_again, _ = measure(lambda: build(union), repeats)
    # the outcome the commit broadcasts, as every other rank receives it (the whole metadata before)
    sent_back = pickle.dumps(outcome_of(md), protocol=pickle.HIGHEST_PROTOCOL)
    t_out, mem_out, _ = measure(lambda: pickle.loads(sent_back), repeats)
    return {"s": t, "peak_mb": mem / 1e6, "again_s": t_again, "again_peak_mb": mem_again / 1e6,
            "outcome_kb": len(sent_back) / 1e3, "outcome_s": t_out, "outcome_peak_mb": mem_out / 1e6,
            "gathered_mb": sum(map(len, wire)) / 1e6,
            "skeletons_sent": len(sent), "skeletons_mb": sum(map(len, payload)) / 1e6,
            "union_s": t_union, "union_peak_mb": mem_union / 1e6, "union_received_s": t_recv,
            "union_received_peak_mb": mem_recv / 1e6,
            "directory_mb": directory.nbytes / 1e6,
            "segments": directory.rows, "wide_segments": sum(directory.wide_pages["rows"]),
            "scalar_rows": sum(directory.scalar_pages["rows"]), "metadata_mb": md_bytes / 1e6}


def loads(job: jobs.Job, entries: Entries, repeats: int, max_parts: int) -> dict[str, Any]:
    reader = job.world // 2
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ck"
        got = sl.prepare(root, job, entries, [reader], max_parts)
        out: dict[str, Any] = {"middle": got["touched"][reader], "written": got["written"]}
        if not got["written"]:
            return out
        storage = sl.Recording(open_storage(str(root)))
        raw = storage.inner.read_bytes(fmt.METADATA_FILE)
        tm, memm, md = measure(lambda: fmt.Metadata.from_bytes(raw, storage.url), repeats)
        out |= {"metadata_parse_s": tm, "metadata_parse_peak_mb": memm / 1e6, "metadata_mb": len(raw) / 1e6,
                "parts_written": got["parts_written"]}
        written = sl.written_parts(entries)
        for label, rank in (("middle", reader), ("nothing", None)):
            t, mem, (rows, segs, reqs) = measure(functools.partial(sl.load, storage, md, job, rank, written), repeats)
            read = storage.read - {md.index.file}
            out[label] = {**out.get(label, {}), "s": t, "peak_mb": mem / 1e6, "rows": rows, "segments_read": segs,
                          "reads": reqs, "parts_read": len(read)}
            if rank is None:
                assert not storage.read and not rows, "a rank with nothing to load reads nothing"
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


def run(worlds: list[int], models: list[str], repeats: int, dcp_worlds: dict[str, list[int]],
        max_parts: int, big_repeats_from: int) -> dict[str, Any]:
    results: dict[str, Any] = {"worlds": {}}
    for world in worlds:
        rep = 1 if world >= big_repeats_from else repeats
        row: dict[str, Any] = {"zero_redundancy": zero_redundancy(world, rep)}
        for name in models:
            job = jobs.JOBS[name](world)
            t0 = time.perf_counter()
            entries = Entries(job, buckets_for(world))
            c: dict[str, Any] = {"label": job.label, "chunks": job.chunk_count(), "tensors": len(job.specs()),
                                 "setup_s": time.perf_counter() - t0}
            c["save_plan"] = save_plan(job, rep)
            c["commit_rank"] = commit_ranks(job, entries, rep)
            c["coordinator"] = coordinator(job, entries, rep)
            c["load"] = loads(job, entries, rep, max_parts)
            if world in dcp_worlds.get(name, []):
                c["dcp"] = dcp_metadata(job, rep)
            del entries
            gc.collect()
            row[name] = c
            print(json.dumps({"world": world, name: c}, default=str)[:3000], flush=True)
        results["worlds"][str(world)] = row
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="512,4096,16384,65536,131072", help="simulated world sizes")
    p.add_argument("--models", default="llama,moe", help="of llama, moe, moe_fsdp (the MoE with its experts "
                   "FSDP-sharded over data parallel, torchtitan's layout: 281M chunks at 131,072 ranks)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--big-repeats-from", type=int, default=16384, help="one repeat from this world size on")
    p.add_argument("--dcp-llama", default="512,4096", help="worlds where DCP's .metadata is built for LLaMA")
    p.add_argument("--dcp-moe", default="512", help="worlds where DCP's .metadata is built for the MoE")
    p.add_argument("--max-parts", type=int, default=3000, help="most real parts written for a reader")
    p.add_argument("--out", default="scale.json")
    args = p.parse_args(argv)
    ints = lambda s: [int(w) for w in s.split(",") if w]  # noqa: E731
    results = run(ints(args.worlds), args.models.split(","), args.repeats,
                  {"llama": ints(args.dcp_llama), "moe": ints(args.dcp_moe)}, args.max_parts, args.big_repeats_from)
    Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    from .scale_table import table

    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
