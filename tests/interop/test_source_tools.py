"""``bytecp inspect``, ``verify`` and ``export`` over the foreign sources,
each written by its own framework in a tiny one-process setup: torch DCP
(``dcp.save`` with no process group: a transformers GPT-2 and its AdamW, as
``get_state_dict`` names them and as torchtitan lays them out), DeepSpeed
ZeRO 1 bf16 (``engine.save_checkpoint``, one gloo rank) and Megatron-Core
torch_dist (one gloo rank). Every command runs through ``bytecp.cli.main``;
exported tensors are bitwise the source's (``bytecp.load_state_dict``, and
the saved model itself for DCP, through transformers' ``from_pretrained``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from spawning import spawns

import bytecp
from bytecp.cli import main as cli
from bytecp.tools.verify_source import NO_CHECKSUMS

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

pytestmark = pytest.mark.timeout(600)
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
HAS_DS = importlib.util.find_spec("deepspeed") is not None
HAS_MEGATRON = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


def _flat(sd: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in sd.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


@pytest.fixture(scope="module")
@spawns
def sources(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Each source written once: its path, and the DCP model and config."""
    import torch.distributed.checkpoint as dcp

    base = tmp_path_factory.mktemp("sources")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.arange(8)[None]).logits.sum().backward()
    opt.step()
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=str(base / "dcp"))
    dcp.save({**model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=str(base / "titan"))
    (base / "config.json").write_text(json.dumps(cfg.to_dict()))
    out: dict[str, Any] = {"base": base, "dcp": base / "dcp", "titan": base / "titan", "sd": sd,
                           "config": base / "config.json"}
    pools = []
    if HAS_DS:
        import ds_source_cases as sc
        from dist.pool import WorkerPool

        p = WorkerPool(1, env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
        pools.append(p)
        p.run(sc.ds_write, str(base / "ds"), 1, True)
        out["ds"] = base / "ds"
    if HAS_MEGATRON:
        import torch_dist_cases as tc
        from dist.pool import WorkerPool

        p = WorkerPool(1, env={"PYTHONWARNINGS": "ignore"})
        pools.append(p)
        p.run(tc.megatron_save, str(base / "megatron"), tp=1, timeout=300)
        out["megatron"] = base / "megatron"
    yield out
    for p in pools:
        p.close(kill=True)


def _need(sources: dict[str, Any], name: str) -> Path:
    if name not in sources:
        pytest.skip(f"{name} is not installed (make test installs it)")
    return Path(sources[name])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("name,fmt", [("dcp", "dcp"), ("titan", "dcp"), ("ds", "deepspeed"), ("megatron", "torch_dist")])
def test_inspect_and_verify_say_the_format(sources: dict[str, Any], name: str, fmt: str, capsys: Any) -> None:
    """inspect lists the source's tensors (names, dtypes, shapes as a load sees
    them); verify checks its structure and says no checksums exist."""
    url = str(_need(sources, name))
    assert cli(["inspect", url, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    want = _flat(bytecp.load_state_dict(url))
    assert info["format"] == fmt and info["checksums"] is False
    assert {k: (p["dtype"], p["shape"]) for k, p in info["tensors"].items()} == {
        k: (str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in want.items() if isinstance(v, torch.Tensor)}
    assert cli(["inspect", url]) == 0 and f"format       {fmt} (read as a source" in capsys.readouterr().out
    assert cli(["verify", url, "--no-progress"]) == 0
    assert NO_CHECKSUMS in capsys.readouterr().out
    assert cli(["verify", url, "--json", "--no-progress"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["ok"] and got["format"] == fmt and got["checksums"] is False


def test_verify_catches_a_truncated_file_and_a_flipped_zip_header(sources: dict[str, Any], tmp_path: Path,
                                                                    capsys: Any) -> None:
    for case in ("truncated", "flipped"):
        bad = tmp_path / case
        shutil.copytree(sources["dcp"], bad)
        data = bad / "__0_0.distcp"
        if case == "truncated":
            os.truncate(data, data.stat().st_size - 500)
        else:  # a local header of a value's archive: the zip entry, and the load of that value, fail
            raw = bytearray(data.read_bytes())
            at = raw.find(b"PK\x03\x04", 1000)
            raw[at + 1] ^= 0xFF
            data.write_bytes(bytes(raw))
        assert cli(["verify", str(bad), "--no-progress"]) == 1, case
        err = capsys.readouterr().err.strip().splitlines()
        fails = [line for line in err if line.startswith("FAIL ")]
        assert len(err) == len(fails) + 1 and all("__0_0.distcp" in line for line in fails), err
        if case == "truncated":
            assert len(fails) == 1 and "truncated" in fails[0], err
        else:
            assert len(fails) == 2 and "zip entry" in fails[1] and "a load refuses it" in fails[0], err


def test_dcp_to_hugging_face_loads_with_from_pretrained(sources: dict[str, Any], tmp_path: Path) -> None:
    """``bytecp export DCP OUT --config`` (the tensors under ``model.``): transformers loads the saved model bitwise."""
    out = tmp_path / "hf"
    assert cli(["export", str(sources["dcp"]), str(out), "--config", str(sources["config"]), "--no-progress"]) == 0
    model = transformers.GPT2LMHeadModel.from_pretrained(str(out))
    got = model.state_dict()
    assert set(got) == set(sources["sd"])
    assert all(_same(got[k], v) for k, v in sources["sd"].items())


@pytest.mark.parametrize("fmt", ["safetensors", "torch", "dcp"])
def test_torchtitan_layout_exports_the_model_at_the_top(sources: dict[str, Any], tmp_path: Path, fmt: str) -> None:
    """A DCP checkpoint with the model's tensors at the top (torchtitan's): by
    default the model alone, its training state left out (``--format dcp``: everything)."""
    out = tmp_path / {"safetensors": "m.safetensors", "torch": "m.pt", "dcp": "m"}[fmt]
    assert cli(["export", str(sources["titan"]), str(out), "--format", fmt, "--no-progress"]) == 0
    if fmt == "safetensors":
        got = safetensors_torch.load_file(str(out))
    elif fmt == "torch":
        got = torch.load(out, weights_only=True)
    else:
        got = _flat(bytecp.load_state_dict(str(out)))
        assert any(k.startswith("optimizer.state.") for k in got)
        got = {k: v for k, v in got.items() if k in sources["sd"]}
    assert set(got) == set(sources["sd"]) and all(_same(got[k], v) for k, v in sources["sd"].items())


def test_deepspeed_to_safetensors_and_its_fp32_masters(sources: dict[str, Any], tmp_path: Path) -> None:
    """A bf16 ZeRO run: the bf16 model by default; ``--masters`` the fp32
    master weights under the model's names (what ``zero_to_fp32`` writes)."""
    root = _need(sources, "ds")
    want = _flat(bytecp.load_state_dict(str(root)))
    assert cli(["export", str(root), str(tmp_path / "m.safetensors"), "--no-progress"]) == 0
    got = safetensors_torch.load_file(str(tmp_path / "m.safetensors"))
    assert set(got) == {k[len("model."):] for k in want if k.startswith("model.")}
    assert all(v.dtype == torch.bfloat16 and _same(v, want[f"model.{k}"]) for k, v in got.items())
    assert cli(["export", str(root), str(tmp_path / "f.safetensors"), "--masters", "--no-progress"]) == 0
    masters = safetensors_torch.load_file(str(tmp_path / "f.safetensors"))
    assert set(masters) == set(got)
    assert all(_same(v, want[f"optimizer.state.{k}.fp32"]) for k, v in masters.items())
    assert all(torch.equal(v.to(torch.bfloat16), got[k]) for k, v in masters.items())
    # the Hugging Face layout too
    assert cli(["export", str(root), str(tmp_path / "hf"), "--masters", "--no-progress"]) == 0
    assert (tmp_path / "hf" / "model.safetensors").exists()


@pytest.mark.parametrize("named", [True, False], ids=["spec-named", "spec-from-config"])
def test_torch_dist_to_hugging_face_through_a_spec(sources: dict[str, Any], tmp_path: Path, named: bool) -> None:
    """``--spec gpt2`` (or the config's ``model_type`` alone) converts the Megatron
    model to transformers' names, bitwise the spec applied to the load."""
    from bytecp.interop.mapping import convert_state_dict, get_spec

    run = _need(sources, "megatron")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_head": 4, "vocab_size": 128}))
    out = tmp_path / "hf"
    spec = ["--spec", "gpt2"] if named else []
    assert cli(["export", str(run), str(out), *spec, "--config", str(config), "--no-progress"]) == 0
    got = safetensors_torch.load_file(str(out / "model.safetensors"))
    model = bytecp.load_state_dict(str(run))["model"]
    extra = {k: None for k in model if "_extra_state" in k}
    want = convert_state_dict({**{k: v for k, v in model.items() if k not in extra}, **extra}, get_spec("gpt2"),
                              heads=4, groups=4, vocab_size=128)
    assert set(got) == set(want) and all(_same(got[k], v) for k, v in want.items())


class Opaque:
    """A class no allowlist admits: only a full unpickler reads it."""

    def __init__(self) -> None:
        self.secret = 42


def test_verify_fails_where_a_load_fails(tmp_path: Path, capsys: Any) -> None:
    """A DCP value pickled with a class of its own: ``load_state_dict`` refuses
    it without ``allow_pickle``, and ``bytecp verify`` reads it the same way and
    fails naming it (exit 1) instead of saying OK."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(3), "extra": {"thing": Opaque()}}, checkpoint_id=str(tmp_path / "dcp"))
    with pytest.raises(bytecp.PickleNotAllowedError, match="extra.thing"):
        bytecp.load_state_dict(str(tmp_path / "dcp"))
    assert cli(["verify", str(tmp_path / "dcp")]) == 1
    err = capsys.readouterr().err
    assert "FAIL" in err and "extra.thing" in err and "a load refuses it" in err and "allow_pickle=True" in err, err
