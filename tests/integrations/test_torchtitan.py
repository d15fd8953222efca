"""bytecp as torchtitan's checkpointer, tested with torchtitan 0.3.0's own
trainer (llama3 debug model) on gloo processes: two jobs (2 processes,
then 1) run every case below in turn, reusing each job's processes.

The test-process shims the trainer needs on CPU are in ``titan_shims.py``
(docs/torchtitan.md, "How it is tested").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from spawning import spawns

pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 is installed by `make torchtitan-install`")

import bytecp  # noqa: E402

from .titan_config import write_assets  # noqa: E402
from .titan_launch import launch, titan_args  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

FSDP2 = ["--parallelism.data_parallel_shard_degree", "2"]
TP2 = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
ONE = ["--parallelism.data_parallel_shard_degree", "1"]


def _ck(root: Path, step: int) -> str:
    return str(root / "checkpoint" / f"step-{step}")


@pytest.fixture(scope="module")
@spawns
def titan(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("titan")
    assets = write_assets(tmp / "assets")
    d = {k: tmp / k for k in ("seed", "from_seed", "base", "resume", "tp", "hf", "hf_load", "one", "dcp", "dcp_self")}
    results: dict[str, Any] = {"dirs": d}
    results.update(launch([
        # async saves every step, the newest 3 kept
        {"name": "base", "args": titan_args(
            d["base"], *FSDP2, "--training.steps", "6", "--checkpoint.interval", "1",
            "--checkpoint.async_mode", "async", "--checkpoint.keep_latest_k", "3")},
        # interrupted at step 4: the full state from another folder, lazy saves
        {"name": "resume", "verify": _ck(d["base"], 4), "args": titan_args(
            d["resume"], *FSDP2, "--training.steps", "6", "--checkpoint.interval", "1",
            "--checkpoint.async_mode", "lazy", "--checkpoint.keep_latest_k", "0",
            "--checkpoint.initial_load_path", _ck(d["base"], 4), "--checkpoint.no-initial-load-model-only")},
        # DCP's config function switched to bytecp by an override import; load_step, load_only
        {"name": "override", "verify": _ck(d["base"], 5), "args": titan_args(
            d["base"], *FSDP2, "--training.steps", "6", "--checkpoint.load_step", "5",
            "--checkpoint.load_only", "--override.imports", "bytecp.adapters.torchtitan.use_bytecp",
            config="dcp_debug")},
        # FSDP2 -> TP=2 (the dataloader's per-rank state is not resharded)
        {"name": "to_tp", "verify": _ck(d["base"], 6), "args": titan_args(
            d["tp"], *TP2, "--training.steps", "7", "--checkpoint.interval", "10",
            "--checkpoint.initial_load_path", _ck(d["base"], 6), "--checkpoint.no-initial-load-model-only",
            "--checkpoint.exclude_from_loading", "dataloader")},
        # a TP=2 save resumed at TP=2
        {"name": "tp_resume", "verify": _ck(d["tp"], 7), "args": titan_args(
            d["tp"], *TP2, "--training.steps", "8", "--checkpoint.interval", "10", "--checkpoint.load_only")},
        # the last step exported to Hugging Face safetensors, then loaded as an initial checkpoint
        {"name": "hf_export", "args": titan_args(
            d["hf"], *FSDP2, "--training.steps", "1", "--checkpoint.initial_load_path", _ck(d["base"], 6),
            "--checkpoint.last_save_model_only", "--checkpoint.last_save_in_hf")},
        # a job checkpointed by torch DCP to step 4 moves onto bytecp: the same folder, DCP's
        # config function switched by the override import, resumed from DCP's step-4
        {"name": "dcp_base", "args": titan_args(
            d["dcp"], *FSDP2, "--training.steps", "4", "--checkpoint.interval", "2", config="dcp_debug")},
        {"name": "dcp_switch", "verify": str(d["dcp"] / "checkpoint" / "step-4"), "args": titan_args(
            d["dcp"], *FSDP2, "--training.steps", "6", "--checkpoint.interval", "2",
            "--override.imports", "bytecp.adapters.torchtitan.use_bytecp", config="dcp_debug")},
        # the reference: torch DCP resuming its own step 4 (torchtitan's dataloader does not
        # replay an uninterrupted run exactly across a restart, whichever checkpointer)
        {"name": "dcp_self", "args": titan_args(
            d["dcp_self"], *FSDP2, "--training.steps", "6", "--checkpoint.interval", "10",
            "--checkpoint.initial_load_path", str(d["dcp"] / "checkpoint" / "step-4"),
            "--checkpoint.no-initial-load-model-only", config="dcp_debug")},
        # read by bytecp: torch DCP's load and Hugging Face reader raise in this run
        {"name": "hf_load", "verify_hf": _ck(d["hf"], 1), "no_dcp_hf": True, "args": titan_args(
            d["hf_load"], *FSDP2, "--training.steps", "1", "--checkpoint.load_only",
            "--checkpoint.initial_load_path", _ck(d["hf"], 1), "--checkpoint.initial_load_in_hf")},
    ], 2, tmp / "jobs", assets))
    results.update(launch([
        {"name": "one", "verify": _ck(d["base"], 6), "args": titan_args(
            d["one"], *ONE, "--training.steps", "7", "--checkpoint.interval", "10",
            "--checkpoint.initial_load_path", _ck(d["base"], 6), "--checkpoint.no-initial-load-model-only",
            "--checkpoint.exclude_from_loading", "dataloader")},
        # torchtitan's seed checkpoint (one process, model only), then a run starting from it
        {"name": "seed", "args": titan_args(d["seed"], *ONE, "--checkpoint.create_seed_checkpoint",
                                            "--checkpoint.last_save_model_only")},
        {"name": "from_seed", "verify": _ck(d["seed"], 0), "args": titan_args(
            d["from_seed"], *ONE, "--training.steps", "1", "--checkpoint.load_only",
            "--checkpoint.initial_load_path", _ck(d["seed"], 0))},
    ], 1, tmp / "jobs", assets))
    return results


def _ok(titan: dict[str, Any], name: str) -> dict[str, Any]:
    run = titan[name]
    assert "error" not in run, f"{name}: {run['error']}"
    return run


def _equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _equal(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b, where


def test_seed_checkpoint_is_model_only(titan: dict[str, Any]) -> None:
    _ok(titan, "seed")
    sd = bytecp.load_state_dict(_ck(titan["dirs"]["seed"], 0))
    assert list(sd) == ["model"] and "layers.0.attention.qkv_linear.wq.weight" in sd["model"]
    assert _ok(titan, "from_seed")["verified"] == len(sd["model"])


def test_resume_losses_equal_an_uninterrupted_run(titan: dict[str, Any]) -> None:
    base, resume = _ok(titan, "base"), _ok(titan, "resume")
    assert sorted(base["losses"], key=int) == [str(s) for s in range(1, 7)]
    assert resume["verified"] > 0 and sorted(resume["losses"], key=int) == ["5", "6"]
    assert [resume["losses"][s] for s in "56"] == [base["losses"][s] for s in "56"]


def test_lazy_saves_equal_async_saves_bitwise(titan: dict[str, Any]) -> None:
    d = titan["dirs"]
    _ok(titan, "resume")
    for step in (5, 6):  # base saved them eagerly (6: the last step, synchronously), resume lazily
        _equal(bytecp.load_state_dict(_ck(d["resume"], step)), bytecp.load_state_dict(_ck(d["base"], step)))


def test_keep_latest_k_keeps_the_newest_committed(titan: dict[str, Any]) -> None:
    _ok(titan, "base")
    assert sorted(p.name for p in (titan["dirs"]["base"] / "checkpoint").iterdir()) == ["step-4", "step-5", "step-6"]


def test_override_import_load_step_and_load_only(titan: dict[str, Any]) -> None:
    run = _ok(titan, "override")
    assert run["manager"] == "BytecpCheckpointManager" and run["verified"] > 0
    assert run["losses"] == {"6": titan["base"]["losses"]["6"]}
    assert run["save_s"] == []


def test_a_dcp_run_moves_onto_bytecp_without_losing_a_step(titan: dict[str, Any]) -> None:
    """torchtitan's DCP checkpoints of steps 2 and 4, then the job restarted with
    bytecp on the same folder: it resumes from DCP's step 4 (not from step 0),
    every model and optimizer tensor right after the load equals DCP's step 4,
    its losses equal torch DCP's own resume of that step, and its checkpoint of
    step 6 sits beside DCP's folders, which nothing removed."""
    dcp, switch, own = _ok(titan, "dcp_base"), _ok(titan, "dcp_switch"), _ok(titan, "dcp_self")
    base = _ok(titan, "base")["losses"]
    assert [dcp["losses"][s] for s in "1234"] == [base[s] for s in "1234"]
    assert switch["manager"] == "BytecpCheckpointManager" and switch["verified"] > 0
    assert sorted(switch["losses"], key=int) == ["5", "6"], switch["losses"]
    assert switch["losses"] == own["losses"]
    folder = titan["dirs"]["dcp"] / "checkpoint"
    assert {"step-2", "step-4", "step-6"} <= {p.name for p in folder.iterdir()}
    assert (folder / "step-4" / ".metadata").exists() and (folder / "step-6" / "metadata.json").exists()


def test_fsdp2_to_tp2_and_tp2_resume(titan: dict[str, Any]) -> None:
    assert _ok(titan, "to_tp")["verified"] > 0
    assert _ok(titan, "tp_resume")["verified"] > 0
    assert list(titan["tp_resume"]["losses"]) == ["8"]


def test_fsdp2_to_one_process(titan: dict[str, Any]) -> None:
    assert _ok(titan, "one")["verified"] > 0


def test_last_save_in_hf_and_initial_load_in_hf(titan: dict[str, Any]) -> None:
    _ok(titan, "hf_export")
    out = titan["dirs"]["hf"] / "checkpoint"
    assert sorted(p.name for p in out.iterdir()) == ["step-1"]  # the staging checkpoint is gone
    files = sorted(p.name for p in (out / "step-1").iterdir())
    assert "model.safetensors" in files or "model.safetensors.index.json" in files
    assert _ok(titan, "hf_load")["verified"] > 0


def _doc_snippet(marker: str) -> str:
    text = (Path(__file__).resolve().parents[2] / "docs" / "torchtitan.md").read_text()
    blocks = text.split("```python\n")[1:]
    return next(b.split("```")[0] for b in blocks if marker in b)


def test_docs_config_snippet_and_override_select_bytecp() -> None:
    from bytecp.adapters.torchtitan import BytecpCheckpointManager, use_bytecp
    from torchtitan.components.checkpoint import CheckpointManager

    namespace: dict[str, Any] = {}
    exec(_doc_snippet("def llama3_debug_bytecp"), namespace)  # as docs/torchtitan.md writes it
    config = namespace["llama3_debug_bytecp"]().checkpoint
    assert type(config) is BytecpCheckpointManager.Config
    assert (config.enable, config.interval, config.keep_latest_k, config.async_mode) == (True, 500, 3, "lazy")
    dcp = CheckpointManager.Config(enable=True, interval=7, async_mode="async", exclude_from_loading=["dataloader"])
    swapped = use_bytecp(dcp, io_threads=2)
    assert type(swapped) is BytecpCheckpointManager.Config
    assert (swapped.interval, swapped.async_mode, swapped.exclude_from_loading, swapped.io_threads) == (
        7, "async", ["dataloader"], 2)
    with pytest.raises(ValueError, match="checkpoint.async_mode='eager': choose one of disabled, async"):
        BytecpCheckpointManager.Config(async_mode="eager")  # type: ignore[arg-type]
