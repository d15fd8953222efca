"""Megatron-Core on real gloo ranks: a tiny GPTModel saved at one TP/PP/DP
layout and loaded at another, every tensor compared bitwise with the full
tensors assembled from Megatron's own sharding description of the saving job.

One pool of two spawned ranks serves every check (spawning and importing
Megatron costs 10-20 s per process here); each case rebuilds Megatron's
model-parallel groups on it. The CPU patches are in ``megatron_cases``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from spawning import spawns

import bytecp
from bytecp.loading import opened as engine
from bytecp.storage_api import open_storage

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed (make test installs it)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import megatron_cases as mc  # noqa: E402
from dist.pool import WorkerPool  # noqa: E402

pytestmark = pytest.mark.timeout(600)

EMB = "embedding.word_embeddings.weight"
OUT = "output_layer.weight"


@pytest.fixture(scope="module")
@spawns
def pool() -> Iterator[WorkerPool]:
    p = WorkerPool(2, env={"PYTHONWARNINGS": "ignore"})
    yield p
    p.close()


def assert_model_equal(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], what: str) -> None:
    assert set(ref) == set(got), what
    for k, v in ref.items():
        assert not torch.isnan(v).any(), f"{what}: reference {k} not fully covered"
        assert torch.equal(v, got[k]), f"{what}: {k} differs"


def assert_reloaded(ref: dict[str, Any], got: dict[str, Any], what: str) -> None:
    # the fresh model really differed: the load did the work
    assert any(not torch.equal(ref["model"][k], got["before"][k]) for k in ref["model"]), what
    assert_model_equal(ref["model"], got["model"], what)


def saved_bytes(url: str) -> tuple[int, int]:
    """(bytes in the checkpoint's chunks, bytes of its tensors' global shapes)."""
    storage = open_storage(url)
    md = engine.read_metadata(storage)
    chunks = engine.open_checkpoint(storage).all_rows()
    written = sum(c.nbytes for c in chunks)
    tensors = 0
    for info in md.tensors.values():
        n = 1
        for s in info["shape"]:
            n *= s
        tensors += n * torch.tensor([], dtype=getattr(torch, info["dtype"])).element_size()
    return written, tensors


def test_gpt_tp2_reloads_at_tp2_and_tp1_and_in_one_process(pool: WorkerPool, tmp_path: Path) -> None:
    url = str(tmp_path / "tp2")
    ref = pool.run(mc.save_reference, url, tp=2)[0]

    md = engine.read_metadata(open_storage(url))
    assert md.framework == "megatron"
    assert md.parallelism["tensor_parallel"] == 2 and md.parallelism["data_parallel"] == 1
    # replicated tensors (layernorms, position embeddings: one copy per TP
    # rank) are written once: the checkpoint holds each element exactly once
    written, total = saved_bytes(url)
    assert written == total

    same = pool.run(mc.load_and_report, url, tp=2, seed=99)[0]
    assert_reloaded(ref, same, "TP=2 -> TP=2")
    assert torch.equal(ref["logits"], same["logits"])

    fewer = pool.run(mc.load_and_report, url, tp=1, seed=99)[0]
    assert_reloaded(ref, fewer, "TP=2 -> TP=1 (DP=2)")
    torch.testing.assert_close(ref["logits"], fewer["logits"], atol=1e-6, rtol=0)

    # the evaluation hand-off: one process, no torch.distributed, full tensors
    sd = bytecp.load_state_dict(url)["model"]
    tensors = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    assert_model_equal(ref["model"], tensors, "load_state_dict")
    assert tensors[EMB].shape == (mc.VOCAB, mc.HIDDEN)
    # the only other entries are Megatron's (empty) extra states
    assert all("_extra_state/shard_" in k for k in set(sd) - set(tensors))

    # the mapping spec: the same checkpoint as a plain PyTorch GPT, same logits
    from bytecp.adapters.megatron.gpt import MEGATRON_GPT_TO_PLAIN
    from plain_gpt import PlainGPT

    from bytecp.interop.mapping import convert_state_dict

    plain = PlainGPT(mc.VOCAB, mc.SEQ, mc.HIDDEN, heads=4, ffn=128, layers=2)
    plain.load_state_dict(convert_state_dict(sd, MEGATRON_GPT_TO_PLAIN, heads=4, vocab_size=mc.VOCAB))
    tokens, pos, _ = mc.batch()
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens, pos), ref["logits"], atol=1e-5, rtol=0)

    # and `bytecp export` works on it like on any checkpoint
    from safetensors.torch import load_file

    from bytecp.interop.export import export_safetensors

    out = str(tmp_path / "model.safetensors")
    export_safetensors(open_storage(url), out, prefix="model.")
    assert_model_equal(ref["model"], load_file(out), "safetensors export")


def test_swiglu_factory_tp2_to_tp1(pool: WorkerPool, tmp_path: Path) -> None:
    """The gated MLP's fc1 is a ShardedTensorFactory: [gate_r; up_r] locally,
    two boxes of the global [gate; up]."""
    url = str(tmp_path / "swiglu")
    ref = pool.run(mc.save_reference, url, tp=2, swiglu=True)[0]
    got = pool.run(mc.load_and_report, url, tp=1, swiglu=True, seed=99)[0]
    assert_reloaded(ref, got, "SwiGLU TP=2 -> TP=1")
    torch.testing.assert_close(ref["logits"], got["logits"], atol=1e-6, rtol=0)
    again = pool.run(mc.load_and_report, url, tp=2, swiglu=True, seed=99)[0]
    assert_reloaded(ref, again, "SwiGLU TP=2 -> TP=2")
    assert torch.equal(ref["logits"], again["logits"])


@pytest.mark.slow
def test_pp2_to_pp1(pool: WorkerPool, tmp_path: Path) -> None:
    """Layer-stacked keys: each pipeline stage holds its layers at their global offsets."""
    url = str(tmp_path / "pp2")
    ref = pool.run(mc.save_reference, url, tp=1, pp=2)[0]
    got = pool.run(mc.load_and_report, url, tp=1, pp=1, seed=99)[0]
    assert_reloaded(ref, got, "PP=2 -> PP=1")
    md = engine.read_metadata(open_storage(url))
    assert md.parallelism["pipeline_parallel"] == 2


@pytest.mark.slow
def test_virtual_pipeline_chunks_to_tp2(pool: WorkerPool, tmp_path: Path) -> None:
    """A list of virtual-pipeline chunks (PP=2 x VPP=2: rank 0 holds layers 0
    and 2) reloads into one TP=2 model holding all four layers."""
    url = str(tmp_path / "vpp")
    ref = pool.run(mc.save_vpp_reference, url)[0]
    got = pool.run(mc.load_and_report, url, tp=2, layers=4, seed=99)[0]
    assert_reloaded(ref, got, "PP=2 x VPP=2 -> TP=2")


def assert_optimizer_equal(ref: dict[str, Any], got: dict[str, Any], what: str) -> None:
    assert_model_equal(ref["model"], got["model"], what)
    assert set(ref["optim"]) == set(got["optim"]), what
    for k, v in ref["optim"].items():
        assert torch.equal(v, got["optim"][k]), f"{what}: optimizer {k} differs"


@pytest.mark.slow
def test_distributed_optimizer_reshards_across_tp_and_dp(pool: WorkerPool, tmp_path: Path) -> None:
    """The default model_space layout (each DP rank writes its own flat ranges
    as boxes, no gather): the fp32 main params and Adam moments of a DP=2 job
    reload at TP=2/DP=1, and of a TP=2 SwiGLU job (factories) at TP=1/DP=2,
    equal to the saved ones; training resumes with the same losses (bitwise
    at the same layout, within float noise of the TP all-reduce otherwise)."""
    url = str(tmp_path / "dp2")
    ref = pool.run(mc.save_optimizer_reference, url, tp=1)[0]
    assert len(ref["optim"]) > 3 * 10
    md = engine.read_metadata(open_storage(url))
    assert md.parallelism["optimizer_layout"] == {"optimizer": "model_space"}
    # the model is replicated over DP: the planner spreads its writing over both ranks
    chunks = engine.open_checkpoint(open_storage(url)).all_rows()
    per_rank = [sum(c.nbytes for c in chunks if c.fqn.startswith("model.") and c.file.split("/")[-1].startswith(f"{r}-"))
                for r in range(2)]
    assert min(per_rank) > 0.35 * sum(per_rank), per_rank
    got = pool.run(mc.load_optimizer_and_report, url, tp=2)[0]
    assert_optimizer_equal(ref, got, "TP=1 DP=2 -> TP=2 DP=1")
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), atol=1e-5, rtol=0)

    url = str(tmp_path / "tp2")
    ref = pool.run(mc.save_optimizer_reference, url, tp=2, swiglu=True)[0]
    got = pool.run(mc.load_optimizer_and_report, url, tp=1, swiglu=True)[0]
    assert_optimizer_equal(ref, got, "SwiGLU TP=2 DP=1 -> TP=1 DP=2")
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), atol=1e-5, rtol=0)
    same = pool.run(mc.load_optimizer_and_report, url, tp=2, swiglu=True)[0]
    assert_optimizer_equal(ref, same, "SwiGLU TP=2 -> TP=2")
    assert same["losses"] == ref["losses"]

    # one process: the optimizer state as full model-space tensors
    sd = bytecp.load_state_dict(url)["optimizer"]
    for k, v in ref["optim"].items():
        if k != "__steps__":
            assert torch.equal(v, sd[k]), k


@pytest.mark.slow
def test_megatron_fully_reshardable_holds_the_same_tensors(pool: WorkerPool, tmp_path: Path) -> None:
    """Megatron's own fully_reshardable producer (it gathers over DP) saves
    exactly the tensors of the model_space layout, and loads the model_space
    way (each rank reads its own ranges) at another TP."""
    url = str(tmp_path / "gathered")
    ref = pool.run(mc.save_optimizer_reference, url, layout="fully_reshardable", tp=1)[0]
    got = pool.run(mc.load_optimizer_and_report, url, tp=2)[0]
    assert_optimizer_equal(ref, got, "fully_reshardable TP=1 DP=2 -> TP=2")
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), atol=1e-5, rtol=0)

    native = str(tmp_path / "native")
    pool.run(mc.save_optimizer_reference, native, tp=1)
    a = bytecp.load_state_dict(url)["optimizer"]
    b = bytecp.load_state_dict(native)["optimizer"]
    tensors = sorted(k for k, v in a.items() if isinstance(v, torch.Tensor))
    assert tensors == sorted(k for k, v in b.items() if isinstance(v, torch.Tensor))
    for k in tensors:
        assert torch.equal(a[k], b[k]), k
    assert a["__common__"] == b["__common__"]


@pytest.mark.slow
def test_non_distributed_megatron_optimizer_tp2_to_tp1(pool: WorkerPool, tmp_path: Path) -> None:
    """Megatron's plain (non-distributed) optimizer goes through its own
    sharded_state_dict: Adam moments keyed by the model's keys, resharded."""
    url = str(tmp_path / "plain-opt")
    ref = pool.run(mc.save_optimizer_reference, url, tp=2, plain_opt=True)[0]
    assert any(k.startswith("optimizer.state.exp_avg.") for k in ref["optim"])
    got = pool.run(mc.load_optimizer_and_report, url, tp=1, plain_opt=True)[0]
    assert_optimizer_equal(ref, got, "non-distributed optimizer TP=2 -> TP=1")
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_lazy_async_save_waits_in_megatron_optimizer_step(pool: WorkerPool, tmp_path: Path) -> None:
    """Lazy mode hooks the torch optimizer inside Megatron's optimizer: a step
    taken right after the call waits for staging, so the checkpoint holds
    the state before the step."""
    out = pool.run(mc.lazy_save_then_step, str(tmp_path / "lazy"))[0]
    assert out["moved"]  # the step did change the weights afterwards
    assert_model_equal(out["ref"]["model"], out["got"]["model"], "lazy save")
    for k, v in out["ref"]["optim"].items():
        assert torch.equal(v, out["got"]["optim"][k]), k


@pytest.mark.slow
def test_distributed_optimizer_dp_reshardable_layout(pool: WorkerPool, tmp_path: Path) -> None:
    url = str(tmp_path / "dpr")
    out = pool.run(mc.save_load_dp_reshardable, url)[0]
    assert_optimizer_equal(out["ref"], out["got"], "dp_reshardable DP=2 -> DP=2")
    assert out["got"]["losses"] == out["ref"]["losses"]
    md = engine.read_metadata(open_storage(url))
    assert md.parallelism["optimizer_layout"] == {"optimizer": "dp_reshardable"}


def test_padded_vocabulary_loads_common_rows(pool: WorkerPool, tmp_path: Path) -> None:
    """allow_shape_mismatch: a 128-row vocabulary loads into a model padded to
    136 rows; the rows past the saved ones keep their values."""
    url = str(tmp_path / "vocab")
    ref = pool.run(mc.save_reference, url, tp=2)[0]
    got = pool.run(mc.load_padded, url, 136)[0]
    for k in (EMB, OUT):
        assert got["model"][k].shape == (136, mc.HIDDEN)
        assert torch.equal(got["model"][k][: mc.VOCAB], ref["model"][k])
        assert torch.equal(got["model"][k][mc.VOCAB :], got["before"][k][mc.VOCAB :])


@pytest.mark.parametrize("kind,words", [
    ("unknown", ["ConfigError", "decoder.custom", "CustomSharded", "custom.thing", "ShardedTensor"]),
    ("factory", ["ConfigError", "decoder.broken", "decoder.broken.weight", "cannot build"]),
])
def test_unsupported_entries_fail_loudly_on_every_rank(
    pool: WorkerPool, tmp_path: Path, kind: str, words: list[str]
) -> None:
    pool.run(mc.build, 2)
    url = str(tmp_path / kind)
    errors = pool.run(mc.save_with_bad_entry, url, kind)
    for rank, err in enumerate(errors):
        for w in words:
            assert w in err, f"rank {rank}: {w!r} not in {err}"
    assert not os.path.exists(os.path.join(url, "metadata.json"))


@pytest.mark.slow
def test_unpadded_vocabulary_saved_and_padding_reapplied(pool: WorkerPool, tmp_path: Path) -> None:
    """MegatronModel(model, vocab_size=120): the 128-row padded embedding,
    output layer and their optimizer state are saved with 120 rows
    (load_state_dict gives unpadded tensors); loading into a padded model at
    another TP fills the 120 rows and leaves the padding rows alone."""
    url = str(tmp_path / "unpadded")
    ref = pool.run(mc.save_optimizer_reference, url, vocab_size=120, tp=2)[0]
    md = engine.read_metadata(open_storage(url))
    assert md.parallelism["vocab_size"] == 120
    sd = bytecp.load_state_dict(url)
    for k in (EMB, OUT):
        assert torch.equal(sd["model"][k], ref["model"][k][:120])
        for name in ("param", "exp_avg", "exp_avg_sq"):
            full = ref["optim"][f"optimizer.state.{name}.{k}"]
            assert torch.equal(sd["optimizer"][f"optimizer.state.{name}.{k}"], full[:120])
    got = pool.run(mc.load_optimizer_and_report, url, tp=1)[0]
    for k, v in ref["model"].items():
        if k in (EMB, OUT):
            assert torch.equal(got["model"][k][:120], v[:120]), k
        else:
            assert torch.equal(got["model"][k], v), k
    for k, v in ref["optim"].items():
        if k.endswith((EMB, OUT)):
            assert torch.equal(got["optim"][k][:120], v[:120]), k
        else:
            assert torch.equal(got["optim"][k], v), k


def test_megatron_lm_data_position_across_a_dp_change(pool: WorkerPool, tmp_path: Path) -> None:
    """TP=2 x DP=1 -> TP=1 x DP=2 (the same two ranks): Megatron-LM's
    single sampler continues from the global count; a data-sharded cyclic
    sampler mid-epoch is refused on every rank before the model changes."""
    url = str(tmp_path / "single")
    pool.run(mc.save_lm_data, url, 2, 36, "single")
    for r in pool.run(mc.load_lm_data, url, 1, "single"):
        assert r == {"consumed": 36, "valid": 4}
    url = str(tmp_path / "cyclic")
    pool.run(mc.save_lm_data, url, 2, 36, "cyclic")
    for r in pool.run(mc.load_lm_data, url, 1, "cyclic"):
        assert r["unchanged"] and r["consumed"] == 0, r
        line = next(x for x in r["error"].splitlines() if "DataReshardError" in x)  # one line per rank
        assert "data loader 'data' (MegatronLMData, megatron_lm)" in line and "would be seen twice" in line
        assert line.endswith("load with data_reshard='approximate' to accept that")
    for r in pool.run(mc.load_lm_data, url, 1, "cyclic", "approximate"):
        assert r == {"consumed": 36, "valid": 4}
