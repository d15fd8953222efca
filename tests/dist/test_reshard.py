"""Distributed save/load on real gloo ranks: the resharding matrix, cross-framework
loads, exact resume, plan caching and failures that reach every rank.

Every loaded parameter and optimizer tensor is compared bitwise with the full
tensor torch itself reports for the saving job."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import bytecp

from . import cases
from .cases import assert_same_state

pytestmark = pytest.mark.timeout(600)

FRAMEWORKS = ["ddp", "fsdp1", "fsdp2"]
NEXT_WORLD = {1: 2, 2: 3, 3: 4, 4: 1}


def variant_for(framework: str, world: int) -> str:
    if framework == "fsdp1":
        return "orig" if world % 2 == 0 else "flat"
    return ""


def assert_matches_full(ref: dict[str, Any], sd: dict[str, Any], what: str) -> None:
    for k, v in ref["model"].items():
        assert torch.equal(v, sd["model"][k]), f"{what}: model {k}"
    flat_optim = {f"{p}.{k}": t for p, st in sd["optimizer"]["state"].items() for k, t in st.items()}
    for k, v in ref["optim"].items():
        assert torch.equal(v, flat_optim[k]), f"{what}: optimizer {k}"


@pytest.fixture(scope="module")
def saved(pools, tmp_path_factory) -> dict[tuple[str, int], tuple[str, dict[str, Any]]]:
    """Every framework saved at every world size 1..4 (trained 2 steps, AdamW)."""
    root = tmp_path_factory.mktemp("matrix")
    out = {}
    for world in (1, 2, 3, 4):
        for fw in FRAMEWORKS:
            url = str(root / f"{fw}-{world}")
            ref = pools(world).run(cases.save_case, fw, url, variant_for(fw, world))[0]
            out[(fw, world)] = (url, ref)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_reshard_same_framework(saved, pools, fw: str, world: int) -> None:
    url, ref = saved[(fw, world)]
    to = NEXT_WORLD[world]
    got = pools(to).run(cases.load_case, fw, url, variant_for(fw, to))[0]
    assert_same_state(ref, got, f"{fw} {world}->{to}")
    assert got["step"] == 2
    # one process, no torch.distributed: full tensors
    assert_matches_full(ref, bytecp.load_state_dict(url), f"{fw} {world}->1 process")


@pytest.mark.parametrize(
    "src,dst",
    [(("fsdp2", 2), ("ddp", 3)), (("fsdp1", 2), ("fsdp2", 4)), (("ddp", 4), ("fsdp1", 3)), (("fsdp1", 3), ("ddp", 1))],
)
def test_cross_framework(saved, pools, src: tuple[str, int], dst: tuple[str, int]) -> None:
    url, ref = saved[src]
    got = pools(dst[1]).run(cases.load_case, dst[0], url, variant_for(*dst))[0]
    assert_same_state(ref, got, f"{src} -> {dst}")


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_load_into_an_optimizer_that_already_has_state(saved, pools, fw: str) -> None:
    url, ref = saved[(fw, 2)]
    got = pools(3).run(cases.load_case, fw, url, variant_for(fw, 3), pretrain=True)[0]
    assert_same_state(ref, got, f"{fw} 2->3 into a trained optimizer")


def test_metadata_records_framework_and_world(saved) -> None:
    from bytecp.storage_api import open_storage
    from bytecp.tools.inspect import summarize

    for (fw, world), (url, _) in saved.items():
        info = summarize(open_storage(url))
        assert info["framework"] == fw and info["world_size"] == world
        assert info["parallelism"]["world_size"] == world


def test_ddp_replicas_are_written_once_by_every_rank(saved) -> None:
    """DDP: all 4 ranks write (their share of the replicated state), and every
    tensor byte is stored exactly once (balance itself: tests/core/test_planner.py)."""
    from bytecp.loading.opened import open_checkpoint, read_metadata
    from bytecp.storage_api import open_storage

    url, _ = saved[("ddp", 4)]
    storage = open_storage(url)
    md = read_metadata(storage)
    chunks = open_checkpoint(storage).all_rows()
    writers = {c.file.rsplit("/", 1)[1].split("-")[0] for c in chunks}
    assert writers == {"0", "1", "2", "3"}
    state_bytes = sum(math.prod(t["shape"]) * torch.empty((), dtype=getattr(torch, t["dtype"])).element_size()
                      for t in md.tensors.values())
    assert sum(c.nbytes for c in chunks) == state_bytes


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_resume_gives_exactly_the_losses_of_an_uninterrupted_run(pools, tmp_path: Path, fw: str) -> None:
    url = str(tmp_path / "ck")
    variant = variant_for(fw, 2)
    pools(2).run(cases.save_case, fw, url, variant)
    want = pools(2).run(cases.continuous_case, fw, variant)[0]
    got = pools(2).run(cases.load_case, fw, url, variant, more_steps=3)[0]["losses"]
    assert got == want


@pytest.mark.parametrize("fw,to", [("fsdp2", 3), ("fsdp1", 1), ("ddp", 3)])
def test_training_continues_to_improve_after_resharded_load(saved, pools, fw: str, to: int) -> None:
    url, _ = saved[(fw, 2)]
    before, after = pools(to).run(cases.resume_decreases, fw, url, variant_for(fw, to))[0]
    assert after < before


def test_hsdp_and_hybrid_shard_replicas_write_once(pools, tmp_path: Path) -> None:
    for fw, variant, to in (("fsdp2", "hsdp", 2), ("fsdp1", "hybrid-flat", 3)):
        url = str(tmp_path / fw)
        ref = pools(4).run(cases.save_case, fw, url, variant)[0]
        got = pools(to).run(cases.load_case, "fsdp2", url, "")[0]
        assert_same_state(ref, got, f"{fw}/{variant} 4 -> fsdp2 {to}")


def test_plan_cache_second_save_exchanges_only_fingerprints(pools, tmp_path: Path) -> None:
    # replica hints that hold (DDP: every rank holds the model): no plan is
    # ever gathered, the first save exchanges fingerprints only
    for calls_bytes in pools(2).run(cases.plan_cache_stats, str(tmp_path / "hinted")):
        (c1, b1), (c2, b2), (c3, b3) = calls_bytes
        assert c1 == c2 == c3 == 3  # plan all-gather, commit gather + broadcast
        assert abs(b2 - b1) < 256 and abs(b3 - b2) < 256  # ids and sizes of a few digits differ
    # hints that do not hold (a tensor on one rank only): the coordinator
    # plans the first save, the cached plan serves the next ones
    for calls_bytes in pools(2).run(cases.plan_cache_stats, str(tmp_path / "uneven"), True):
        (c1, b1), (c2, b2), (c3, b3) = calls_bytes
        # the first save adds the coordinator's plan gather + scatter (and, in a
        # process that never split these sets before, the all-gather of name
        # hashes that proves the ranks' extra tensors disjoint), and the gather
        # + broadcast of rank 1's skeleton (its tree differs); none of it again
        assert c1 - c2 in (4, 5) and b2 < b1, (c1, c2)
        assert c2 == c3 == 3 and abs(b3 - b2) < 256


@pytest.mark.parametrize("fw,lazy", [("ddp", False), ("fsdp2", True), ("fsdp1", False)])
def test_async_save_while_training_runs_collectives(pools, tmp_path: Path, fw: str, lazy: bool) -> None:
    url = str(tmp_path / "ck")
    ref = pools(2).run(cases.async_case, fw, url, lazy, variant_for(fw, 2))[0]
    got = pools(3).run(cases.load_case, fw, url, variant_for(fw, 3))[0]
    assert_same_state(ref, got, f"async {fw} lazy={lazy} 2->3")


def test_zero_redundancy_load_reads_each_replicated_byte_once(saved, pools) -> None:
    url, ref = saved[("ddp", 2)]
    plain = pools(3).run(cases.zero_redundancy_load, "ddp", url, False)
    zero = pools(3).run(cases.zero_redundancy_load, "ddp", url, True)
    assert_same_state(ref, zero[0][0], "ddp 2->3 zero-redundancy")
    assert_same_state(ref, plain[0][0], "ddp 2->3 plain")
    everything = plain[0][1]  # without it, every rank reads the whole state
    assert all(r[1] == everything for r in plain)
    reads = [r[1] for r in zero]
    assert sum(reads) < everything * 1.05  # each byte read about once in all
    assert max(reads) < everything / 2  # spread over the ranks


def test_values_held_only_by_some_ranks_are_saved(pools, tmp_path: Path) -> None:
    sd = pools(2).run(cases.uneven_objects, str(tmp_path / "ck"))[0]
    extra = sd["extra"]
    assert extra["common"] == 1 and extra["blob"] == (1, 2)
    assert extra["only0"]["value"] == 0 and extra["only1"]["value"] == 1
    assert torch.equal(extra["only1"]["t"], torch.full((3,), 1.0))


def test_a_rank_whose_tree_differs_keeps_its_referenced_rows(pools, tmp_path: Path) -> None:
    refs, sd = pools(2).run(cases.uneven_incremental, str(tmp_path / "run"))[0]
    assert refs == ["step-1"]
    extra = sd["extra"]
    assert torch.equal(extra["only0"], torch.arange(6.0)) and torch.equal(extra["only1"], torch.arange(6.0) + 10)
    assert torch.equal(extra["moving"], torch.ones(4))  # changed: written again


def test_each_ranks_share_of_a_replicated_tensor_is_referenced(pools, tmp_path: Path) -> None:
    sizes, refs, own, sd = pools(2).run(cases.replicated_incremental, str(tmp_path / "run"))[0]
    assert len(sizes) == 2 and min(sizes) >= 3 << 20  # (the 8 MiB tensor split between the two ranks)
    assert refs == ["step-1"]
    assert sum(own.values()) < 1 << 20, own  # only the tensor that moved was written again
    assert torch.equal(sd["model"]["big"], torch.arange(2 << 20, dtype=torch.float32))
    assert torch.equal(sd["model"]["moving"], torch.ones(4))


def test_a_state_changing_on_one_rank_keeps_async_saves_committing(pools, tmp_path: Path) -> None:
    # rank 0 snapshots only its cached share while rank 1's plan changed: the
    # new plan keeps rank 0's share as it is and gives rank 1 the rest
    got = pools(2).run(cases.state_changes_on_one_rank_between_async_saves, str(tmp_path / "ck"))[0]
    assert got == [(True, [])] + [(True, ["y"])] * 3


def test_cached_shares_of_different_plans_never_overlap(pools, tmp_path: Path) -> None:
    # ranks whose fingerprints match entries of different earlier plans copy
    # only the latest committed plan's share, so every save still tiles
    got = pools(3).run(cases.rank_local_tensor_moves_between_async_saves, str(tmp_path / "ck"), timeout=240)[0]
    assert got == [(True, ["x"]), (True, ["x"]), (True, []), (True, []), (True, [])]


def test_invalid_state_on_one_rank_fails_every_rank_at_once(pools, tmp_path: Path) -> None:
    for msg, seconds in pools(2).run(cases.bad_state_on_one_rank, str(tmp_path / "ck")):
        assert "rank 1" in msg and "same key" in msg and seconds < 20


def test_plan_cache_held_by_some_ranks_only(pools, tmp_path: Path) -> None:
    a, b = pools(2).run(cases.cache_on_one_rank_only, str(tmp_path / "ck"), timeout=120)
    assert (tmp_path / "ck-b" / "metadata.json").exists()


def test_zero_redundancy_with_mixed_dtypes(pools, tmp_path: Path) -> None:
    assert all(pools(2).run(cases.mixed_dtype_zero_redundancy, str(tmp_path / "ck")))


def test_fsdp1_parameters_of_ignored_modules_are_saved(pools, tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    want = pools(2).run(cases.fsdp1_ignored_modules, url)[0]
    sd = bytecp.load_state_dict(url)
    assert torch.equal(sd["model"]["out.weight"], want["weight"])
    got = pools(2).run(cases.fsdp1_ignored_modules, url, 2)[0]
    for k, v in want.items():
        assert torch.equal(v, got[k]), k


def test_failure_on_one_rank_reaches_every_rank_during_save(pools, tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    results = pools(2).run(cases.failing_save, url, "write:1")
    for msg, seconds in results:
        assert "rank 1" in msg and "injected failure" in msg and seconds < 30
    assert not (tmp_path / "ck" / "metadata.json").exists()
    assert not list((tmp_path / "ck").rglob("*.bin"))  # the failed save's files are removed


def test_failure_on_one_rank_reaches_every_rank_during_load(saved, pools) -> None:
    url, _ = saved[("fsdp2", 2)]
    for msg, seconds in pools(2).run(cases.failing_load, url, "read:1"):
        assert "rank 1" in msg and "injected failure" in msg and seconds < 30


def test_shape_mismatch_names_tensor_and_both_shapes(saved, pools) -> None:
    url, _ = saved[("ddp", 2)]
    for msg in pools(2).run(cases.mismatched_load, url):
        assert "model.l1.weight" in msg and "[13, 11]" in msg and "[17, 11]" in msg


@pytest.mark.spawn  # a pool of its own (a rank dies)
def test_rank_killed_mid_save_is_named_and_nothing_commits(tmp_path: Path) -> None:
    from .pool import WorkerError, WorkerPool

    pool = WorkerPool(2)
    try:
        url = str(tmp_path / "ck")
        with pytest.raises(WorkerError) as ei:
            pool.run(cases.failing_save, url, "write:1", "EXIT", timeout=120)
        failures = ei.value.failures
        assert "exited" in failures.get(1, "")
    finally:
        pool.close(kill=True)
    assert not (tmp_path / "ck" / "metadata.json").exists()


def test_replicas_that_differ_are_refused_on_every_rank(pools, tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    for got in pools(2).run(cases.replica_checks, url):
        assert "'model.embed'" in got["shape"] and "rank 0" in got["shape"] and "rank 1" in got["shape"]
        assert "'model.embed'" in got["contents"] and "ranks [0] vs [1]" in got["contents"]
        assert "'model.l1.weight'" in got["ddp"] and "ranks [0] vs [1]" in got["ddp"]
        assert got["ddp-unchecked"] == "saved"  # off: replicas are trusted, as DCP does
        assert got["ddp-async-first"] == "saved"
        for name in ("ddp-async", "ddp-async-uncached", "ddp-lazy"):
            assert "'model.l1.weight'" in got[name] and "ranks [0] vs [1]" in got[name], (name, got[name])
    for name in ("shape", "contents", "ddp", "ddp-async", "ddp-async-uncached", "ddp-lazy"):
        assert not (tmp_path / f"ck-{name}" / "metadata.json").exists()
        assert not list((tmp_path / f"ck-{name}").rglob("*.bin"))


def test_saves_follow_tensors_that_changed_identity_or_shape(pools, tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    refs = pools(2).run(cases.saves_follow_changed_tensors, url)[0]
    for i, ref in enumerate(refs):
        assert_matches_full(ref, bytecp.load_state_dict(f"{url}-{i}"), f"save {i}")
    assert not torch.equal(refs[0]["model"]["l1.weight"], refs[1]["model"]["l1.weight"])
    assert refs[2]["model"]["l1.weight"].shape == (29, 11)
