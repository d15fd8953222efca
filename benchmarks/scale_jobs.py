"""Simulated jobs of the scale benchmark: which chunks every rank writes and
which boxes it loads, for a dense model under FSDP and a mixture of experts
under expert and data parallelism, with Adam, at up to 131,072 ranks.

- :class:`Job` -- the layout: dense weights (and their ``exp_avg`` /
  ``exp_avg_sq``) row-sharded over every rank as FSDP2 shards them; with
  ``ep > 1`` each routed expert held whole by one rank of every EP group
  (rank ``g + ep * j`` holds the experts of EP index ``g``: ``ep`` ranks per
  group, ``W / ep`` replicas) and deduplicated as the planner does: every
  replica set (EP index) planned by
  :func:`~bytecp.plan.planner.plan_replicated` over its holders, from the
  base load the votes carry (a rank's own FSDP bytes), so a 59 MB expert
  weight is cut along dim 0 into pieces of at least 1 MiB among its
  holders; Adam's ``step`` (one 0-dim tensor per parameter) written by the
  least-loaded ranks, the highest: ``step`` ``i`` by rank ``W - 1 - i % W``;
  with ``expert_fsdp`` (torchtitan's layout) each routed expert's tensors
  are instead FSDP-sharded along dim 0 over the ``W / ep`` ranks of its EP
  index (rank ``g + ep * j`` holds row shard ``j``, ``ceil(rows / (W / ep))``
  rows, the last ranks possibly none), each shard held once: no replica
  set, nothing for the planner to deduplicate;
- :meth:`Job.chunks` / :meth:`Job.batch` -- one rank's chunk records after
  its write, as its commit has them;
- :meth:`Job.targets` -- one rank's boxes at a load by the same layout;
- :meth:`Job.chunk_count` -- the chunks of the whole save, counted, never built.

Every number is computed as the real code computes it; nothing holds every
rank's chunks at once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np

from bytecp.format import metadata as fmt
from bytecp.format.checksum import block_count, writer_block_bytes
from bytecp.format.chunk_batch import ChunkBatch
from bytecp.format.parts_schema import box_bands, buckets_for, span_limit
from bytecp.plan.planner import WriteItem, plan_replicated
from bytecp.tree.regions import Region, full_region

from . import scale_sim as sim

__all__ = ["Job", "SAVE_ID", "llama_job", "moe_job", "moe_fsdp_job", "JOBS", "described", "sent", "union"]

SAVE_ID = "20261123T000000-00000000"
STATES = ("exp_avg", "exp_avg_sq")
F32 = "float32"
Box = tuple[str, Region]


@dataclasses.dataclass(eq=False)
class Job:
    label: str
    world: int
    #: dense weights: name -> shape (FSDP row-sharded over every rank)
    dense: dict[str, tuple[int, ...]]
    #: routed experts: per expert, name -> shape (empty: a dense model)
    experts: list[dict[str, tuple[int, ...]]] = dataclasses.field(default_factory=list)
    ep: int = 1
    #: routed experts FSDP-sharded over the ``W / ep`` ranks of their EP index (torchtitan), not held whole
    expert_fsdp: bool = False

    def __post_init__(self) -> None:
        self.sharded = [(f, s) for name, s in self.dense.items() for f in _states(name)]
        per = len(self.experts) // self.ep if self.experts else 0
        #: per EP index, its experts' tensors (weights and Adam states)
        self.groups: list[list[tuple[str, tuple[int, ...]]]] = [
            [(f, s) for e in range(g * per, (g + 1) * per) for name, s in self.experts[e].items()
             for f in _states(name)] for g in range(self.ep if self.experts else 0)]
        params = list(self.dense) + [n for e in self.experts for n in e]
        self.steps = [f"optimizer.state.{n}.step" for n in params]
        self.step_id = {f: i for i, f in enumerate(self.steps)}
        if self.experts and self.world % self.ep:
            raise ValueError(f"W={self.world} is not a multiple of EP {self.ep}")

    # -- the whole job, counted -------------------------------------------------------------
    def specs(self) -> dict[str, dict[str, Any]]:
        """Every tensor's spec, as metadata.json lists it."""
        out = {f: {"dtype": F32, "shape": list(s)} for f, s in self.sharded}
        out |= {f: {"dtype": F32, "shape": list(s)} for g in self.groups for f, s in g}
        out |= {f: {"dtype": F32, "shape": []} for f in self.steps}
        return out

    def holders(self) -> int:
        return self.world // self.ep

    def chunk_count(self) -> int:
        dense = sum(_shards(s[0], self.world) for _, s in self.sharded)
        if self.expert_fsdp:  # every EP index's experts have the same shapes
            experts = sum(_shards(s[0], self.holders()) for _, s in self.groups[0]) * len(self.groups)
        else:
            experts = sum(len(ch) for ch in self.expert_plan(0).values()) * len(self.groups)
        return dense + experts + len(self.steps)

    def own_bytes(self) -> np.ndarray:
        """Per rank, the bytes of the FSDP rows only it holds (its vote's ``own_bytes``)."""
        w = self.world
        ranks = np.arange(w, dtype=np.int64)
        out = np.zeros(w, np.int64)
        by_rows: dict[tuple[int, int], int] = {}
        for _, s in self.sharded:
            key = (s[0], 4 * math.prod(s[1:]))
            by_rows[key] = by_rows.get(key, 0) + 1
        for (rows, row_bytes), n in by_rows.items():
            step = -(-rows // w)
            out += n * row_bytes * np.clip(rows - ranks * step, 0, step)
        if self.expert_fsdp:  # a rank's expert shards are its own too (same shapes in every EP index)
            h, j = self.holders(), ranks // self.ep
            for _, s in self.groups[0]:
                step = -(-s[0] // h)
                out += 4 * math.prod(s[1:]) * np.clip(s[0] - j * step, 0, step)
        return out

    @functools.cached_property
    def _own(self) -> np.ndarray:
        return self.own_bytes()

    @functools.lru_cache(maxsize=4)  # noqa: B019 - a job lives for one world's run
    def expert_plan(self, g: int) -> dict[int, list[WriteItem]]:
        """What each holder of EP index ``g``'s experts writes of them (the planner's share)."""
        if not self.groups or self.expert_fsdp:
            return {}
        items = [WriteItem(f, full_region(s), F32, 4, s) for f, s in self.groups[g]]
        ranks = list(range(g, self.world, self.ep))
        base = {r: int(self._own[r]) for r in ranks}
        return plan_replicated(items, ranks, base)  # type: ignore[arg-type]

    # -- one rank --------------------------------------------------------------------------------
    def step_writer(self, i: int) -> int:
        return self.world - 1 - i % self.world

    def chunks(self, rank: int, *, experts: bool = True) -> list[Box]:
        """(fqn, box) of every chunk rank ``rank`` writes."""
        out = [(f, b) for f, s in self.sharded if (b := sim.row_box(s, self.world, rank)).numel]
        out += [(self.steps[i], full_region(())) for i in range(self.world - 1 - rank, len(self.steps), self.world)]
        if experts and self.expert_fsdp:
            out += self.expert_shards(rank)
        elif experts and self.groups:
            out += [(it.fqn, it.region) for it in self.expert_plan(rank % self.ep).get(rank, [])]
        return out

    def expert_shards(self, rank: int) -> list[Box]:
        """(``expert_fsdp``) rank ``rank``'s row shards of its EP index's experts (the non-empty ones)."""
        h, j = self.holders(), rank // self.ep
        return [(f, b) for f, s in self.groups[rank % self.ep] if (b := sim.row_box(s, h, j)).numel]

    def tiled_by_wide(self, fqn: str, boxes: list[Region]) -> bool:
        """Whether this layout's rows of ``fqn`` that a reader's ``boxes`` (of
        the same layout) need are all wide, so that wide rows tile the boxes:
        an expert weight cut into pieces by the planner; with ``expert_fsdp``
        an expert shard that meets more bands than the span limit (a rank's
        box is its own row)."""
        if ".experts." not in fqn or not self.groups or fqn in self.step_id:
            return False
        if not self.expert_fsdp:
            return True
        buckets = buckets_for(self.world)
        shape, limit = self._shapes[fqn], span_limit(buckets)
        for b in boxes:
            lo, hi = box_bands(b.offsets, b.lengths, shape, buckets) if b.numel else (0, limit)
            if hi - lo + 1 <= limit:
                return False
        return True

    def batch(self, boxes: list[Box], rank: int) -> tuple[ChunkBatch, dict[str, dict[str, Any]], dict[str, int]]:
        """Rank ``rank``'s chunk records (one data file, 4 KiB-aligned boxes) as
        its commit has them; its tensor specs; its data file."""
        rank_file = f"data/{SAVE_ID}/{rank}-0.bin"
        recs, pos = [], 0
        specs: dict[str, dict[str, Any]] = {}
        for fqn, box in boxes:
            shape = self.shape(fqn)
            n = 4 * box.numel
            blocks = bytes(4 * block_count(n, writer_block_bytes()))  # (their values do not matter here, their size does)
            recs.append(fmt.ChunkRecord(fqn, F32, shape, box.offsets, box.lengths, rank_file, pos, n, 1234, blocks))
            pos += -(-n // fmt.ALIGNMENT) * fmt.ALIGNMENT
            specs[fqn] = {"dtype": F32, "shape": list(shape)}
        return ChunkBatch.of(recs), specs, {rank_file: pos}

    def shape(self, fqn: str) -> tuple[int, ...]:
        if fqn in self.step_id:
            return ()
        return self._shapes[fqn]

    @functools.cached_property
    def _shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self.sharded) | {f: s for g in self.groups for f, s in g}

    def targets(self, rank: int) -> list[Box]:
        """(fqn, box) rank ``rank`` loads at a resume by the same layout: its
        FSDP rows, its experts whole, the ``step`` of every parameter it holds."""
        out = [(f, b) for f, s in self.sharded if (b := sim.row_box(s, self.world, rank)).numel]
        params = list(self.dense)
        if self.groups:
            g = rank % self.ep
            out += self.expert_shards(rank) if self.expert_fsdp else [(f, full_region(s)) for f, s in self.groups[g]]
            per = len(self.experts) // self.ep
            params += [n for e in range(g * per, (g + 1) * per) for n in self.experts[e]]
        out += [(f"optimizer.state.{n}.step", full_region(())) for n in params]
        return out

    def writers_of(self, fqn: str, rank: int) -> list[int]:
        """The ranks whose chunks of ``fqn`` a rank's target of it meets (same layout)."""
        if fqn in self.step_id:
            return [self.step_writer(self.step_id[fqn])]
        if self.groups and ".experts." in fqn and not self.expert_fsdp:
            return sorted(r for r, items in self.expert_plan(rank % self.ep).items() if any(i.fqn == fqn for i in items))
        return [rank]


def _shards(rows: int, n: int) -> int:
    """The non-empty row shards of a tensor of ``rows`` rows over ``n`` ranks (FSDP2: ``ceil(rows / n)`` each)."""
    return min(rows, -(-rows // -(-rows // n)))


def _states(name: str) -> list[str]:
    return [f"model.{name}", *(f"optimizer.state.{name}.{st}" for st in STATES)]


def llama_job(world: int) -> Job:
    return Job("LLaMA-7B + Adam, FSDP", world, sim.llama7b())


def moe_job(world: int, ep: int = 64) -> Job:
    dense, experts = sim.deepseek_v3()
    return Job(f"DeepSeek-V3-like MoE + Adam, EP {ep} x DP {world // ep} (dense: FSDP over all)", world, dense,
               experts, ep)


def moe_fsdp_job(world: int, ep: int = 64) -> Job:
    dense, experts = sim.deepseek_v3()
    return Job(f"DeepSeek-V3-like MoE + Adam, EP {ep}, experts FSDP over DP {world // ep} (torchtitan; dense: FSDP "
               "over all)", world, dense, experts, ep, expert_fsdp=True)


#: the scale benchmark's jobs by ``--models`` name
JOBS = {"llama": llama_job, "moe": moe_job, "moe_fsdp": moe_fsdp_job}


def rank_tree(job: Job, rank: int) -> Any:
    """One rank's flattened state with the replica hints its adapter gives
    (FSDP rows: its own; an expert: its EP index's holders, or with
    ``expert_fsdp`` its own row shard; ``step``: every rank)."""
    import torch

    from bytecp.tree.skeleton import Node
    from bytecp.tree.state import EVERY_RANK, FlatTree, ReplicaSet, Shard, TensorLeaf

    mine = ReplicaSet.of((rank,))
    tensors: dict[str, TensorLeaf] = {}
    for fqn, shape in job.sharded:
        box = sim.row_box(shape, job.world, rank)
        tensors[fqn] = TensorLeaf(shape, torch.float32, [Shard(box, torch.zeros(1).expand(box.lengths))], mine)
    if job.groups:
        g = rank % job.ep
        held = ReplicaSet.of(tuple(range(g, job.world, job.ep)))
        for fqn, shape in job.groups[g]:
            if job.expert_fsdp:
                box = sim.row_box(shape, job.holders(), rank // job.ep)
                tensors[fqn] = TensorLeaf(shape, torch.float32, [Shard(box, torch.zeros(1).expand(box.lengths))],
                                          mine)
                continue
            tensors[fqn] = TensorLeaf(shape, torch.float32, [Shard(full_region(shape), torch.zeros(1).expand(shape))],
                                      held)
    params = [t[0] for t in job.targets(rank) if t[0] in job.step_id]
    for fqn in params:
        tensors[fqn] = TensorLeaf.full(torch.zeros(()), EVERY_RANK)
    return FlatTree(Node.container("dict", ()), tensors, {}, {}, {})


def described(job: Job, rank: int) -> tuple[Any, dict[str, dict[str, Any]]]:
    """The skeleton (a :class:`~bytecp.tree.skeleton.Node`) and tensor specs
    of rank ``rank``'s state as ``flatten_tree`` describes a state dict
    ``{"model": {fqn: tensor}, "optimizer": {"state": {fqn: {"exp_avg",
    "exp_avg_sq", "step"}}, "param_groups": ...}}``: the dense weights and,
    with experts, those of its EP index."""
    from bytecp.tree.skeleton import Node

    params = list(job.dense)
    if job.groups:
        per = len(job.experts) // job.ep
        g = rank % job.ep
        params += [n for e in range(g * per, (g + 1) * per) for n in job.experts[e]]
    shapes = job._shapes
    model = [(n, Node.leaf("tensor", f"model.{n}")) for n in params]
    state = [(n, Node.container("dict", [(st, Node.leaf("tensor", f"optimizer.state.{n}.{st}"))
                                         for st in (*STATES, "step")])) for n in params]
    optim = Node.container("dict", [("state", Node.container("dict", state)),
                                    ("param_groups", Node.leaf("obj", "optimizer.param_groups"))])
    skeleton = Node.container("dict", [("model", Node.container("dict", model)), ("optimizer", optim)])
    specs = {f"model.{n}": {"dtype": F32, "shape": list(shapes[f"model.{n}"])} for n in params}
    specs |= {f"optimizer.state.{n}.{st}": {"dtype": F32, "shape": list(shapes[f"model.{n}"])}
              for n in params for st in STATES}
    specs |= {f"optimizer.state.{n}.step": {"dtype": F32, "shape": []} for n in params}
    return skeleton, specs


def sent(job: Job) -> list[tuple[int, Any, dict[str, Any], dict[str, str]]]:
    """What the commit gathers beside the coordinator's own: (rank, skeleton
    JSON, :func:`~bytecp.format.table_union.sent_table`, aliases) of the
    lowest rank of each other skeleton (the MoE: of each other EP index)."""
    from bytecp.format.table_union import sent_table

    return [(r, sk.to_json(), sent_table(specs), {}) for r in range(1, job.ep if job.groups else 1)
            for sk, specs in [described(job, r)]]


def union(job: Job) -> Any:
    """The coordinator's :class:`~bytecp.saving.union.DescribedUnion` of every
    rank's skeleton and tensors (what ``metadata.json`` holds)."""
    from bytecp.saving.union import described_union

    own, specs = described(job, 0)
    return described_union(lambda: (own, specs, {}), sent(job), 0)


def votes(job: Job, cached: str | None = None) -> list[bytes]:
    """Every rank's plan vote as :func:`~bytecp.plan.exchange.ballot` sends
    it, encoded (own rows, the world set of the ``step`` tensors, its EP index's set unless
    its experts are FSDP-sharded: then they are own rows)."""
    from bytecp.plan.exchange import PlanVote
    from bytecp.tree.state import ReplicaSet

    w = job.world
    world_set = (ReplicaSet.world(w).key, w, sim._hex("steps", len(job.steps)))
    sets = [tuple(sorted([world_set, *([(ReplicaSet.of(tuple(range(g, w, job.ep))).key, w // job.ep,
                                        sim._hex("experts", g))] if job.groups and not job.expert_fsdp else [])]))
            for g in range(max(1, job.ep))]
    own = job.own_bytes()
    return [PlanVote(sim._hex("fp", r), cached, sim._hex("skeleton", r % job.ep if job.groups else 0),
                     SAVE_ID if r == 0 else None, int(own[r]), sets[r % job.ep if job.groups else 0], False,
                     own_fp=sim._hex("own", r) if own[r] else "").encode() for r in range(w)]
