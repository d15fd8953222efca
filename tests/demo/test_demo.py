"""``bytecp demo`` end to end, as ``make demo`` runs it, and every stage's
outcome checked from its ``summary.json`` and from storage itself:

- the 2-process FSDP2 job: rank 1 SIGKILLed by the demo during the save
  of step-6 (after its part was staged), rank 0 stopped by itself with
  bytecp's error naming rank 1, step-6 never committed;
- the restarts: 1 process (FSDP2) from step-4, the latest committed one,
  then 3 processes (DDP) from step-8, each restored bitwise;
- the loss: every step trained, equal to an uninterrupted run up to
  rounding, the steps replayed after the crash equal to their first run;
- one stall row per checkpoint, from every rank's report;
- the export and the evaluation job: the same loss to the last bit, without
  bytecp's checkpoint code or torch.distributed in that process;
- no process left behind.

And on their own: the launcher's last resort (a survivor that does not stop
within the grace period is killed, and the outcome says so), and the
evaluation job reading both export layouts (a sharded Hugging Face
directory with its index, a single ``model.safetensors``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from spawning import spawns

import bytecp
from bytecp.manager import list_checkpoints


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
@spawns
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    out = tmp_path_factory.mktemp("demo") / "demo-out"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    p = subprocess.run([sys.executable, "-m", "bytecp.cli", "demo", "--out", str(out)], env=env,
                       capture_output=True, text=True, timeout=300)
    if p.returncode != 0:  # the problems, then each rank's log (a stuck save leaves its stack there)
        summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
        logs = "".join(f"\n--- {f.name} ---\n{f.read_text(errors='replace')[-4000:]}"
                       for f in sorted((out / "logs").glob("*.log")) if f.stat().st_size)
        pytest.fail(f"the demo failed: {summary.get('problems')}\n{p.stdout[-3000:]}{p.stderr[-3000:]}{logs}")
    return out, json.loads((out / "summary.json").read_text()), p.stdout


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_demo_story_holds(demo: tuple[Path, dict, str]) -> None:
    out, s, stdout = demo
    assert s["ok"] and s["problems"] == [], s["problems"]
    for stage in ("1/6", "2/6", "3/6", "4/6", "5/6", "6/6"):
        assert f"[demo] {stage}" in stdout
    assert s["seconds"] < 240, s["seconds"]


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_killed_rank_and_the_in_flight_checkpoint(demo: tuple[Path, dict, str]) -> None:
    out, s, _ = demo
    first = s["jobs"]["FSDP2 x2"]
    victim, survivor = first["exits"][1], first["exits"][0]
    assert first["victim"]["rank"] == 1 and first["victim"]["step"] == 6 and first["victim"]["staged"]
    assert victim["how"] == "killed by the demo" and victim["returncode"] == -9
    assert survivor["how"] == "exited" and survivor["returncode"] == 3 and survivor["after_failure_s"] < 30
    stopped = first["result"]["stopped"]
    assert stopped["step"] == 7 and "rank 1" in stopped["save_error"], stopped
    assert first["result"]["saves"]["6"]["outcome"] == "failed"
    assert [first["result"]["saves"][k]["outcome"] for k in ("2", "4")] == ["committed", "committed"]
    flight = s["in_flight"]
    assert flight["checkpoint"] == "step-6" and not flight["committed"] and not flight["metadata_json"]
    assert flight["committed_after_crash"] == ["step-2", "step-4"] and flight["latest_after_crash"] == "step-4"
    for job in s["jobs"].values():  # the launcher left nothing running
        for e in job["exits"]:
            assert not _alive(e["pid"]), e


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_restarts_use_the_latest_committed_checkpoint_bitwise(demo: tuple[Path, dict, str]) -> None:
    _, s, _ = demo
    assert s["restores"] == [
        {"job": "FSDP2 x1", "restored": "step-4", "latest_committed_before": "step-4"},
        {"job": "DDP x3", "restored": "step-8", "latest_committed_before": "step-8"},
    ]
    for label in ("FSDP2 x1", "DDP x3"):
        job = s["jobs"][label]
        assert all(e["how"] == "exited" and e["returncode"] == 0 for e in job["exits"]), job["exits"]
        check = job["result"]["restore_check"]
        assert check["tensors"] > 0 and check["differ"] == [], check


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_the_loss_continues(demo: tuple[Path, dict, str]) -> None:
    _, s, _ = demo
    loss = s["loss"]
    steps = sorted(int(k) for k in loss["trajectory"])
    assert steps == list(range(1, 13))
    assert loss["trained_by"]["4"] == "FSDP2 x2" and loss["trained_by"]["5"] == "FSDP2 x1"
    assert loss["trained_by"]["8"] == "FSDP2 x1" and loss["trained_by"]["9"] == "DDP x3"
    for k, v in loss["trajectory"].items():
        assert abs(v - loss["uninterrupted"][k]) < 1e-4, (k, v, loss["uninterrupted"][k])
    assert loss["trajectory"]["12"] < loss["trajectory"]["1"] - 1.0  # it learned
    assert sorted(loss["replayed"]) == ["5", "6"]
    for before, after in loss["replayed"].values():
        assert abs(before - after) < 1e-4


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_one_stall_row_per_checkpoint_from_every_rank(demo: tuple[Path, dict, str]) -> None:
    out, s, _ = demo
    rows = s["checkpoints"]
    assert [(r["checkpoint"], r["saved_by"], r["committed"]) for r in rows] == [
        ("step-2", "FSDP2 x2", True), ("step-4", "FSDP2 x2", True), ("step-6", "FSDP2 x2", False),
        ("step-6", "FSDP2 x1", True), ("step-8", "FSDP2 x1", True),
        ("step-10", "DDP x3", True), ("step-12", "DDP x3", True),
    ]
    for r in rows:
        if r["committed"]:
            assert r["ranks_reported"] == r["world_size"] == len(r["paused_s"]), r
            assert all(0 <= p < r["seconds"] + 1 for p in r["paused_s"]) and r["bytes"] > 0, r
    assert s["kept"] == ["step-8", "step-10", "step-12"]
    assert [c.name for c in list_checkpoints(str(out / "run"))] == s["kept"]


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_export_and_evaluation_job(demo: tuple[Path, dict, str]) -> None:
    out, s, _ = demo
    ev = s["eval"]
    assert ev["equal"] and ev["training_job"] == ev["eval_job"] and isinstance(ev["eval_job"], float)
    assert not ev["eval_job_distributed"]
    # (bytecp.plugins: the one-line message naming the demo extra, should safetensors be missing)
    assert set(ev["eval_job_bytecp_modules"]) <= {"bytecp", "bytecp.errors", "bytecp.demo", "bytecp.demo.model",
                                                  "bytecp.plugins"}
    # the exported tensors are the final checkpoint's model, bitwise
    exported: dict[str, torch.Tensor] = {}
    for f in s["export"]["files"]:
        exported.update(load_file(f))
    sd = bytecp.load_state_dict(str(out / "run" / "step-12"))["model"]
    assert sorted(exported) == sorted(sd)
    for k, v in sd.items():
        assert torch.equal(exported[k], v), k


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.spawn
def test_launcher_kills_a_survivor_past_the_grace_period(tmp_path: Path) -> None:
    from bytecp.demo.launch import run_job

    args = ["--checkpoints", str(tmp_path / "run"), "--until", "4", "--save-every", "2", "--die-at-save", "2"]
    o = run_job("FSDP2 x2", 2, args, str(tmp_path / "work"), str(tmp_path / "logs"), kill=True, grace=0.0)
    assert o.exits[1].how == "killed by the demo"
    assert o.exits[0].how == "killed after the grace period", o.exits
    assert not any(_alive(e.pid) for e in o.exits)
    assert list_checkpoints(str(tmp_path / "run")) == []


def test_evaluation_job_reads_the_sharded_and_the_single_file_layouts(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from bytecp.demo.evaluate import main, read_exported
    from bytecp.demo.model import TinyGPT

    torch.manual_seed(3)
    sd = {k: v.contiguous() for k, v in TinyGPT().state_dict().items()}
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    sharded, single = tmp_path / "sharded", tmp_path / "single"
    sharded.mkdir()
    single.mkdir()
    for file, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(sharded / file))
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    save_file(sd, str(single / "model.safetensors"))
    for where in (sharded, single, single / "model.safetensors"):
        got, files = read_exported(str(where))
        assert sorted(got) == names and all(torch.equal(got[k], sd[k]) for k in names), where
    assert len(read_exported(str(sharded))[1]) == 2
    losses = []
    threads = torch.get_num_threads()
    try:
        for where in (sharded, single):
            assert main([str(where), "--json", str(tmp_path / "ev.json")]) == 0
            losses.append(json.loads((tmp_path / "ev.json").read_text())["loss"])
    finally:
        torch.set_num_threads(threads)  # the job sets one thread, as the training processes do
    assert losses[0] == losses[1]
    with pytest.raises(SystemExit, match="no model.safetensors.index.json or model.safetensors"):
        read_exported(str(tmp_path / "nothing-here"))
