"""Incremental checkpoints: bytes and time per checkpoint, incremental against
full and against DCP, and the cost of finding what changed.

    python -m benchmarks.incremental [--hidden 768 --layers 4 --steps 4] [--json out.json]

One process, local disk. Two fine-tunes of a transformers Llama built from a
config (no downloads): a LoRA (the real peft, r=8 on q_proj/v_proj) and a
full fine-tune whose embedding and first half of the layers are frozen. After
each training step the same model and AdamW state are saved three ways:
``bytecp.save`` whole, ``bytecp.save(..., base=previous)`` (incremental) and
``torch.distributed.checkpoint.save`` (DCP, which writes everything every
time). Figures are the median over the saves after the first: the bytes
each checkpoint stores itself and the wall time of the call (durable when
it returns; both fsync). Then the detection cost: the version-counter tokens
of a 1 GB state (256 tensors) against a crc32c of its bytes, the content
hash incremental saves do without.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import bytecp


def _llama(hidden: int, layers: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=128,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def _lora(hidden: int, layers: int) -> Any:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(_llama(hidden, layers), LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))


def _frozen(hidden: int, layers: int) -> Any:
    model = _llama(hidden, layers)
    model.model.embed_tokens.weight.requires_grad_(False)
    for layer in model.model.layers[: layers // 2]:
        layer.requires_grad_(False)
    return model


def _own_bytes(path: Path) -> int:
    if (path / "metadata.json").exists() and (path / "data").exists():
        md = json.loads((path / "metadata.json").read_text())
        return sum(n for f, n in md["data_files"].items() if not f.startswith("../"))
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _dcp_save(model: Any, opt: Any, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def scenario(name: str, model: Any, steps: int, root: Path) -> dict[str, Any]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    times: dict[str, list[float]] = {"full": [], "incremental": [], "dcp": []}
    sizes: dict[str, list[int]] = {"full": [], "incremental": [], "dcp": []}
    prev: str | None = None
    g = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        x = torch.randint(0, 8192, (2, 64), generator=g)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        state = {"model": model, "optim": opt}
        for how in ("full", "incremental", "dcp"):
            path = root / name / how / f"step-{step}"
            t0 = time.perf_counter()
            if how == "dcp":
                _dcp_save(model, opt, str(path))
            else:
                bytecp.save(str(path), state, base=prev if how == "incremental" else None)
            times[how].append(time.perf_counter() - t0)
            sizes[how].append(_own_bytes(path))
        prev = str(root / name / "incremental" / f"step-{step}")
    after = slice(1, None)
    return {
        "scenario": name, "model_bytes": total, "trainable_bytes": trainable, "steps": steps,
        **{f"{how}_bytes": int(statistics.median(sizes[how][after])) for how in sizes},
        **{f"{how}_s": round(statistics.median(times[how][after]), 3) for how in times},
        "first_bytes": sizes["incremental"][0],
    }


def detection_cost(total_bytes: int = 1 << 30, tensors: int = 256) -> dict[str, Any]:
    """Finding what changed on a ``total_bytes`` state: version tokens against a content hash."""
    from bytecp.format.checksum import crc32c
    from bytecp.saving.reuse import live_tokens
    from bytecp.tree.dtypes import host_memoryview
    from bytecp.tree.state import flatten_tree

    n = total_bytes // tensors // 4
    state = {"t": {str(i): torch.randn(n) for i in range(tensors)}}
    flat = flatten_tree(state)
    t0 = time.perf_counter()
    live_tokens(flat)
    tokens_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for t in state["t"].values():
        crc32c(host_memoryview(t))
    hash_s = time.perf_counter() - t0
    return {"state_bytes": total_bytes, "tensors": tensors, "version_tokens_s": round(tokens_s, 6),
            "crc32c_s": round(hash_s, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.incremental", description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--dir", help="where to write the checkpoints (default: a temporary directory)")
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args(argv)
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    root = Path(args.dir or tempfile.mkdtemp(prefix="bytecp-incr-"))
    try:
        rows = [scenario("lora", _lora(args.hidden, args.layers), args.steps, root),
                scenario("frozen-half", _frozen(args.hidden, args.layers), args.steps, root)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    det = detection_cost()
    out = {"scenarios": rows, "detection": det}
    print("| scenario | model | trainable | incremental | full | DCP | incremental s | full s | DCP s |")
    print("|---|---|---|---|---|---|---|---|---|")
    mib = 1 << 20
    for r in rows:
        print(f"| {r['scenario']} | {r['model_bytes'] / mib:.1f} MiB | {r['trainable_bytes'] / mib:.2f} MiB | "
              f"{r['incremental_bytes'] / mib:.2f} MiB | {r['full_bytes'] / mib:.1f} MiB | {r['dcp_bytes'] / mib:.1f} MiB"
              f" | {r['incremental_s']} | {r['full_s']} | {r['dcp_s']} |")
    print(f"finding what changed on {det['state_bytes'] >> 20} MiB in {det['tensors']} tensors: version tokens "
          f"{det['version_tokens_s'] * 1e3:.2f} ms, crc32c of the bytes {det['crc32c_s']:.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
