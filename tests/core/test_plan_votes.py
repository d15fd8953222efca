"""The save plan's votes as flat bytes and the NumPy decision over them
(bytecp/plan/votes.py, bytecp/plan/decide.py): every decision equals the
one the per-vote Python loop made (kept here as the reference) on varied
vote sets -- sound and bad replica sets, own boxes equal across ranks,
unknown boxes, fixed shares, cached plans reused or not, different targets
refused with the same text -- and the ranks that send their skeleton (at
a job's first save) are the lowest rank of each skeleton other than the coordinator's."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping, Sequence

import pytest

from bytecp.errors import DistributedCheckpointError
from bytecp.plan.exchange import (
    PlanDecision,
    PlanVote,
    decide,
    fingerprints_digest,
    read_vote,
    sends_specs,
)
from bytecp.plan.votes import VoteTable
from bytecp.tree.state import ReplicaSet


def reference(votes: Sequence[PlanVote]) -> PlanDecision:
    """The decision as computed before votes were encoded (one Python pass per vote)."""
    if len({v.target for v in votes}) > 1:
        raise DistributedCheckpointError("save/plan", {r: (
            f"saving to {v.target} while rank 0 saves to {votes[0].target}: the ranks are in different saves "
            "(a rank that missed a deadline is a save behind); nothing is committed") for r, v in enumerate(votes)
            if v.target != votes[0].target})
    digest = fingerprints_digest([v.fingerprint for v in votes])
    base = tuple(v.own_bytes for v in votes)
    if all(v.cached_for == digest for v in votes):
        return PlanDecision(digest, True, frozenset(), base)
    seen: dict[str, tuple[set[int], dict[str, list[int]]]] = {}
    for rank, v in enumerate(votes):
        for key, size, fp in v.sets:
            entry = seen.get(key)
            if entry is None:
                entry = seen[key] = (set(), {})
            entry[0].add(size)
            entry[1].setdefault(fp, []).append(rank)
        if v.own_fp:
            seen[f"own:{rank}"] = ({1}, {v.own_fp: [rank]})
    bad = frozenset(k for k, (sizes, fps) in seen.items()
                    if len(fps) > 1 or len(sizes) > 1 or sum(map(len, fps.values())) != next(iter(sizes)))
    groups = {k: tuple(tuple(m) for m in fps.values()) for k, (_, fps) in seen.items()}
    by_fp: dict[str, list[str]] = {}
    for k, (_, fps) in seen.items():
        if k not in bad:
            by_fp.setdefault(next(iter(fps)), []).append(k)
    merged: dict[str, tuple[int, ...]] = {}
    for keys in by_fp.values():
        if len(keys) > 1:
            ranks = tuple(sorted({r for k in keys for r in groups[k][0]}))
            merged.update((k, ranks) for k in keys)
    unknown = any(v.unknown for v in votes)
    if any(v.fixed for v in votes):
        groups = {}
    return PlanDecision(digest, False, bad, base, merged, groups, unknown)


def h(*parts: object) -> str:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).hexdigest()


def same(new: PlanDecision, old: PlanDecision) -> None:
    assert (new.digest, new.reuse, new.bad_sets, new.base_load, new.unknown, new.coordinated) == \
        (old.digest, old.reuse, old.bad_sets, old.base_load, old.unknown, old.coordinated)
    for name in ("merged", "groups"):
        got, want = getattr(new, name), getattr(old, name)
        assert isinstance(got, Mapping) and dict(got) == want, name
        assert len(got) == len(want) and all(got.get(k) == v for k, v in want.items())
        assert got.get("own:999999") is None and got.get("0" * 24) is None


def random_votes(rng: random.Random, world: int) -> list[PlanVote]:
    """Votes of ranks in a few replica sets of random members, some members
    holding other boxes or giving another size, own boxes sometimes equal."""
    sets = []
    for _ in range(rng.randint(0, 4)):
        members = sorted(rng.sample(range(world), rng.randint(1, world)))
        sets.append((ReplicaSet.of(tuple(members)), h("set", len(sets))))
    # no cached plan, one made for other votes, or (a third of the seeds) one made for exactly these votes
    cached = rng.choice([None, "x", fingerprints_digest([h("fp", r) for r in range(world)])])
    votes = []
    for r in range(world):
        mine = []
        for rs, fp in sets:
            if r in rs.ranks and rng.random() > 0.05:  # a member that forgot the set: bad
                size = rs.size if rng.random() > 0.05 else rs.size + 1
                mine.append((rs.key, size, fp if rng.random() > 0.15 else h("other", rng.randint(0, 2))))
        own_fp = rng.choice(["", h("own", r), h("own", r), h("own", rng.randint(0, 3))])
        votes.append(PlanVote(h("fp", r), cached, h("skeleton", rng.randint(0, 2)), "id" if r == 0 else None,
                              rng.randint(0, 1 << 40), tuple(sorted(mine)), rng.random() < 0.05,
                              ("o",) if r == 0 else (), own_fp, rng.random() < 0.03, "step-7"))
    return votes


@pytest.mark.parametrize("seed", range(60))
def test_the_decision_equals_the_per_vote_loop(seed: int) -> None:
    rng = random.Random(seed)
    votes = random_votes(rng, rng.choice([1, 2, 3, 5, 8, 17, 64]))
    same(decide([v.encode() for v in votes]), reference(votes))


def test_cached_plans_are_reused_only_when_every_rank_holds_one_for_these_votes() -> None:
    rs = ReplicaSet.of((0, 1, 2))
    votes = [PlanVote(h("fp", r), None, "s", None, 10 * r, ((rs.key, 3, h("b")),), target="t") for r in range(3)]
    digest = reference(votes).digest
    cached = [PlanVote(**{**v.__dict__, "cached_for": digest}) for v in votes]
    new = decide([v.encode() for v in cached])
    assert new.reuse and not new.coordinated
    same(new, reference(cached))
    stale = cached[:2] + [PlanVote(**{**votes[2].__dict__, "cached_for": h("older")})]
    same(decide([v.encode() for v in stale]), reference(stale))
    assert not decide(stale).reuse  # (PlanVote objects are encoded first)


def test_own_boxes_held_alike_are_merged_and_bad_sets_grouped_by_first_member() -> None:
    rs = ReplicaSet.of((0, 1, 2, 3))
    votes = [PlanVote(h("fp", r), None, "s", None, 5, ((rs.key, 4, h("b", r % 2 if r else 1)),),
                      own_fp=h("own", r // 2)) for r in range(4)]
    new = decide([v.encode() for v in votes])
    same(new, reference(votes))
    assert new.bad_sets == {rs.key} and new.groups[rs.key] == ((0, 1, 3), (2,))
    assert new.merged["own:0"] == new.merged["own:1"] == (0, 1) and new.merged["own:3"] == (2, 3)


def test_votes_in_different_saves_are_refused_naming_each_rank() -> None:
    votes = [PlanVote(h("fp", r), None, "s", target="step-9" if r in (1, 3) else "step-8") for r in range(4)]
    with pytest.raises(DistributedCheckpointError) as new:
        decide([v.encode() for v in votes])
    with pytest.raises(DistributedCheckpointError) as old:
        reference(votes)
    assert str(new.value) == str(old.value) and sorted(new.value.failures) == [1, 3]
    assert "saving to step-9 while rank 0 saves to step-8" in new.value.failures[1]


def test_a_vote_reads_back_as_written() -> None:
    rs = ReplicaSet.of((0, 5))
    vote = PlanVote(h("fp"), h("c"), h("s"), "20260101T000000-abc", 1 << 50, ((rs.key, 2, h("b")),), True,
                    ("a", "b.c"), h("own"), True, "step-18", 18, 7)
    assert read_vote(vote.encode()) == vote
    bare = PlanVote(h("fp"), None, h("s"))
    assert read_vote(bare.encode()) == bare
    table = VoteTable.of([vote.encode(), bare.encode()])
    assert table.set_rank.tolist() == [0] and table.target_of(0) == "step-18"
    assert table.tail_of(0)[3] == 18 and table.heads["context"].tolist() == [7, 0]  # (step, context: resync)
    with pytest.raises(ValueError, match="ReplicaSet.key"):
        PlanVote(h("fp"), None, "s", sets=(("own:3", 1, h("b")),)).encode()


def test_only_the_lowest_rank_of_each_other_skeleton_sends_its_specs() -> None:
    skeletons = ["a", "b", "a", "c", "b", "b", "a", "c"]
    votes = [PlanVote(h("fp", r), None, s) for r, s in enumerate(skeletons)]
    d = decide([v.encode() for v in votes])
    assert [d.skeleton_leader(r) for r in range(8)] == [0, 1, 0, 3, 1, 1, 0, 3]
    for coordinator, senders in ((0, [1, 3]), (4, [0, 3])):
        got = [r for r in range(8) if sends_specs(d, r, coordinator)[1]]
        assert got == senders
        differs = [r for r in range(8) if sends_specs(d, r, coordinator)[0]]
        assert differs == [r for r in range(8) if skeletons[r] != skeletons[coordinator]]


def test_moe_ranks_outside_ep_index_0_send_one_copy_per_skeleton() -> None:
    """A MoE job's ranks name their experts (EP 64): every rank outside EP
    index 0 differs from the coordinator, and of each EP index one sends."""
    from benchmarks import scale_jobs as jobs

    job = jobs.moe_job(4096)
    d = decide(jobs.votes(job))
    roles = [sends_specs(d, r, 0) for r in range(job.world)]
    assert sum(differs for differs, _ in roles) == job.world - job.world // job.ep
    assert [r for r, (_, sends) in enumerate(roles) if sends] == list(range(1, job.ep))


def test_a_sender_sends_its_skeleton_specs_table_and_aliases() -> None:
    import torch

    from bytecp.format.chunk_batch import fqn_hash
    from bytecp.saving.union import described_by
    from bytecp.tree.skeleton import Node
    from bytecp.tree.state import FlatTree, TensorLeaf

    flat = FlatTree(Node.container("dict", ()), {"w": TensorLeaf.full(torch.zeros(2, 3))}, {}, {}, {}, {"v": "w"})
    skeleton, table, aliases = described_by(flat)
    got = {k: v.tolist() if hasattr(v, "tolist") else v for k, v in table.items()}
    assert got == {"names": ["w"], "dtypes": ["float32"], "dtype": [0], "ndim": [2], "dims": [2, 3],
                   "hashes": [fqn_hash("w")]}
    assert json.loads(skeleton) == flat.skeleton.to_json() and aliases == {"v": "w"}  # (as text: parsed on a thread)
