"""DeepSpeed's own checkpoints (``engine.save_checkpoint``, ZeRO 1, 2, 3 and
bf16, 2 gloo ranks on the CPU accelerator) load as bytecp sources with no
conversion: bitwise in one process with no torch.distributed (model, fp32
masters, Adam moments, step, the engine's counters; checked against
DeepSpeed's own ``zero_to_fp32`` too), and into a DeepSpeed engine at
another ZeRO stage and another data-parallel size, whose next losses are
the uninterrupted run's. Crafted files (a pickle that would run code, a
truncated optimizer file) are refused in one line.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from spawning import spawns

import bytecp
from bytecp.errors import CorruptCheckpointError
from bytecp.interop import find_source
from bytecp.storage_api import open_storage

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed (make test installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ds_source_cases as sc  # noqa: E402
from dist.pool import WorkerPool  # noqa: E402

pytestmark = pytest.mark.timeout(600)

ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
#: name of each written checkpoint -> (ZeRO stage, bf16)
CASES = {"z1": (1, False), "z2": (2, False), "z3": (3, False), "z1bf16": (1, True)}


@pytest.fixture(scope="module")
@spawns
def pool2() -> Iterator[WorkerPool]:
    p = WorkerPool(2, env=ENV)
    yield p
    p.close(kill=True)


@pytest.fixture(scope="module")
def written(pool2: WorkerPool, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Each case written once by DeepSpeed: its root folder and rank 0's view of the engine."""
    base = tmp_path_factory.mktemp("ds")
    out = {}
    for name, (stage, bf16) in CASES.items():
        out[name] = (base / name, pool2.run(sc.ds_write, str(base / name), stage, bf16)[0])
    return out


def _full(sd: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(_full(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("case", list(CASES))
def test_loads_in_one_process_bitwise(written: dict[str, Any], case: str) -> None:
    root, ref = written[case]
    stage, bf16 = CASES[case]
    got = _full(bytecp.load_state_dict(str(root / "global_step2")))
    snap = ref["snap"]
    names = [k.removeprefix("model.") for k in snap if k.startswith("model.")]
    bad = []
    for n in names:
        model = got[f"model.{n}"]
        want_model = snap[f"model.{n}"] if stage != 3 or not bf16 else snap[f"master.{n}"]
        master = got.get(f"optimizer.state.{n}.fp32", model)
        checks = [("model", model, want_model), ("master", master, snap[f"master.{n}"]),
                  ("exp_avg", got[f"optimizer.state.{n}.exp_avg"], snap[f"exp_avg.{n}"]),
                  ("exp_avg_sq", got[f"optimizer.state.{n}.exp_avg_sq"], snap[f"exp_avg_sq.{n}"]),
                  ("step", got[f"optimizer.state.{n}.step"], snap["step"])]
        bad += [f"{what} {n}" for what, a, b in checks if not _same(a, b)]
    assert not bad, f"{case}: differ at {bad}"
    assert (bf16 and stage != 3) == any(k.endswith(".fp32") for k in got), "masters stored apart only under bf16"
    assert got["engine.global_steps"] == ref["counters"]["global_steps"] == 2
    assert got["engine.global_samples"] == ref["counters"]["global_samples"]
    assert got["engine.lr_scheduler.last_batch_iteration"] == ref["counters"]["scheduler"]["last_batch_iteration"]
    assert [g["params"] for g in got["optimizer.param_groups"]] == [names]
    assert got["optimizer.param_groups"][0]["lr"] == ref["counters"]["lr"][0]
    # DeepSpeed's own consolidation agrees
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(root))
    assert all(_same(fp32[n].contiguous(), snap[f"master.{n}"]) for n in names)


def test_the_root_folder_loads_its_latest_tag(written: dict[str, Any]) -> None:
    root, ref = written["z2"]
    got = _full(bytecp.load_state_dict(str(root)))
    assert _same(got["optimizer.state.0.weight.exp_avg"], ref["snap"]["exp_avg.0.weight"])
    assert find_source(open_storage(str(root))) == "deepspeed"


def test_a_plain_module_and_adamw_resume_from_it(written: dict[str, Any]) -> None:
    root, ref = written["z3"]
    got = sc.plain_step(str(root))
    snap = ref["snap"]
    for k, v in got.items():
        want = snap[k] if k != "step" else snap["step"]
        assert _same(v, want), k


def test_a_fresh_process_loads_the_model_without_importing_fsdp(written: dict[str, Any], tmp_path: Path) -> None:
    """Adapter detection imports no framework the process has not imported
    (FSDP pulls in DTensor and sympy: 0.7 s of a model-only load's 1 s)."""
    import subprocess

    root, ref = written["z2"]
    out = subprocess.run([sys.executable, "-c", sc.FRESH_MODEL_LOAD, str(root), str(tmp_path / "m.pt")],
                         check=True, capture_output=True, text=True, timeout=120, env={**__import__("os").environ, **ENV})
    assert out.stdout.strip() == "[]", out.stdout
    got = torch.load(tmp_path / "m.pt")
    assert all(_same(v, ref["snap"][f"model.{k}"]) for k, v in got.items())


def test_fsdp2_x2_resumes_from_it_bitwise(pool2: WorkerPool, written: dict[str, Any]) -> None:
    root, ref = written["z3"]
    for got in pool2.run(sc.fsdp2_read, str(root / "global_step2")):
        bad = [k for k, v in got.items() if not _same(v, ref["snap"][k])]
        assert not bad, f"ZeRO-3 x2 -> FSDP2 x2: differ at {bad}"


def test_a_manager_restores_the_newest_global_step(written: dict[str, Any], tmp_path: Path) -> None:
    """``CheckpointManager(run).restore`` on DeepSpeed's save folder: the newest
    ``global_stepN`` wins (an older one, truncated here, is never read)."""
    from bytecp.manager import CheckpointManager

    root, ref = written["z2"]
    run = tmp_path / "run"
    shutil.copytree(root / "global_step2", run / "global_step2")
    old = _copy(root, tmp_path / "old")
    (old / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    shutil.move(old, run / "global_step1")
    model = sc.dc.make_model(seed=4)
    opt = torch.optim.AdamW(model.parameters(), lr=sc.dc.STEPS_LR)
    assert CheckpointManager(str(run)).restore({"model": model, "optimizer": opt}, exclude=["engine"]) == 2
    got = sc.dc.torch_snapshot(model, opt)
    assert all(_same(v, ref["snap"][k]) for k, v in got.items())


def test_frozen_parameters_at_zero3_load_bitwise(pool2: WorkerPool, tmp_path: Path) -> None:
    """ZeRO-3 saves a frozen parameter as one partition per rank's model-states
    file: it loads whole, beside the trained ones, in one process and into a module."""
    want = pool2.run(sc.ds_write_frozen, str(tmp_path / "ck"))[0]
    got = bytecp.load_state_dict(str(tmp_path / "ck"), exclude=["optimizer", "engine"])["model"]
    assert set(got) == set(want) and all(_same(got[k], v) for k, v in want.items())
    model = sc.dc.make_model(seed=7)
    bytecp.load(str(tmp_path / "ck"), {"model": model}, exclude=["optimizer", "engine"])
    assert all(_same(v, want[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize(("case", "stage"), [("z1", 3), ("z3", 2), ("z2", 1)])
def test_an_engine_at_another_stage_resumes(pool2: WorkerPool, written: dict[str, Any], case: str,
                                            stage: int) -> None:
    root, ref = written[case]
    got = pool2.run(sc.ds_read, str(root), stage)
    for r in got:
        bad = [k for k in ref["snap"] if not _same(ref["snap"][k], r["snap"][k])]
        assert not bad, f"{case} -> ZeRO-{stage}: differ at {bad}"
        assert r["counters"] == ref["counters"]
    assert got[0]["after"] == ref["after"], "the resumed losses are the uninterrupted run's"


def test_an_engine_at_another_data_parallel_size_resumes(written: dict[str, Any]) -> None:
    root, ref = written["z3"]
    pool = WorkerPool(1, env=ENV)
    try:
        got = pool.run(sc.ds_read, str(root), 1)[0]
    finally:
        pool.close(kill=True)
    bad = [k for k in ref["snap"] if not _same(ref["snap"][k], got["snap"][k])]
    assert not bad, f"ZeRO-3 x2 -> ZeRO-1 x1: differ at {bad}"
    assert got["counters"]["global_steps"] == 2
    assert got["counters"]["lr"] == ref["counters"]["lr"]


def _copy(root: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ck"
    shutil.copytree(root / "global_step2", dst)
    return dst


class _RunsCode:
    def __reduce__(self) -> Any:
        import os

        return (os.system, ("echo pwned",))


def test_a_pickle_that_would_run_code_is_refused_in_one_line(written: dict[str, Any], tmp_path: Path) -> None:
    ck = _copy(written["z1"][0], tmp_path)
    torch.save({"module": {}, "param_shapes": [{}], "x": _RunsCode()}, ck / "mp_rank_00_model_states.pt")
    with pytest.raises(CorruptCheckpointError) as e:
        bytecp.load_state_dict(str(ck))
    msg = str(e.value)
    assert "\n" not in msg and "system" in msg and "mp_rank_00_model_states.pt" in msg


def test_a_truncated_optimizer_file_is_refused_in_one_line(written: dict[str, Any], tmp_path: Path) -> None:
    ck = _copy(written["z2"][0], tmp_path)
    f = ck / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CorruptCheckpointError) as e:
        bytecp.load_state_dict(str(ck))
    msg = str(e.value)
    assert "\n" not in msg and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in msg


@pytest.fixture(scope="module")
def universal(written: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """The ZeRO-2 checkpoint converted by DeepSpeed's ``ds_to_universal`` (beside its tag: ``latest_universal``)."""
    import subprocess

    root, ref = written["z2"]
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    str(root / "global_step2"), "--output_folder", str(root / "global_step2_universal"),
                    "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"],
                   check=True, capture_output=True, timeout=300, env={**__import__("os").environ, **ENV})
    return root, ref


def test_a_universal_checkpoint_loads_in_one_process_bitwise(universal: tuple[Path, dict[str, Any]]) -> None:
    root, ref = universal
    assert find_source(open_storage(str(root / "global_step2_universal"))) \
        == "deepspeed_universal"
    got = _full(bytecp.load_state_dict(str(root / "global_step2_universal")))
    snap = ref["snap"]
    names = [k.removeprefix("model.") for k in snap if k.startswith("model.")]
    bad = [f"{k} {n}" for n in names for k, a, b in (
        ("model", got[f"model.{n}"], snap[f"model.{n}"]),
        ("exp_avg", got[f"optimizer.state.{n}.exp_avg"], snap[f"exp_avg.{n}"]),
        ("exp_avg_sq", got[f"optimizer.state.{n}.exp_avg_sq"], snap[f"exp_avg_sq.{n}"]),
        ("step", got[f"optimizer.state.{n}.step"], snap["step"])) if not _same(a, b)]
    assert not bad, f"universal: differ at {bad}"
    assert got["engine.global_steps"] == 2 and [g["params"] for g in got["optimizer.param_groups"]] == [names]
    # on a remote storage its per-parameter files are parsed on threads: the same rows, in the same order
    from bytecp.interop import deepspeed_universal

    local = open_storage(str(root / "global_step2_universal"))
    remote = open_storage(str(root / "global_step2_universal"))
    remote.remote = True
    assert deepspeed_universal.read(remote)[1] == deepspeed_universal.read(local)[1]


def test_a_universal_checkpoint_resumes_an_engine_at_zero3(pool2: WorkerPool,
                                                           universal: tuple[Path, dict[str, Any]]) -> None:
    root, ref = universal
    got = pool2.run(sc.ds_read, str(root / "global_step2_universal"), 3)
    for r in got:
        bad = [k for k in ref["snap"] if not _same(ref["snap"][k], r["snap"][k])]
        assert not bad, f"universal -> ZeRO-3: differ at {bad}"
        assert r["counters"] == ref["counters"]
    assert got[0]["after"] == ref["after"]


def test_a_deepspeed_run_folder_resumes_what_latest_commits(written: dict[str, Any], tmp_path: Path) -> None:
    """DeepSpeed's ``latest`` is its commit point: a newer ``global_step3``
    holding part of a save (one optimizer file) is DeepSpeed's unfinished
    save, passed over; ``latest`` naming a tag that is not there is an error
    naming it; a run that moved onto bytecp resumes bytecp's newer checkpoint,
    and loading the run folder through ``latest`` then refuses, naming it."""
    from bytecp.manager import CheckpointManager
    from bytecp.tools.resume import decide

    root, ref = written["z2"]
    run = tmp_path / "run"
    shutil.copytree(root, run)
    (run / "global_step3").mkdir()
    shutil.copy(run / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", run / "global_step3")
    d = decide(str(run))
    assert (d.newest.name, d.newest.format) == ("global_step2", "deepspeed")
    assert [(u.rsplit("/", 1)[1], "never finished" in why) for u, why in d.passed_over] == [("global_step3", True)]
    model = sc.dc.make_model(seed=4)
    opt = torch.optim.AdamW(model.parameters(), lr=sc.dc.STEPS_LR)
    assert CheckpointManager(str(run)).restore({"model": model, "optimizer": opt}, exclude=["engine"]) == 2
    assert all(_same(v, ref["snap"][k]) for k, v in sc.dc.torch_snapshot(model, opt).items())

    (run / "latest").write_text("global_step5")
    with pytest.raises(bytecp.ResumeDecisionError, match=r"/latest names global_step5, which holds no DeepSpeed"):
        CheckpointManager(str(run)).restore({"model": model, "optimizer": opt}, exclude=["engine"])
    (run / "latest").write_text("global_step2")

    bytecp.save(str(run / "step-4"), {"model": model}, step=4)  # the job moved onto bytecp
    assert decide(str(run)).newest.name == "step-4"
    with pytest.raises(bytecp.CheckpointNotFoundError, match=r"names global_step2, but its newest checkpoint is .*step-4"):
        bytecp.load_state_dict(str(run))
