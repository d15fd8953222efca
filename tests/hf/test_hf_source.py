"""Hugging Face directories as a load source, in one process: tiny Llama
(tied and untied) and GPT-2 models saved with ``save_pretrained`` (one file
and sharded) load with ``bytecp.load`` and ``bytecp.load_state_dict``
bitwise equal to ``from_pretrained``'s weights; names match across the
base-model prefix; dtypes cast; hostile headers are refused in one line."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from dist import hf_source_cases as hf

import bytecp
from bytecp.errors import CorruptCheckpointError, StateMismatchError

pytestmark = pytest.mark.timeout(300)

KINDS = ["llama", "llama-tied", "gpt2"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], tuple[Path, dict[str, torch.Tensor]]]:
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for kind in KINDS:
        for sharded in (False, True):
            d = hf.save(kind, root / f"{kind}-{sharded}", sharded=sharded)
            out[kind, sharded] = d, hf.reference(kind, d)
    return out


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("kind", KINDS)
def test_load_matches_from_pretrained(saved, kind: str, sharded: bool) -> None:
    path, ref = saved[kind, sharded]
    assert (path / "model.safetensors.index.json").exists() == sharded
    model = hf.build(kind, seed=1)
    res = bytecp.load(str(path), {"model": model})
    assert res.missing_keys == [] and res.unexpected_keys == []
    got = model.state_dict()
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert torch.equal(got[k], v), k
    if kind != "llama":
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # still tied
    whole = bytecp.load_state_dict(str(path))
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    stored = {k: v for f in files for k, v in load_file(str(f)).items()}
    assert set(whole) == set(stored)
    for k, v in stored.items():
        assert torch.equal(whole[k], v), k


def test_base_model_prefix_both_ways(saved, tmp_path: Path) -> None:
    path, ref = saved["llama", True]
    base = hf.build("llama-base", seed=1)
    res = bytecp.load(str(path), {"model": base}, strict=False)  # LlamaForCausalLM file -> LlamaModel
    assert res.unexpected_keys == ["lm_head.weight"] and res.missing_keys == []
    for k, v in base.state_dict().items():
        assert torch.equal(v, ref["model." + k]), k
    base_dir = tmp_path / "base"
    base.save_pretrained(str(base_dir))  # LlamaModel file (no "model." prefix) -> LlamaForCausalLM
    full = hf.build("llama", seed=2)
    res = bytecp.load(str(base_dir), {"model": full}, strict=False)
    assert res.missing_keys == ["model.lm_head.weight"]  # untied: not filled, as in transformers
    for k, v in base.state_dict().items():
        assert torch.equal(full.state_dict()["model." + k], v), k
    with pytest.raises(StateMismatchError) as e:
        bytecp.load(str(base_dir), {"model": hf.build("llama", seed=2)})
    assert "\n" not in str(e.value) and "'model.lm_head.weight'" in str(e.value)


def test_untied_model_reads_tied_files_embedding(saved) -> None:
    path, ref = saved["llama-tied", False]
    from safetensors import safe_open

    stored = {k for f in Path(path).glob("*.safetensors") for k in safe_open(str(f), "pt").keys()}
    assert "lm_head.weight" not in stored and "model.embed_tokens.weight" in stored  # tied: written once
    model = hf.build("llama", seed=1)  # untied target, tied file (config.json: tie_word_embeddings)
    bytecp.load(str(path), {"model": model})
    assert torch.equal(model.lm_head.weight, ref["model.embed_tokens.weight"])
    assert torch.equal(model.model.embed_tokens.weight, ref["model.embed_tokens.weight"])


def test_other_model_is_one_line_error(saved) -> None:
    path, _ = saved["gpt2", False]
    with pytest.raises(StateMismatchError) as e:
        bytecp.load(str(path), {"model": hf.build("llama", seed=1)})
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and "strict=False" in msg


@pytest.mark.parametrize("file_dtype,model_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_dtype_cast(tmp_path: Path, file_dtype: torch.dtype, model_dtype: torch.dtype) -> None:
    path = hf.save("llama", tmp_path / "m", sharded=True, dtype=file_dtype)
    ref = hf.reference("llama", path)
    model = hf.build("llama", seed=1, dtype=model_dtype)
    bytecp.load(str(path), {"model": model})
    for k, v in model.state_dict().items():
        assert v.dtype == model_dtype and torch.equal(v, ref[k].to(model_dtype)), k


# ------------------------------------------------------------ hostile headers
def _write(path: Path, header: dict, data: bytes, header_len: int | None = None) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob) if header_len is None else header_len) + blob + data)


W = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}


@pytest.mark.parametrize("header,header_len,want", [
    ({"w": W}, 1 << 60, "header"),
    ({"w": {**W, "data_offsets": [0, 1 << 40]}}, None, "'w'"),
    ({"w": W, "v": {**W, "data_offsets": [8, 24]}}, None, "overlaps"),
    ({"w": {**W, "dtype": "Q7"}}, None, "unknown dtype"),
    ({"w": {**W, "shape": [3, 2]}}, None, "want 24"),
    ({"w": {**W, "shape": [-1]}}, None, "shape"),
], ids=["huge-header", "past-end", "overlap", "dtype", "span", "shape"])
def test_hostile_header_refused(tmp_path: Path, header: dict, header_len: int | None, want: str) -> None:
    _write(tmp_path / "model.safetensors", header, bytes(24), header_len)
    with pytest.raises(CorruptCheckpointError) as e:
        bytecp.load_state_dict(str(tmp_path))
    msg = str(e.value)
    assert "\n" not in msg and "model.safetensors" in msg and want in msg


def test_hostile_index_refused(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../../etc/x.safetensors"}}))
    with pytest.raises(CorruptCheckpointError, match=r"plain NAME\.safetensors"):
        bytecp.load_state_dict(str(tmp_path))
    _write(tmp_path / "a.safetensors", {"w": W}, bytes(16))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "a.safetensors", "v": "a.safetensors"}}))
    with pytest.raises(CorruptCheckpointError, match="no shard holds"):
        bytecp.load_state_dict(str(tmp_path))


def test_tools_read_it_as_a_hugging_face_directory(saved) -> None:
    """The one-process tools take a foreign source: ``inspect`` says what it is."""
    from bytecp.storage_api import open_storage
    from bytecp.tools.inspect import summarize

    path, _ = saved["gpt2", False]
    info = summarize(open_storage(str(path)))
    assert info["format"] == "huggingface" and not info["checksums"] and info["tensors"]
