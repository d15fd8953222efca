"""The DTensor layout matrix: each save layout loaded into each load layout,
model and optimizer state compared bitwise with the full tensors of the
saving job (docs/saving-and-loading.md, "DTensor layouts", shows the same table).

One 4-rank pool runs every case: a case saves one layout and loads it into
every distributed load layout in the same call; the test process then
loads it as one plain process and with ``load_state_dict``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import bytecp

from . import layout_cases as lc
from . import titan_cases
from .cases import assert_same_state

pytestmark = pytest.mark.timeout(300)

#: save layout -> the layouts it is loaded into (4 ranks), plus one plain process and load_state_dict
SAVES = ["fsdp_tp_sp", "fsdp_tp_norms_out", "tp", "hsdp", "hsdp_tp", "pp_fsdp", "fsdp_groups"]
LOADS = ["fsdp", "fsdp_tp_1x4", "fsdp_tp_sp", "pp_fsdp_other"]
#: torchtitan's own Llama3 and parallelisms (tests/dist/titan_cases.py)
TITAN_SAVES = ["titan_fsdp_tp", "titan_fsdp_tp_sp"]
TITAN_LOADS = ["titan_fsdp_tp_sp", "titan_fsdp", "titan_tp"]
MATRIX = {**{s: LOADS for s in SAVES}, **{s: TITAN_LOADS for s in TITAN_SAVES}}
#: the ranks rank 0's replica hint names for its first layer's attention norm
#: (None: no hint, the coordinator compares boxes)
NORM_REPLICAS = {
    "fsdp_tp_sp": [0, 1],  # Replicate along tp
    "fsdp_tp_norms_out": [0, 1],  # on mesh["dp"]: every tp coordinate of the root mesh
    "tp": [0, 1, 2, 3],
    "hsdp": [0, 2],
    "hsdp_tp": [0, 1, 2, 3],  # Replicate along replicate, and every tp coordinate
    "pp_fsdp": [0, 2],  # the other stage too: the set is split by stage, planned without boxes
    "fsdp_groups": None,  # its mesh does not span the world
    "titan_fsdp_tp": [0, 1],  # torchtitan keeps norms on the 2-D mesh, Replicate along tp
    "titan_fsdp_tp_sp": [0, 1],
}
#: save layouts whose first save the coordinator plans (it gathers boxes); the
#: others plan from their hints alone, pipeline stages included (their sets
#: split by stage: bytecp.plan.split_sets)
COORDINATED = {"fsdp_groups"}


def _stored_once(url: str) -> None:
    """Every tensor byte of the checkpoint is stored exactly once (replicas deduplicated)."""
    from bytecp.loading.opened import open_checkpoint, read_metadata
    from bytecp.storage_api import open_storage

    storage = open_storage(url)
    md = read_metadata(storage)
    want = sum(math.prod(t["shape"]) * torch.empty((), dtype=getattr(torch, t["dtype"])).element_size()
               for t in md.tensors.values())
    assert sum(c.nbytes for c in open_checkpoint(storage).all_rows()) == want


@pytest.mark.parametrize("save", list(MATRIX))
def test_layout_matrix(pools, tmp_path: Path, save: str) -> None:
    if save.startswith("titan") and titan_cases.available():
        pytest.skip(titan_cases.available())
    url = str(tmp_path / save)
    out = pools(4).run(lc.save_then_load, save, url, MATRIX[save], timeout=240)[0]
    ref = out["ref"]
    assert out["norm_replicas"] == NORM_REPLICAS[save]
    assert out["coordinated"] == (save in COORDINATED), out["coordinated"]
    for to in MATRIX[save]:
        assert_same_state(ref, out["got"][to], f"{save} -> {to}")
        assert out["got"][to]["step"] == 2
    _stored_once(url)
    _stored_once(url + "-sync")
    synced = bytecp.load_state_dict(url + "-sync")  # the sync save of the same state: the same bytes
    assert synced["model"].keys() == ref["model"].keys()
    for k, v in ref["model"].items():
        assert torch.equal(v, synced["model"][k]), f"{save} sync save: model {k}"
    # one plain process, no torch.distributed
    model, opt, _ = titan_cases.build("titan_plain", 7) if save.startswith("titan") else lc.build("plain", seed=7)
    extra: dict[str, Any] = {"step": -1}
    bytecp.load(url, {"model": model, "optimizer": opt, "extra": extra})
    got = lc.full_state(model, opt)
    assert got is not None and extra["step"] == 2
    assert_same_state(ref, got, f"{save} -> one process")
    # full tensors by name
    sd = bytecp.load_state_dict(url)
    assert {k: v for k, v in sd["model"].items()}.keys() == ref["model"].keys()
    for k, v in ref["model"].items():
        assert torch.equal(v, sd["model"][k]), f"{save} -> load_state_dict: model {k}"
    flat = {f"{p}.{k}": t for p, st in sd["optimizer"]["state"].items() for k, t in st.items()}
    for k, v in ref["optim"].items():
        assert torch.equal(v, flat[k]), f"{save} -> load_state_dict: optimizer {k}"


def test_partial_placement_fails_the_save_on_every_rank(pools, tmp_path: Path) -> None:
    url = tmp_path / "partial"
    errors = pools(4).run(lc.save_error, "fsdp_tp_sp", str(url))
    for e in errors:
        assert "failed on rank(s) 0-3: save/describe: UnsupportedLayoutError" in e and "\n" not in e, e  # all alike
        assert "tensor 'layers.0.attn_norm.weight' of shape [16]" in e, e
        assert "mesh (dp=2, tp=2) placements (S(0), P(sum))" in e, e
        assert "redistribute" in e, e
    assert not (url / "metadata.json").exists()


def test_guide_shows_the_matrix() -> None:
    guide = (Path(__file__).parents[2] / "docs" / "saving-and-loading.md").read_text()
    for name in [*MATRIX, *LOADS, *TITAN_LOADS]:
        assert f"`{name}`" in guide, name


def test_param_groups_of_another_pipeline_stage() -> None:
    """The saved groups name the coordinator's stage: another stage takes
    their hyperparameters by position; groups partitioned otherwise are refused."""
    from bytecp.adapters.plain import param_groups_for_load

    from bytecp.errors import StateMismatchError

    ps = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    opt = torch.optim.AdamW([{"params": ps[:1], "lr": 0.1}, {"params": ps[1:], "lr": 0.2}])
    saved = [{"params": ["s0.a"], "lr": 0.5}, {"params": ["s0.b"], "lr": 0.6}]
    stored = {"a", "b", "c", "s0.a", "s0.b"}
    groups = param_groups_for_load("optimizer", saved, opt, [["a"], ["b", "c"]], stored)
    assert [g["lr"] for g in groups] == [0.5, 0.6] and groups[1]["params"] == [1, 2]
    with pytest.raises(StateMismatchError, match="param group 0"):  # a repartition, not another stage
        param_groups_for_load("optimizer", [{"params": ["a", "b"], "lr": 0.5}, {"params": ["c"], "lr": 0.6}],
                              opt, [["a"], ["b", "c"]], stored)
    with pytest.raises(StateMismatchError, match="param group 0"):  # state missing from the checkpoint
        param_groups_for_load("optimizer", saved, opt, [["a"], ["b", "c"]], {"b", "c"})


def test_replica_sets_of_simulated_meshes() -> None:
    """(one process, 128 simulated ranks) The replica sets of a root mesh
    dp_replicate=4 x dp_shard=8 x tp=4: each set holds exactly the ranks
    with the same box, every member computes the same set, the sets
    partition the world; a mesh that is not a slab of the root gives no hint."""
    from bytecp.adapters._dtensor import replica_ranks

    grid = torch.arange(128).reshape(4, 8, 4)
    cases = {
        # FSDP over (replicate, shard), HSDP placements (Replicate, Shard): same shard coordinate, any tp
        "hsdp on a sub-mesh": (lambda r, s, t: grid[:, :, t], lambda r, s, t: [r, s], (True, False), 16),
        # FSDP over the flattened (replicate, shard) dims: the box is this rank's alone along them, any tp
        "fsdp on a flattened sub-mesh": (lambda r, s, t: grid[:, :, t].flatten(), lambda r, s, t: [r * 8 + s],
                                         (False,), 4),
        # a TP-only tensor, Replicate along tp: every rank of the tp row, and every dp coordinate
        "replicated over tp": (lambda r, s, t: grid[r, s, :], lambda r, s, t: [t], (True,), 128),
        # sharded over tp: the same tp coordinate on every dp rank
        "sharded over tp": (lambda r, s, t: grid[r, s, :], lambda r, s, t: [t], (False,), 32),
    }
    for what, (sub_of, coord_of, replicate, size) in cases.items():
        seen: dict[int, tuple[int, ...]] = {}
        for rank in range(128):
            r, s, t = rank // 32, (rank // 4) % 8, rank % 4
            got = replica_ranks(grid, sub_of(r, s, t), coord_of(r, s, t), replicate, 128)
            assert got is not None and rank in got and len(got) == size, (what, rank, got)
            for member in got:
                assert seen.setdefault(member, got) == got, (what, rank, member)
        assert sorted(seen) == list(range(128)), what
    assert replica_ranks(grid, torch.tensor([0, 5]), [0], (False,), 128) is None  # not a slab
    assert replica_ranks(grid[:2], grid[0, :, 0], [0], (False,), 128) is None  # the root lacks half the world
