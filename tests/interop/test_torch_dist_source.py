"""Megatron-Core ``torch_dist`` checkpoints (``dist_checkpointing.save``, as
Megatron-LM and NeMo write them by default) loaded by bytecp with no
conversion: a tiny GPT at TP=2 with the distributed optimizer
(``fully_reshardable``), saved by Megatron itself on 2 gloo ranks into
``run/iter_0000100``, loaded into the Megatron model and optimizer at TP=1
x DP=2, at TP=2, at PP=2 and in one process (and Megatron-LM's default
``dp_reshardable`` optimizer layout at the same TP/PP; a mixture of experts
at EP=2 loaded at EP=2 and EP=1); every tensor, model and optimizer,
bitwise equal to the full tensors assembled from Megatron's own sharding
description of the saving job. Crafted folders: ``.metadata`` missing, a
``common.pt`` naming a class no allowlist admits.
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
from bytecp.interop import find_source, torch_dist
from bytecp.interop.runs import foreign_checkpoints
from bytecp.storage_api import open_storage

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed (make test installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch_dist_cases as tc  # noqa: E402
from dist.pool import WorkerPool  # noqa: E402

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
@spawns
def pool() -> Iterator[WorkerPool]:
    p = WorkerPool(2, env={"PYTHONWARNINGS": "ignore"})
    yield p
    p.close()


@pytest.fixture(scope="module")
def saved(pool: WorkerPool, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Megatron's own torch_dist save of the TP=2 model and distributed optimizer."""
    run = tmp_path_factory.mktemp("megatron") / "run"
    ref = pool.run(tc.megatron_save, str(run), tp=2, timeout=300)[0]
    folder = run / tc.FOLDER
    assert (run / torch_dist.LATEST).read_text() == str(tc.ITERATION)
    assert {".metadata", "common.pt", "metadata.json"} <= {p.name for p in folder.iterdir()}
    return run, ref


def _same(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], what: str) -> None:
    assert set(ref) == set(got), what
    for k, v in ref.items():
        assert not torch.isnan(v).any(), f"{what}: reference {k} not fully covered"
        assert torch.equal(v, got[k]), f"{what}: {k} differs"


def _loaded_all(ref: dict[str, Any], got: list[dict[str, Any]], what: str) -> None:
    """Every rank got every tensor; the names no rank asked for are Megatron-LM's
    values beside model and optimizer (a pipeline stage leaves the other's layers)."""
    unasked = set.intersection(*({k.split("/")[0] for k in g["unexpected"]} for g in got))
    assert unasked == {"args", "checkpoint_version", "content_metadata", "num_floating_point_operations_so_far",
                       "rng_state"}, what
    for r, g in enumerate(got):
        _loaded(ref, g, f"{what} rank {r}")


def _loaded(ref: dict[str, Any], got: dict[str, Any], what: str) -> None:
    assert got["missing"] == [] and got["iteration"] == tc.ITERATION, what
    assert any(not torch.equal(ref["model"][k], got["before"][k]) for k in ref["model"]), what
    _same(ref["model"], got["model"], what)
    if "optim" in got:
        _same(ref["optim"], got["optim"], what)


def test_detected_before_dcp_from_the_folder_and_the_run(saved: tuple[Path, dict[str, Any]]) -> None:
    run, _ = saved
    assert find_source(open_storage(str(run / tc.FOLDER))) == "torch_dist"
    assert find_source(open_storage(str(run))) == "torch_dist"
    assert torch_dist.folder(open_storage(str(run))) == f"{tc.FOLDER}/"
    # CheckpointManager.restore's view of the run folder
    found, unreadable = foreign_checkpoints(str(run))
    assert [(c.name, c.step, c.format) for c in found] == [(tc.FOLDER, tc.ITERATION, "torch_dist")]
    assert unreadable == []


def test_tp2_loads_at_tp1_dp2_with_the_distributed_optimizer(pool: WorkerPool,
                                                            saved: tuple[Path, dict[str, Any]]) -> None:
    run, ref = saved
    got = pool.run(tc.bytecp_load, str(run / tc.FOLDER), optimizer=True, tp=1, timeout=300)
    _loaded_all(ref, got, "TP=1")


def test_run_folder_loads_at_tp2(pool: WorkerPool, saved: tuple[Path, dict[str, Any]]) -> None:
    run, ref = saved
    got = pool.run(tc.bytecp_load, str(run), optimizer=True, tp=2, timeout=300)
    _loaded_all(ref, got, "TP=2")


def test_tp2_loads_at_pp2(pool: WorkerPool, saved: tuple[Path, dict[str, Any]]) -> None:
    """Each pipeline stage reads its own layers: sub-boxes of the stacked chunks."""
    run, ref = saved
    got = pool.run(tc.bytecp_load, str(run), optimizer=True, tp=1, pp=2, timeout=300)
    _loaded_all(ref, got, "PP=2")


def test_dp_reshardable_optimizer_reloads(pool: WorkerPool, tmp_path: Path) -> None:
    """Megatron-LM's default optimizer layout (per-bucket flat buffers, DP=2):
    loads at the same TP/PP, the layout read from common.pt."""
    run = tmp_path / "run"
    ref = pool.run(tc.megatron_save, str(run), optimizer="dp_reshardable", tp=1, timeout=300)[0]
    got = pool.run(tc.bytecp_load, str(run), optimizer=True, tp=1, timeout=300)
    _loaded_all(ref, got, "dp_reshardable")


def test_moe_ep2_loads_at_ep2_and_ep1_with_the_optimizer_chain(pool: WorkerPool, tmp_path: Path) -> None:
    """The MoE GPT (4 experts, top-2) at EP=2: Megatron chains a dense and an
    expert distributed optimizer (keys ``chained_<i>.optimizer.state...``).
    Loaded at EP=2 and at EP=1 (one optimizer, which Megatron's own loader
    cannot resume from an EP=2 chain), model and optimizer bitwise."""
    run = tmp_path / "run"
    ref = pool.run(tc.megatron_save_moe, str(run), timeout=300)[0]
    for ep in (2, 1):
        _loaded_all(ref, pool.run(tc.bytecp_load_moe, str(run), ep, True, timeout=300), f"MoE EP={ep}")


def test_one_process_state_dict(saved: tuple[Path, dict[str, Any]]) -> None:
    """No torch.distributed: Megatron's keys under ``model``/``optimizer``, the
    layers stacked as saved; common.pt's values at the top."""
    run, ref = saved
    sd = bytecp.load_state_dict(str(run))
    assert sd["iteration"] == tc.ITERATION and sd["checkpoint_version"] == 3.0
    assert sd["args"]["tensor_model_parallel_size"] == 2 and sd["args"]["model_type"] == "ModelType.encoder_or_decoder"
    assert sd["optimizer"]["__common__"]["param_state_sharding_type"] == "fully_reshardable"
    assert sd["rng_state/shard_0.1_1.2"][0]["np_rng_state"][0] == "MT19937"  # numpy's, read as data
    _same(ref["model"], {k: v for k, v in sd["model"].items() if isinstance(v, torch.Tensor)}, "one process")
    for name in ("param", "exp_avg", "exp_avg_sq"):
        for key, want in ((k, v) for k, v in ref["optim"].items() if k.startswith(f"optimizer.state.{name}.")):
            assert torch.equal(sd["optimizer"][key], want), key


def test_missing_dot_metadata_is_one_line(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    run, _ = saved
    broken = tmp_path / tc.FOLDER
    shutil.copytree(run / tc.FOLDER, broken)
    (broken / ".metadata").unlink()
    with pytest.raises(CorruptCheckpointError) as e:
        bytecp.load_state_dict(str(broken))
    msg = str(e.value)
    assert "\n" not in msg and ".metadata is missing" in msg and "torch_dist" in msg, msg


def test_hugging_face_names_through_the_gpt2_spec(saved: tuple[Path, dict[str, Any]]) -> None:
    """The model of a torch_dist checkpoint in transformers' names (the test
    GPT is the gpt2 family): the spec applied to ``load_state_dict``'s
    Megatron keys gives bitwise what it gives the saved full tensors."""
    from bytecp.interop.mapping import convert_state_dict, get_spec

    run, ref = saved
    model = bytecp.load_state_dict(str(run))["model"]
    params = {"heads": 4, "groups": 4, "vocab_size": 128}
    extra = {k: None for k in model if "_extra_state" in k}
    got = convert_state_dict(model, get_spec("gpt2"), **params)
    want = convert_state_dict({**ref["model"], **extra}, get_spec("gpt2"), **params)
    assert "transformer.h.1.attn.c_attn.weight" in got and set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


class Payload:
    """A class no allowlist admits: unpickling it could run code."""


def test_common_pt_with_a_foreign_class_is_refused_naming_it(saved: tuple[Path, dict[str, Any]],
                                                             tmp_path: Path) -> None:
    run, _ = saved
    crafted = tmp_path / tc.FOLDER
    shutil.copytree(run / tc.FOLDER, crafted)
    torch.save({"iteration": 1, "payload": Payload()}, crafted / "common.pt")
    with pytest.raises(CorruptCheckpointError) as e:
        bytecp.load_state_dict(str(crafted))
    msg = str(e.value)
    assert "\n" not in msg and "common.pt" in msg and "Payload" in msg, msg


# ------------------------------------------------------------ Megatron-LM's own save
@pytest.fixture(scope="module")
def lm_saved(pool: WorkerPool, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """A run folder written by Megatron-LM's ``save_checkpoint`` (its own
    checkpointing.py and arguments.py: tests/megatron/megatron_lm) from the
    TP=2 GPT with the distributed optimizer, two steps trained; each rank's
    reference (full tensors, its TP shards, its RNG states, ``args``)."""
    run = tmp_path_factory.mktemp("megatron-lm") / "run"
    refs = pool.run(tc.megatron_lm_save, str(run), tp=2, timeout=400)
    return run, refs


def _globals(data: bytes) -> set[str]:
    """The globals a pickle names (protocol 2, as torch.save writes)."""
    import pickletools

    return {str(arg).replace(" ", ".") for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"}


def test_the_folder_is_what_megatron_lm_writes(lm_saved: tuple[Path, list[dict[str, Any]]]) -> None:
    """iter_0000010/ and the tracker; common.pt holds the real ``args`` (an
    argparse.Namespace with Megatron-Core's enums and signal.Signals), the
    rng_state values numpy's RNG state (an ndarray): nothing sanitized."""
    import zipfile

    run, refs = lm_saved
    assert (run / torch_dist.LATEST).read_text() == str(tc.LM_ITERATION)
    folder = run / f"iter_{tc.LM_ITERATION:07d}"
    assert {".metadata", "common.pt", "metadata.json"} <= {p.name for p in folder.iterdir()}
    with zipfile.ZipFile(folder / "common.pt") as z:
        common = _globals(z.read(next(n for n in z.namelist() if n.endswith("data.pkl"))))
    assert {"argparse.Namespace", "megatron.core.enums.ModelType", "megatron.core.transformer.enums.AttnBackend",
            "signal.Signals"} <= common, common
    blobs = b"".join(p.read_bytes() for p in folder.glob("*.distcp"))
    assert b"numpy._core.multiarray" in blobs or b"numpy.core.multiarray" in blobs  # np.random.get_state()
    args = refs[0]["args"]
    assert len(args) > 500 and str(args["model_type"]) == "ModelType.encoder_or_decoder"


@pytest.mark.parametrize("megatron", ["without", "with"])
def test_an_evaluation_process_reads_it_whole_megatron_imported_or_not(
        lm_saved: tuple[Path, list[dict[str, Any]]], tmp_path: Path, megatron: str) -> None:
    """``load_state_dict`` of the run folder in a fresh process (Megatron-Core
    imported first, or never): the same data either way; the enums and numpy
    as data; the weights the TP shards concatenated, the optimizer state
    bitwise; ``exclude=["rng_state"]`` leaves the ``rng_state/shard_*``
    entries out; ``bytecp inspect`` and ``verify`` exit 0."""
    import subprocess

    import numpy as np

    run, refs = lm_saved
    out = tmp_path / "eval.pt"
    subprocess.run([sys.executable, "-c", tc.EVAL_PROCESS, str(run), str(out), megatron], check=True,
                   timeout=300, env={**__import__("os").environ, "PYTHONWARNINGS": "ignore"})
    got = torch.load(out, weights_only=False)
    assert bool(got["megatron"]) == (megatron == "with"), got["megatron"]
    assert got["codes"] == [0, 0]
    sd = got["sd"]
    assert sd["iteration"] == tc.LM_ITERATION and sd["num_floating_point_operations_so_far"] == 1234
    args = sd["args"]
    assert args["model_type"] == "ModelType.encoder_or_decoder" and args["attention_backend"] == "AttnBackend.auto"
    assert args["exit_signal"] == "Signals.SIGTERM" and args["params_dtype"] == torch.float32
    assert args["tensor_model_parallel_size"] == 2 and args["use_distributed_optimizer"] is True
    assert args.keys() == refs[0]["args"].keys()
    for r, ref in enumerate(refs):  # each rank's RNG state as Megatron-LM's get_rng_state gathered it
        (saved,) = sd[f"rng_state/shard_0.{r}_1.2"]
        np_state = saved["np_rng_state"]
        assert np_state[0] == ref["rng"]["np"][0] and np_state[2:] == tuple(ref["rng"]["np"][2:])
        assert isinstance(np_state[1], np.ndarray) and np.array_equal(np_state[1], ref["rng"]["np"][1])
        assert np_state[1].dtype == np.uint32
        assert saved["random_rng_state"] == ref["rng"]["random"]
        assert torch.equal(saved["torch_rng_state"], ref["rng"]["torch"])
    model = sd["model"]
    for k, v in refs[0]["model"].items():
        assert torch.equal(model[k], v), k
    emb = torch.cat([ref["shards"]["embedding"] for ref in refs], dim=0)  # TP splits the vocabulary
    assert torch.equal(model["embedding.word_embeddings.weight"], emb)
    proj = torch.cat([ref["shards"]["proj"] for ref in refs], dim=2)  # row-parallel: the input dim
    assert torch.equal(model["decoder.layers.self_attention.linear_proj.weight"], proj)
    moments = {k: v for k, v in refs[0]["optim"].items() if k.startswith("optimizer.state.")}
    assert {k.split(".")[2] for k in moments} == {"param", "exp_avg", "exp_avg_sq"}
    for key, want in moments.items():
        assert torch.equal(sd["optimizer"][key], want), key
    assert not [k for k in got["left_out"] if k.startswith(("rng_state", "model", "optimizer"))], got["left_out"]


def test_it_loads_at_tp1_in_one_process_with_the_optimizer(lm_saved: tuple[Path, list[dict[str, Any]]]) -> None:
    """One process (Megatron-Core built at TP=1 with its distributed optimizer)
    resumes from the run folder: every weight and optimizer tensor bitwise."""
    run, refs = lm_saved
    one = WorkerPool(1, env={"PYTHONWARNINGS": "ignore"})
    try:
        (got,) = one.run(tc.bytecp_load, str(run), optimizer=True, tp=1, timeout=300)
    finally:
        one.close()
    assert got["missing"] == [] and got["iteration"] == tc.LM_ITERATION
    _same(refs[0]["model"], got["model"], "TP=1, one process")
    _same(refs[0]["optim"], got["optim"], "TP=1, one process (optimizer)")


def test_a_megatron_lm_run_folder_resumes_what_its_tracker_commits(lm_saved: tuple[Path, list[dict[str, Any]]],
                                                                    tmp_path: Path) -> None:
    """The resume decision reads Megatron-LM's tracker as its commit point: a
    save killed after the tracker's (``iter_0000020``: a data file, no
    ``.metadata``) is passed over; a tracker naming a checkpoint that is not
    there, or a newer step folder no format reads, is an error naming it; a
    run that moved onto bytecp resumes bytecp's newer checkpoint, and loading
    the run folder through its tracker then refuses, naming that one."""
    from bytecp.manager import CheckpointManager
    from bytecp.tools.resume import decide

    src, _ = lm_saved
    run = tmp_path / "run"
    shutil.copytree(src, run)
    done = f"iter_{tc.LM_ITERATION:07d}"
    (run / "iter_0000020").mkdir()
    shutil.copy(run / done / "__0_0.distcp", run / "iter_0000020")  # a save Megatron-LM did not finish
    d = decide(str(run))
    assert d.kind == "resume" and (d.newest.name, d.newest.format, d.newest.step) == (done, "torch_dist", 10)
    assert [(u.rsplit("/", 1)[1], "never finished" in why) for u, why in d.passed_over] == [("iter_0000020", True)]
    state: dict[str, Any] = {"iteration": 0}
    assert CheckpointManager(str(run)).restore(state, strict=False) == 10 and state["iteration"] == 10
    assert bytecp.load_state_dict(str(run), exclude=["model", "optimizer"])["iteration"] == 10  # through the tracker

    (run / torch_dist.LATEST).write_text("30")  # a tracker naming a save that is gone
    with pytest.raises(bytecp.ResumeDecisionError, match=r"latest_checkpointed_iteration.txt names iter_0000030"):
        decide(str(run)).check()
    (run / torch_dist.LATEST).write_text(str(tc.LM_ITERATION))

    bytecp.save(str(run / "step-40"), {"iteration": 40}, step=40)  # the job moved onto bytecp
    assert decide(str(run)).newest.name == "step-40"
    assert CheckpointManager(str(run)).restore(state) == 40 and state["iteration"] == 40
    with pytest.raises(bytecp.CheckpointNotFoundError, match=r"names iter_0000010, but its newest checkpoint is .*step-40"):
        bytecp.load_state_dict(str(run))
