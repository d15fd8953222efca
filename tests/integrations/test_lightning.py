"""bytecp as PyTorch Lightning's checkpointing layer, tested with the real
``pytorch-lightning`` package on spawned gloo ranks.

Three spawned jobs serve every check (each costs 20-40 s here):

- **train**: 2 ranks, ``BytecpModelParallelStrategy`` (FSDP2 ``fully_shard``),
  ``ModelCheckpoint(every_n_train_steps=3, save_top_k=2)``, asynchronous
  saves at steps 3, 6, 9, 12 with the coordinator's commit delayed by 1 s (so
  "returned before the commit" is observable); the save at step 12 fails in
  its write phase on rank 1.
- **native**: the same run on 2 ranks checkpointed by Lightning's own
  ``ModelParallelStrategy`` (torch DCP folders with ``meta.pt``) to step 6.
- **resume**: 1 process: ``BytecpModelParallelStrategy`` resumes from step 6
  and trains to step 12 with lazy saves; then ``BytecpSingleDeviceStrategy``
  and ``BytecpDDPStrategy`` each resume from step 9; and
  ``BytecpModelParallelStrategy`` resumes from the native job's newest checkpoint.

Every rank sees the same batches, so the losses do not depend on the world
size and the resumed run must reproduce the uninterrupted one exactly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from spawning import spawns

pytest.importorskip("pytorch_lightning", reason="pytorch-lightning is not installed (make test installs it)")

from bytecp.adapters.lightning import BytecpCheckpointIO, latest_checkpoint  # noqa: E402

import bytecp  # noqa: E402
from bytecp.loading.opened import open_checkpoint, read_metadata  # noqa: E402
from bytecp.storage_api import open_storage  # noqa: E402
from tests.netport import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WORKER = Path(__file__).with_name("lightning_worker.py")
ROOT = Path(__file__).resolve().parents[2]




#: what the worker imports, imported once by the warm interpreter its ranks are forked from
#: (tests/warm.py): each rank costs its job, not a Lightning import (about 6 s of CPU here)
PRELOAD = ("pytorch_lightning", "pytorch_lightning.callbacks", "pytorch_lightning.strategies",
           "torchdata.stateful_dataloader", "bytecp.adapters.lightning", "torch.distributed.fsdp",
           "torch.distributed.tensor")


def spawn(world: int, jobs: list[dict[str, Any]], logs: Path, env: dict[str, str] | None = None,
          timeout: float = 400, *, warm: Any) -> None:
    """Run the worker on ``world`` ranks (as torchrun would set them up), forked
    from the ``warm`` fixture's interpreter that imported :data:`PRELOAD`; kill
    every process group it started if it outlives ``timeout``."""
    popen = warm(*PRELOAD).popen
    port = free_port()
    procs = []
    for r in range(world):
        penv = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                    NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONWARNINGS="ignore",
                    **(env or {}))
        out = open(logs / f"{jobs[0]['tag']}-rank{r}.log", "w")
        procs.append((popen([sys.executable, str(WORKER), json.dumps(jobs)], env=penv, cwd=ROOT,
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True), out))
    deadline = time.monotonic() + timeout
    try:
        for p, _ in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the {jobs[0]['tag']} job did not finish within {timeout} s; logs in {logs}")
    finally:
        for p, out in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            out.close()
    failed = [r for r, (p, _) in enumerate(procs) if p.returncode != 0]
    if failed:
        tail = (logs / f"{jobs[0]['tag']}-rank{failed[0]}.log").read_text()[-4000:]
        pytest.fail(f"the {jobs[0]['tag']} job failed on ranks {failed}:\n{tail}")


def record(out: Path, tag: str, rank: int = 0) -> dict[str, Any]:
    return json.loads((out / f"rank{rank}-{tag}.json").read_text())


@pytest.fixture(scope="module")
@spawns
def jobs(tmp_path_factory: pytest.TempPathFactory, warm: Any) -> dict[str, Path]:
    a = tmp_path_factory.mktemp("train")
    b = tmp_path_factory.mktemp("resume")
    common = {"every": 3, "top_k": 2}
    native = a / "native"
    native.mkdir()
    spawn(2, [{**common, "tag": "train", "strategy": "mp", "ckpt_dir": str(a / "run"), "out": str(a),
               "max_steps": 12, "fail_write": {"rank": 1, "from_step": 10}}],
          a, env={"BYTECP_FAULT_DELAY": "commit:0:1.0"}, warm=warm)
    # the same run checkpointed by Lightning's own ModelParallelStrategy (torch DCP), all kept
    spawn(2, [{**common, "top_k": -1, "tag": "native", "strategy": "native_mp", "ckpt_dir": str(native / "run"),
               "out": str(native), "max_steps": 6}], native, warm=warm)
    resume = {**common, "out": str(b), "ref": str(a)}
    spawn(1, [
        {**resume, "tag": "mp", "strategy": "mp", "ckpt_dir": str(b / "run"), "lazy": True,
         "resume": str(a / "run" / "step=6.ckpt"), "resume_step": 6, "max_steps": 12},
        {**resume, "tag": "single", "strategy": "single", "ckpt_dir": str(b / "single"),
         "resume": str(a / "run" / "step=9.ckpt"), "resume_step": 9, "max_steps": 10},
        {**resume, "tag": "ddp", "strategy": "ddp", "ckpt_dir": str(b / "ddp"),
         "resume": str(a / "run" / "step=9.ckpt"), "resume_step": 9, "max_steps": 10},
        # a job moving onto bytecp resumes from Lightning's own newest checkpoint
        {**resume, "tag": "from_native", "strategy": "mp", "ckpt_dir": str(b / "from_native"), "ref": str(native),
         "resume": latest_checkpoint(str(native / "run")), "resume_step": 6, "max_steps": 9},
    ], b, warm=warm)
    return {"train": a, "resume": b}


def test_each_rank_saves_its_own_fsdp2_shards(jobs: dict[str, Path]) -> None:
    url = str(jobs["train"] / "run" / "step=6.ckpt")
    storage = open_storage(url)
    md = read_metadata(storage)
    assert (md.framework, md.world_size, md.step) == ("fsdp2", 2, 6)
    boxes: dict[str, list[tuple[int, int, str]]] = {}
    for c in open_checkpoint(storage).all_rows():
        if c.global_shape and c.lengths[0]:
            boxes.setdefault(c.fqn, []).append((c.offsets[0], c.lengths[0], c.file.rsplit("/", 1)[1].split("-")[0]))
    # Shard(0) over 2 ranks: 13 rows -> 7 on rank 0 and 6 on rank 1, written by their owners (no gather)
    for fqn in ("model.net.0.weight", "model.net.0.bias", "optimizer.state.net.0.weight.exp_avg",
                "optimizer.state.net.0.weight.exp_avg_sq"):
        assert sorted(boxes[fqn]) == [(0, 7, "0"), (7, 6, "1")], fqn
    assert sorted(boxes["model.net.2.weight"]) == [(0, 3, "0"), (3, 2, "1")]


def test_saves_return_before_the_commit(jobs: dict[str, Path]) -> None:
    for out, tag, ranks, steps in ((jobs["train"], "train", (0, 1), [3, 6, 9]), (jobs["resume"], "mp", (0,), [9])):
        for rank in ranks:
            seen = record(out, tag, rank)["seen"]
            assert [s["step"] for s in seen] == steps, (tag, rank, seen)
            for s in seen:  # the next training step began while the save was still in flight
                assert not s["done_when_training_went_on"] and not s["metadata_when_training_went_on"], (tag, s)


def test_resume_on_one_process_continues_the_loss_exactly(jobs: dict[str, Path]) -> None:
    train = record(jobs["train"], "train")["losses"]
    resumed = record(jobs["resume"], "mp")
    r = resumed["restored"]
    # model and optimizer state after the load equal, bitwise, what the 2 ranks held when they saved
    assert r["keys_equal"] and r["different"] == [] and len(r["bitwise_equal"]) == 24, r
    assert (r["global_step"], r["epoch"], r["lr"]) == (6, 1, 0.005)  # loops and LR scheduler restored
    assert list(resumed["losses"]) == [str(s) for s in range(6, 12)]
    assert resumed["losses"] == {k: train[k] for k in resumed["losses"]}  # exactly the uninterrupted run's losses
    assert resumed["global_step"] == 12 and "error" not in resumed


def test_resumed_checkpoint_equals_the_uninterrupted_one(jobs: dict[str, Path]) -> None:
    a = bytecp.load_state_dict(str(jobs["train"] / "run" / "step=9.ckpt"))
    b = bytecp.load_state_dict(str(jobs["resume"] / "run" / "step=9.ckpt"))
    for key in ("model", "optimizer"):
        flat_a = dict(_tensors(a[key]))
        flat_b = dict(_tensors(b[key]))
        assert flat_a.keys() == flat_b.keys() and flat_a
        for name, t in flat_a.items():
            assert torch.equal(t, flat_b[name]), f"{key}.{name}"
    for key in ("global_step", "epoch", "lr_schedulers"):
        assert a["lightning"][key] == b["lightning"][key], key
    assert a["lightning"]["loops"]["fit_loop"]["state_dict"] == b["lightning"]["loops"]["fit_loop"]["state_dict"]


def _tensors(tree: Any, prefix: str = "") -> Any:
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _tensors(v, f"{prefix}.{k}")


@pytest.mark.parametrize("tag", ["single", "ddp"])
def test_resume_under_another_strategy(jobs: dict[str, Path], tag: str) -> None:
    train = record(jobs["train"], "train")["losses"]
    got = record(jobs["resume"], tag)
    r = got["restored"]
    assert r["keys_equal"] and r["different"] == [] and len(r["bitwise_equal"]) == 24, r
    assert (r["global_step"], r["epoch"]) == (9, 1)
    assert got["losses"] == {"9": train["9"]}


def test_failure_on_one_rank_reaches_every_rank_and_deletes_nothing(jobs: dict[str, Path]) -> None:
    run = jobs["train"] / "run"
    for rank in (0, 1):
        got = record(jobs["train"], "train", rank)
        assert got["error"].startswith("DistributedCheckpointError: save/write failed on rank(s) 1"), got["error"]
        assert "injected failure in phase 'write' on rank 1" in got["error"]
        assert got["global_step"] == 12
    # the failed save at step 12 is not a checkpoint; save_top_k=2 asked to remove step 6 while
    # it was in flight: that removal waited for the commit, which never came, so step 6 stays
    assert not (run / "step=12.ckpt" / "metadata.json").exists()
    assert not list((run / "step=12.ckpt").rglob("*.bin"))
    assert sorted(p.name for p in run.iterdir() if (p / "metadata.json").exists()) == ["step=6.ckpt", "step=9.ckpt"]
    # step 3 was removed once step 9 had committed
    assert latest_checkpoint(str(run)) == str(run / "step=9.ckpt")
    for name in ("step=6.ckpt", "step=9.ckpt"):
        bytecp.load_state_dict(str(run / name))


def test_one_process_load_for_evaluation(jobs: dict[str, Path]) -> None:
    ckpt = BytecpCheckpointIO().load_checkpoint(str(jobs["train"] / "run" / "step=9.ckpt"))
    saved = torch.load(jobs["train"] / "state-step9.pt")
    assert ckpt["global_step"] == 9 and "optimizer_states" not in ckpt
    assert set(ckpt["state_dict"]) == {k.removeprefix("model.") for k in saved if k.startswith("model.")}
    for k, t in ckpt["state_dict"].items():
        assert torch.equal(t, saved[f"model.{k}"]), k


def test_a_job_moves_onto_bytecp_from_lightnings_own_checkpoints(jobs: dict[str, Path]) -> None:
    """Lightning's ModelParallelStrategy saved steps 3 and 6 (torch DCP folders
    with meta.pt); latest_checkpoint finds the newest, BytecpModelParallelStrategy
    resumes from it on one process: model and optimizer bitwise, loops and LR
    scheduler restored, and the losses of steps 6-8 equal the uninterrupted run's."""
    run = jobs["train"] / "native" / "run"
    assert sorted(p.name for p in run.iterdir()) == ["step=3.ckpt", "step=6.ckpt"]
    assert (run / "step=6.ckpt" / ".metadata").exists() and (run / "step=6.ckpt" / "meta.pt").exists()
    assert latest_checkpoint(str(run)) == str(run / "step=6.ckpt")
    resumed = record(jobs["resume"], "from_native")
    assert "error" not in resumed, resumed.get("traceback")
    r = resumed["restored"]
    assert r["keys_equal"] and r["different"] == [] and len(r["bitwise_equal"]) == 24, r
    assert (r["global_step"], r["epoch"], r["lr"]) == (6, 1, 0.005)
    train = record(jobs["train"], "train")["losses"]
    assert {s: resumed["losses"][s] for s in ("6", "7", "8")} == {s: train[s] for s in ("6", "7", "8")}
