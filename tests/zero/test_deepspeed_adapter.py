"""DeepSpeed ZeRO 1/2/3 with the real ``deepspeed`` package on spawned gloo
ranks (CPU accelerator): same-size resume bitwise (model, fp32 master,
Adam moments, step), and a chain across stages, data-parallel sizes and
frameworks with no conversion step: ZeRO-3 x2 -> ZeRO-1 x1 -> ZeRO-2 x2, and
ZeRO-1 x1 -> FSDP2 x2 -> one plain process -> ZeRO-3 x2.

One pool per world size serves every check (starting DeepSpeed costs
seconds per process here); the functions run on the ranks are in
``ds_cases``.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from spawning import spawns

import bytecp

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed (make test installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ds_cases as dc  # noqa: E402
from bytecp.adapters.testing import (  # noqa: E402
    AdapterCase,
    AdapterFixtures,
    RefusalTests,
    ReplicaHintTests,
    ReshardTests,
)
from dist.pool import WorkerPool  # noqa: E402

pytestmark = pytest.mark.timeout(600)

ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


# the ranks' native shutdown after DeepSpeed's process groups takes 10 s or more
# here; every check has run by then, so the pools are stopped without waiting
@pytest.fixture(scope="module")
@spawns
def pool2() -> Iterator[WorkerPool]:
    p = WorkerPool(2, env=ENV)
    yield p
    p.close(kill=True)


@pytest.fixture(scope="module")
@spawns
def pool1() -> Iterator[WorkerPool]:
    p = WorkerPool(1, env=ENV)
    yield p
    p.close(kill=True)


@pytest.fixture(scope="module")
def pool3() -> Iterator[WorkerPool]:
    p = WorkerPool(3, env=ENV)
    yield p
    p.close(kill=True)


def assert_equal(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], what: str,
                 keys: set[str] | None = None) -> None:
    names = keys if keys is not None else set(ref)
    assert names <= set(got), f"{what}: missing {sorted(names - set(got))}"
    bad = [k for k in sorted(names) if not torch.equal(ref[k], got[k])]
    assert not bad, f"{what}: differ at {bad}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_same_size_resume_is_bitwise(pool2: WorkerPool, tmp_path: Path, stage: int) -> None:
    saved, loaded, after, resumed = pool2.run(dc.ds_roundtrip, str(tmp_path / "ck"), stage)[0]
    assert_equal(saved, loaded, f"ZeRO-{stage} loaded")
    assert_equal(after, resumed, f"ZeRO-{stage} one step after the resume")


@pytest.mark.parametrize("stage", [1, 3])
def test_the_engine_form_is_the_whole_engine(pool2: WorkerPool, tmp_path: Path, stage: int) -> None:
    """Steps, samples and the LR warm-up go on where they stopped (they restarted at 0 before)."""
    got = pool2.run(dc.ds_engine_resume, str(tmp_path / "ck"), stage)
    for r in got:
        assert r["saved"]["global_steps"] == 3 and r["saved"]["global_samples"] == 3 * 2 * 2
        assert r["loaded"] == r["saved"]  # steps, samples, skipped steps, scheduler, learning rates
        assert r["after"] == r["uninterrupted"]  # the next losses, exactly
        assert_equal(r["saved_tensors"], r["loaded_tensors"], f"ZeRO-{stage} engine form")
        # exclude=["engine.lr_scheduler"]: the counters come back, the fresh engine's warm-up stays at its start
        # (the optimizer's learning rates come with its param groups; the scheduler sets them at its next step)
        assert r["partly"]["global_steps"] == 3 and r["partly"]["scheduler"] == r["fresh"]["scheduler"]
        assert r["fresh"]["scheduler"] != r["saved"]["scheduler"]
        # exclude=["optimizer"]: the model is loaded and the fp32 masters follow it (else the next step
        # would write the old weights back); the optimizer keeps no state of the checkpoint's
        assert r["no_opt_state"]
        saved_model = {k: v for k, v in r["saved_tensors"].items() if k.startswith(("model.", "master."))}
        assert_equal(saved_model, r["no_opt_model"], "model and masters with the optimizer excluded")


@pytest.mark.parametrize("stage", [1, 3])
def test_fp16_and_its_loss_scaler_resume_exactly(pool2: WorkerPool, tmp_path: Path, stage: int) -> None:
    got = pool2.run(dc.ds_fp16_roundtrip, str(tmp_path / "ck"), stage)
    for r in got:
        assert r["saved"]["skipped_steps"] >= 1 and r["saved"]["last_overflow_iter"] >= 0  # it did overflow
        assert r["loaded"] == r["saved"]  # counters, cur_scale, cur_iter, last_overflow_iter, hysteresis
        assert_equal(r["saved_tensors"], r["loaded_tensors"], f"fp16 ZeRO-{stage}")  # fp16 model, fp32 masters
        assert r["after"] == r["uninterrupted"]
    saved = got[0]["saved_tensors"]
    # another stage, and one process outside DeepSpeed: the fp16 weights and the fp32 masters
    other_stage = 3 if stage == 1 else 1
    assert_equal(saved, pool2.run(dc.ds_fp16_load, str(tmp_path / "ck"), other_stage)[0],
                 f"fp16 ZeRO-{stage} -> ZeRO-{other_stage}")
    whole = bytecp.load_state_dict(str(tmp_path / "ck"))
    for k, v in whole["model"].items():
        assert torch.equal(v, saved[f"model.{k}"]), k
        assert torch.equal(whole["optimizer"]["state"][k]["fp32"], saved[f"master.{k}"]), k


def test_zero3_with_hpz_resumes_bitwise(pool2: WorkerPool, tmp_path: Path) -> None:
    """hpZ's secondary partition (``ds_secondary_tensor``) lives only between
    backward and step: the primary partitions are the checkpoint."""
    saved, loaded, after, resumed = pool2.run(dc.ds_roundtrip, str(tmp_path / "ck"), 3, zero_hpz_partition_size=2,
                                              stage3_param_persistence_threshold=0)[0]
    assert_equal(saved, loaded, "ZeRO-3 + hpZ loaded")
    assert_equal(after, resumed, "ZeRO-3 + hpZ one step after the resume")


def merged(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Every stage's snapshot in one (the ranks of a stage report the same tensors)."""
    out: dict[str, torch.Tensor] = {}
    for p in parts:
        out.update(p)
    return out


@pytest.mark.parametrize(("zero", "bf16"), [(0, False), (1, False), (0, True), (1, True)],
                         ids=["zero0-fp32", "zero1-fp32", "zero0-bf16-BF16_Optimizer", "zero1-bf16"])
def test_pipeline_saves_under_the_models_own_names_and_reloads_anywhere(
        pool2: WorkerPool, pool1: WorkerPool, tmp_path: Path, zero: int, bf16: bool) -> None:
    """A PipelineEngine of 2 stages: each stage writes its layers under the
    names the same nn.Sequential has (``<layer index>.<param>``); it resumes
    bitwise (the next losses too), and loads at 1 stage (data-parallel 2),
    without a pipeline as a ZeRO-2 engine and, fp32, in one plain process.
    (DeepSpeed itself cannot load its own bf16 stage-0 pipeline checkpoint.)"""
    url = str(tmp_path / "ck")
    got = pool2.run(dc.pipe_roundtrip, url, 2, zero, bf16)
    saved, loaded = merged([r["saved"] for r in got]), merged([r["loaded"] for r in got])
    assert {k.split(".", 1)[1].split(".")[0] for k in saved} == {"0", "2", "4", "6"}  # both stages, by layer index
    assert_equal(saved, loaded, "pipeline 2 stages -> 2 stages")
    assert got[0]["after"] == got[0]["uninterrupted"] and got[0]["steps"] == (2, 2)
    assert_equal(saved, merged(pool2.run(dc.pipe_load, url, 1, zero, bf16)), "pipeline 2 stages -> 1 stage (DP 2)")
    if bf16:
        return
    assert_equal(saved, merged(pool2.run(dc.pipe_flat_engine_load, url, 2)), "pipeline -> ZeRO-2 without a pipeline")
    assert_equal(saved, pool1.run(dc.pipe_plain_load, url)[0], "pipeline -> one plain process")


@pytest.mark.parametrize("stage", [1, 2])
def test_moe_experts_by_global_index_reload_at_another_ep(pool2: WorkerPool, pool1: WorkerPool, tmp_path: Path,
                                                         stage: int) -> None:
    """DeepSpeed-MoE, 4 experts over ep=2 (each rank builds 2, named 0 and 1
    locally): saved by global index, so the resume is bitwise (the next two
    losses too, the gate's random numbers restored with RNGState) and the
    checkpoint loads at ep=1 on 2 ranks (experts partitioned over both) and
    on 1 rank. (DeepSpeed's ds_to_universal concatenates the two ranks'
    local experts here.)"""
    url = str(tmp_path / "ck")
    got = pool2.run(dc.moe_roundtrip, url, 2, stage)
    saved, loaded = merged([r["saved"] for r in got]), merged([r["loaded"] for r in got])
    experts = {k.split("deepspeed_experts.")[1].split(".")[0] for k in saved if "deepspeed_experts." in k}
    assert experts == {"0", "1", "2", "3"}
    assert_equal(saved, loaded, f"MoE ep=2 ZeRO-{stage} resume")
    assert all(r["after"] == r["uninterrupted"] for r in got)
    assert_equal(saved, merged(pool2.run(dc.moe_load, url, 1, stage)), "MoE ep=2 -> ep=1 on 2 ranks")
    assert_equal(saved, pool1.run(dc.moe_load, url, 1, stage)[0], "MoE ep=2 -> 1 rank")
    whole = bytecp.load_state_dict(url)  # outside DeepSpeed: every expert under its global name
    assert_equal({k: v for k, v in saved.items() if k.startswith("model.")},
                  {f"model.{k}": v for k, v in whole["model"].items()}, "MoE ep=2 -> load_state_dict")


@pytest.fixture(scope="module")
@spawns
def tp_pool2() -> Iterator[WorkerPool]:
    """Ranks for AutoTP engines only: DeepSpeed keeps the tensor-parallel groups
    an AutoTP engine makes for the life of the process, and a later engine
    without TP in that process fails to start."""
    p = WorkerPool(2, env=ENV)
    yield p
    p.close(kill=True)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_autotp_shards_are_boxes_of_the_full_tensors(tp_pool2: WorkerPool, pool2: WorkerPool, pool1: WorkerPool,
                                                     tmp_path: Path, stage: int) -> None:
    """A transformers Llama trained with AutoTP (tp=2, ZeRO 0/1/2): q/k/v,
    gate/up (column), o/down (row) and lm_head are saved as boxes of the full
    tensors, their masters and moments too. It resumes bitwise (the next two
    losses too); every rank's shard equals its box of the full tensors one
    process reads; it loads at tp=1 on 2 ranks, into FSDP2 on 2 ranks and
    into a plain transformers model with torch AdamW in one process,
    bitwise; and the Hugging Face
    export gives the TP model's logits (to the TP all-reduce's rounding)."""
    from transformers import LlamaForCausalLM

    from bytecp.interop.hf_export import export_hf

    url = str(tmp_path / "ck")
    got = tp_pool2.run(dc.tp_roundtrip, url, 2, stage, timeout=300)
    for r in got:
        assert_equal(r["saved"], r["loaded"], f"AutoTP ZeRO-{stage} resume")
        assert r["after"] == r["uninterrupted"]
        assert r["against_full"] == []  # each shard is its box of the full tensors
        assert len(r["sharded"]) == 15  # 7 linear layers x 2 blocks + lm_head
    if stage == 1:  # tp=2 -> tp=1 on 2 ranks (new processes: see tp_pool2)
        fresh = WorkerPool(2, env=ENV)
        try:
            assert fresh.run(dc.tp_other_load, url, 1, stage, timeout=300) == [[], []]
        finally:
            fresh.close(kill=True)
    assert pool1.run(dc.tp_plain_load, url, timeout=300) == [[]]  # no engine: any process
    if stage == 2:  # FSDP2 over 2 ranks, no DeepSpeed
        assert pool2.run(dc.tp_fsdp2_load, url, timeout=300) == [[], []]
    export_hf(url, str(tmp_path / "hf"), config=dc.llama_config().to_dict())
    model = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.arange(1, 9).view(1, 8)).logits
    assert torch.allclose(logits, got[0]["logits"], rtol=0, atol=1e-5)


def test_lazy_async_save_of_an_engine(pool2: WorkerPool, tmp_path: Path) -> None:
    saved, loaded = pool2.run(dc.ds_lazy, str(tmp_path / "ck"), 3)[0]
    assert_equal(saved, loaded, "ZeRO-3 lazy save")


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_keeps_the_fp32_master(pool2: WorkerPool, tmp_path: Path, stage: int) -> None:
    saved, loaded, after, resumed = pool2.run(dc.ds_roundtrip, str(tmp_path / "ck"), stage, True)[0]
    assert saved["model.0.weight"].dtype == torch.bfloat16
    assert not torch.equal(saved["model.0.weight"].float(), saved["master.0.weight"])
    assert_equal(saved, loaded, f"bf16 ZeRO-{stage} loaded")
    assert_equal(after, resumed, f"bf16 ZeRO-{stage} one step after the resume")


@pytest.mark.slow
def test_across_stages_sizes_and_frameworks(pool1: WorkerPool, pool2: WorkerPool, tmp_path: Path) -> None:
    a, b, c = (str(tmp_path / n) for n in "abc")
    # ZeRO-3 on 2 ranks, saved as {"model": engine}
    z3 = pool2.run(dc.ds_save, a, 3, 2, "engine")[0]
    # -> ZeRO-1 on 1 rank (DP 2 -> 1), both state forms; trains one step and saves
    loaded, z1 = pool1.run(dc.ds_load, a, 1, "pair", 1, b)[0]
    assert_equal(z3, loaded, "ZeRO-3 x2 -> ZeRO-1 x1")
    # -> ZeRO-2 on 2 ranks (DP 1 -> 2)
    loaded2, _ = pool2.run(dc.ds_load, b, 2, "engine")[0]
    assert_equal(z1, loaded2, "ZeRO-1 x1 -> ZeRO-2 x2")
    # -> FSDP2 on 2 ranks: model and Adam state (fp32 model: the master is the model)
    loaded3, fsdp = pool2.run(dc.fsdp2_load_train_save, b, c)[0]
    # every key of the engine's state but its fp32 master (FSDP2's fp32 model is its own master)
    assert_equal(z1, loaded3, "ZeRO-1 x1 -> FSDP2 x2", keys={k for k in z1 if not k.startswith("master.")})
    # -> one plain process, which trains one step and saves
    d = str(tmp_path / "d")
    plain, stepped = pool1.run(dc.plain_load, c, d)[0]
    assert_equal(fsdp, plain, "FSDP2 x2 -> plain")
    # -> back to ZeRO-3 on 2 ranks: the fp32 master is refreshed from the model (a plain job has no
    # engine state: the engine keeps its own counters)
    back, _ = pool2.run(dc.ds_load, d, 3, "engine", exclude=("engine",))[0]
    assert_equal(stepped, back, "plain -> ZeRO-3 x2")
    assert_equal({k[len("model."):]: v for k, v in back.items() if k.startswith("model.")},
                 {k[len("master."):]: v for k, v in back.items() if k.startswith("master.")}, "ZeRO-3 master")


def test_unsupported_layout_fails_at_save_on_every_rank(pool2: WorkerPool, tmp_path: Path) -> None:
    # ZeRO stage 0 with bf16 keeps its master weights in DeepSpeed's FP16_UnfusedOptimizer, not mapped
    out = pool2.run(dc.refuses, 0, str(tmp_path / "ck"), True)
    for kind, msg in out:
        assert kind == "DistributedCheckpointError", msg
        assert "rank(s) 0, 1" in msg and "FP16_UnfusedOptimizer" in msg and "use ZeRO stage 1" in msg, msg
    assert not (tmp_path / "ck" / "metadata.json").exists()


def test_a_mapping_outside_the_partition_fails_on_every_rank(pool2: WorkerPool, tmp_path: Path) -> None:
    for kind, msg in pool2.run(dc.refuses_bad_mapping, str(tmp_path / "ck")):
        assert kind == "DistributedCheckpointError", msg
        assert "rank(s) 1" in msg and "parameter '0.bias' of param group 0" in msg, msg
        assert "engine.save_checkpoint" in msg, msg
    assert not (tmp_path / "ck" / "metadata.json").exists()


def test_another_optimizer_state(pool2: WorkerPool, tmp_path: Path) -> None:
    saved, loaded = pool2.run(dc.ds_sgd_roundtrip, str(tmp_path / "ck"), 3)[0]
    assert_equal(saved, loaded, "SGD momentum under ZeRO-3")


@pytest.mark.slow
def test_zero3_with_cpu_offload(pool2: WorkerPool, tmp_path: Path) -> None:
    off = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    saved, loaded, after, resumed = pool2.run(dc.ds_roundtrip, str(tmp_path / "ck"), 3, False, **off)[0]
    assert_equal(saved, loaded, "ZeRO-3 offloaded, loaded")
    assert_equal(after, resumed, "ZeRO-3 offloaded, one step after the resume")


class TestDeepSpeedContract(AdapterFixtures, ReshardTests, ReplicaHintTests, RefusalTests):
    """The adapter contract third-party adapters run, on ZeRO-3 x2: one process
    loads the full tensors DeepSpeed's own ``safe_get_full_*`` readers report,
    replica hints name exactly the holders, the refusal reaches every rank.
    (Round trips are the bitwise tests above: the contract's compares
    ``state_dict()`` values, and ZeRO-3's hold uninitialised padding.)"""

    @pytest.fixture
    def case(self) -> AdapterCase:
        return AdapterCase(framework="deepspeed", build="ds_cases:contract_state", full_state="ds_cases:contract_full",
                           unsupported="ds_cases:contract_unsupported", refusal=r"ZeRO stage 0 with mixed precision")

    @pytest.fixture
    def run_on_ranks(self, pool2: WorkerPool) -> object:
        return lambda fn, *args: pool2.run(fn, *args)


def global_steps(per_rank: list[list[list[int]]]) -> list[list[int]]:
    """Each global step's samples (sorted) from every rank's per-step ids."""
    n = max(len(steps) for steps in per_rank)
    return [sorted(x for steps in per_rank if j < len(steps) for x in steps[j]) for j in range(n)]


def test_training_dataloader_continues_across_data_parallel_sizes(pool1: WorkerPool, pool2: WorkerPool,
                                                                  pool3: WorkerPool, tmp_path: Path) -> None:
    """``deepspeed.initialize(training_data=...)``: DeepSpeed's loader keeps no
    position (its own checkpoints restart the epoch). Saved by 2 ranks in
    epoch 1 after 5 steps of 12 samples, loaded by 3 ranks (micro-batch 4),
    by 1 (micro-batch 6, 2 accumulation steps) and by 2 (its iteration
    already begun): every later step holds the uninterrupted run's samples."""
    url = str(tmp_path / "ck")
    saved = pool2.run(dc.ds_data_save, url, 6, 1, 5, 1)
    full = global_steps([r["before"] + r["after"] for r in saved])
    assert len(full) == 12 and sorted(x for s in full for x in s) == list(range(144))
    for pool, mbs, gas, early in ((pool3, 4, 1, False), (pool1, 6, 2, False), (pool2, 6, 1, True)):
        got = pool.run(dc.ds_data_load, url, mbs, gas, early_iter=early)
        assert all(r["epoch"] == 1 and r["steps"] == 12 for r in got), got  # 5 restored + 7
        assert global_steps([r["after"] for r in got]) == full[5:], (mbs, gas)


def test_a_training_dataloader_position_that_does_not_divide_is_refused(pool2: WorkerPool, pool3: WorkerPool,
                                                                        tmp_path: Path) -> None:
    """50 samples consumed by 2 ranks do not divide among 3: refused on every
    rank before the load; approximate: resumed at 48, 2 samples seen twice."""
    url = str(tmp_path / "ck")
    saved = pool2.run(dc.ds_data_save, url, 5, 1, 5, 0)
    for r in pool3.run(dc.ds_data_load, url, 4, 1):
        line = next(x for x in r["error"].splitlines() if "DataReshardError" in x)
        assert "'training_dataloader' (LoaderPosition, deepspeed)" in line and "do not divide among 3" in line
        assert line.endswith("load with data_reshard='approximate' to accept that")
    got = pool3.run(dc.ds_data_load, url, 4, 1, "approximate")
    everything = [x for r in saved for s in r["before"] for x in s] + [x for r in got for s in r["after"] for x in s]
    assert len(everything) - len(set(everything)) == 2 and set(everything) == set(range(144))
    # exclude=["training_dataloader"]: the loader keeps its own (fresh) position
    kept = pool3.run(dc.ds_data_load, url, 4, 1, exclude=["training_dataloader"])
    assert sorted(x for r in kept for s in r["after"] for x in s) == list(range(144))
    # a checkpoint without a position (an engine without training_data): the epoch starts over, with a warning
    bare = str(tmp_path / "bare")
    pool2.run(dc.ds_engine_save, bare)
    for r in pool2.run(dc.ds_data_load, bare, 6, 1):
        assert len(r["after"]) == 12 and any("holds no position" in m for m in r["logs"]), r["logs"]


def test_the_curriculum_sampler_continues_across_data_parallel_sizes(pool1: WorkerPool, pool2: WorkerPool,
                                                                     pool3: WorkerPool, tmp_path: Path) -> None:
    """DeepSpeed's curriculum sampler (one cluster, 2 epochs): rank 0 draws
    each global batch of 12 from the shuffled cluster and reshuffles it with
    its own generator when used up (after step 12). Saved by 2 ranks after 5
    steps, loaded by 3, 1 and 2 ranks: the next 15 global steps, across the
    reshuffle, hold the uninterrupted run's samples (its generator restored,
    which DeepSpeed's own checkpoint does not). Each resumed job starts from
    the cluster files as they stood at the save: DeepSpeed keeps them on
    disk, outside any checkpoint, and the saving run rewrote them when it
    reshuffled."""
    url, clusters = str(tmp_path / "ck"), str(tmp_path / "clusters")
    saved = pool2.run(dc.ds_data_save, url, 6, 1, 5, 0, clusters, 15)
    full = global_steps([r["before"] + r["after"] for r in saved])
    assert len(full) == 20 and sorted(x for s in full[:12] for x in s) == list(range(144))
    for pool, mbs, gas in ((pool3, 4, 1), (pool1, 6, 2), (pool2, 6, 1)):
        mine = str(tmp_path / f"clusters-{mbs}-{gas}")
        pool.run(dc.clusters_as_saved, clusters, mine)
        got = pool.run(dc.ds_data_load, url, mbs, gas, clusters=mine, after=15)
        assert global_steps([r["after"] for r in got]) == full[5:], (mbs, gas)
