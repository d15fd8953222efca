"""A save where ranks hold states of different skeletons (4 ranks, three
skeletons, one of them on two ranks): only the lowest rank of each
skeleton other than the coordinator's sends its skeleton and tensor specs,
at the plan phase of a job's first save (bytecp/plan/decide.py ``sends_specs``); the checkpoint still
describes every rank's tensors and values and loads back bitwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from . import skeleton_cases

pytestmark = pytest.mark.timeout(240)


def test_one_rank_per_other_skeleton_sends_its_specs(pools: Any, tmp_path: Path) -> None:
    out = pools(4).run(skeleton_cases.save_kinds, str(tmp_path / "ck"))
    assert [o["sent"] for o in out] == [0, 1, 1, 0]  # b: rank 1 for ranks 1 and 3; c: rank 2; a: the coordinator
    assert all(o["same"] for o in out), out
    assert out[0]["tensors"] == ["kind_a.t", "kind_b.t", "kind_c.t", "shared.w"]
    sd = out[0]["state"]
    for kind in "abc":
        want = skeleton_cases.kind_state(kind)[f"kind_{kind}"]
        assert torch.equal(sd[f"kind_{kind}"]["t"], want["t"]) and sd[f"kind_{kind}"]["n"] == want["n"]
    assert torch.equal(sd["shared"]["w"], skeleton_cases.kind_state("a")["shared"]["w"])


def test_the_union_of_skeletons_is_reused_only_while_every_rank_describes_the_same(
        pools: Any, tmp_path: Path) -> None:
    """The coordinator keeps the union of the skeletons sent (and its JSON
    text) between saves whose votes name the same skeletons
    (bytecp/saving/union.py ``described_union``); a rank whose tensor
    changes shape, or whose tree changes, makes it build a new one."""
    out = pools(4).run(skeleton_cases.save_again, str(tmp_path))
    # first save: the lowest rank of kinds b and c; second: nobody; third: b, c (changed) and d (new)
    assert [o["sent"] for o in out] == [[0, 0, 0], [1, 0, 1], [1, 0, 1], [0, 0, 1]], out
    assert out[0]["reused"] and out[0]["rebuilt"], out[0]
    second, third = out[0]["second"], out[0]["third"]
    for kind in "abc":
        want = skeleton_cases.kind_state(kind)[f"kind_{kind}"]
        assert torch.equal(second[f"kind_{kind}"]["t"], want["t"]) and second[f"kind_{kind}"]["n"] == want["n"]
    assert torch.equal(third["kind_c"]["t"], torch.arange(7, dtype=torch.float64))
    assert third["kind_d"]["n"] == {"kind": "d", "ord": ord("d")}
    assert torch.equal(third["kind_d"]["t"], skeleton_cases.kind_state("d")["kind_d"]["t"])
    assert torch.equal(third["kind_b"]["t"], skeleton_cases.kind_state("b")["kind_b"]["t"])


def test_a_large_states_commit_sends_the_ranks_its_small_members_only(pools: Any, tmp_path: Path) -> None:
    """The coordinator broadcasts a large state's committed metadata
    without its large members (bytecp/saving/outcome.py); ``save()`` on the
    other ranks reads them from metadata.json when first asked for."""
    out = pools(4).run(skeleton_cases.save_outcome, str(tmp_path / "ck"))
    assert [o["type"] for o in out] == ["Metadata", "CommittedMetadata", "CommittedMetadata", "CommittedMetadata"]
    assert all(o["unread"] for o in out[1:]), out
    assert len({o["save_id"] for o in out}) == 1
    for o in out[1:]:
        assert (o["tensors"], o["files"], o["skeleton"]) == (out[0]["tensors"], out[0]["files"], out[0]["skeleton"])


def test_ranks_describing_a_tensor_differently_fail_the_save_on_every_rank(pools: Any, tmp_path: Path) -> None:
    """The coordinator's union of the tensor tables sent (bytecp/format/table_union.py)
    refuses a tensor two ranks describe differently: every rank's save
    raises the one line naming the tensor and both ranks, and what it wrote is removed."""
    out = pools(4).run(skeleton_cases.save_disagreeing, str(tmp_path / "ck"))
    for o in out:
        assert "tensor 'shared.w': rank 0 has dtype float32 shape [3, 4] but rank 2 has dtype float32 shape [4, 3]; " \
               "every rank must describe the same global tensor" in o["raised"], o
    assert [o["left"] for o in out] == [[]] * 4  # (the failed save's files removed)


def test_a_rank_failing_to_send_its_skeleton_fails_the_save_on_every_rank(pools: Any, tmp_path: Path) -> None:
    """The skeletons go to the coordinator at the plan phase of a job's
    first save (bytecp/saving/union.py ``gather_union``): a rank failing
    there fails the save on every rank, naming it, before anything is
    written; the next save gathers them again and commits."""
    out = pools(4).run(skeleton_cases.save_union_fault, str(tmp_path))
    for o in out:
        assert o["raised"].startswith("DistributedCheckpointError") and "rank 1" in o["raised"] \
            and "save/plan" in o["raised"] and "injected" in o["raised"].lower(), o
    assert [o["left"] for o in out] == [[]] * 4
    assert all(o["same"] for o in out), out
