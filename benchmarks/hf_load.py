"""Loading a Hugging Face directory into an FSDP2 model on 2 ranks: bytecp
(``bytecp.load(HF_DIR, {"model": model})``) against DCP's
``HuggingFaceStorageReader`` (``dcp.load``) and against ``from_pretrained``
on every rank, then ``fully_shard``.

A tiny Llama built from a config (no hub), about 240 MB in fp32, saved with
``save_pretrained`` in 50 MB shards. Each method runs in fresh gloo ranks
(so peak RSS is its own). bytecp and DCP build the model on the meta device,
shard it, allocate only the shards (``to_empty``) and load into them.
Reported per rank: wall time of the load (model build and sharding
included, imports not), peak resident memory during the load (sampled every
millisecond) and how far it rose above the resident memory at its start,
and bytes read: bytecp's from its trace; DCP's the bytes of the slices it
requests (it reads them through ``safe_open``'s mmap); ``from_pretrained``'s
the whole directory (every rank reads every tensor).

Run: ``python -m benchmarks.hf_load [--hidden 512 --layers 8]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

__all__ = ["main"]

METHODS = ["bytecp", "dcp_hf_reader", "from_pretrained_then_shard"]


def _config(hidden: int, layers: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                       num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)


def _shard(model: torch.nn.Module) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.model.layers:  # type: ignore[attr-defined, union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _sharded_empty(cfg: Any) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    _shard(model)
    model.to_empty(device="cpu")
    return model


def _load(method: str, path: str, cfg: Any) -> tuple[torch.nn.Module, int]:
    """The loaded model and the bytes this rank read (or requested)."""
    if method == "bytecp":
        import bytecp
        from bytecp.recorder import recording

        model = _sharded_empty(cfg)
        with recording() as reports:
            bytecp.load(path, {"model": model})
        if os.environ.get("HF_LOAD_SPANS"):
            spans: dict[str, float] = {}
            for r in reports:
                for s in r.spans:
                    spans[s.phase] = spans.get(s.phase, 0.0) + s.duration
            print("bytecp spans", {k: round(v, 3) for k, v in spans.items()}, flush=True)
        return model, sum(s.nbytes for r in reports for s in r.spans if s.phase == "read")
    if method == "dcp_hf_reader":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        requested = [0]
        reader = HuggingFaceStorageReader(path)
        orig = reader.read_data

        def counting(plan: Any, planner: Any) -> Any:
            for item in plan.items:
                requested[0] += math.prod(item.lengths) * 4  # fp32
            return orig(plan, planner)

        reader.read_data = counting  # type: ignore[method-assign]
        model = _sharded_empty(cfg)
        dcp.load(model.state_dict(), storage_reader=reader)
        return model, requested[0]
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path)
    _shard(model)
    return model, sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


class _PeakRss:
    """The process's resident set, sampled every millisecond from /proc until :meth:`stop`."""

    def __init__(self) -> None:
        self.base = self.peak = _rss()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.wait(0.001):
            self.peak = max(self.peak, _rss())

    def stop(self) -> tuple[int, int]:
        self._done.set()
        self._thread.join()
        return self.base, max(self.peak, _rss())


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _rank(rank: int, method: str, path: str, hidden: int, layers: int, port: int, out: Any) -> None:
    try:
        _measure(rank, method, path, hidden, layers, port, out)
    except BaseException:
        import traceback

        out.put((rank, {"error": traceback.format_exc()}))


def _measure(rank: int, method: str, path: str, hidden: int, layers: int, port: int, out: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import torch.distributed.checkpoint as _dcp  # noqa: F401 - imports outside the timed region
    import transformers  # noqa: F401

    import bytecp  # noqa: F401

    cfg = _config(hidden, layers)
    dist.barrier()
    sampler = _PeakRss()
    t0 = time.perf_counter()
    model, nbytes = _load(method, path, cfg)
    dist.barrier()
    seconds = time.perf_counter() - t0
    base, peak = sampler.stop()
    sd = model.state_dict()
    check = {k: (v.full_tensor() if isinstance(v, DTensor) else v).double().sum().item()
             for k, v in sorted(sd.items())[:3]}
    out.put((rank, {"seconds": seconds, "peak_rss_mib": peak / 2**20, "rss_over_start_mib": (peak - base) / 2**20,
                    "bytes_read": nbytes, "check": check}))
    dist.destroy_process_group()


def run(method: str, path: str, hidden: int, layers: int) -> list[dict[str, Any]]:
    from tests.netport import free_port  # noqa: PLC0415 - the test helper picks a free port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, method, path, hidden, layers, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=300) for _ in procs)
    for r in got.values():
        if "error" in r:
            raise RuntimeError(f"{method} failed on a rank:\n{r['error']}")
    for p in procs:
        p.join(60)
    return [got[0], got[1]]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--methods", default=",".join(METHODS))
    args = ap.parse_args(argv)
    from transformers import LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "llama")
        torch.manual_seed(0)
        LlamaForCausalLM(_config(args.hidden, args.layers)).save_pretrained(path, max_shard_size="50MB")
        size = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
        print(f"model: {size / 2**20:.0f} MiB of safetensors in {len(list(Path(path).glob('*.safetensors')))} files; "
              "FSDP2 x2 gloo ranks")
        results: dict[str, Any] = {}
        for _ in range(args.repeat):
            for m in args.methods.split(","):
                per_rank = run(m, path, args.hidden, args.layers)
                results.setdefault(m, []).append(per_rank)
                checks = {json.dumps(r["check"], sort_keys=True) for r in per_rank}
                print(f"{m:28s} " + "  ".join(
                    f"rank {i}: {r['seconds']:6.2f} s, peak RSS {r['peak_rss_mib']:6.0f} MiB "
                    f"(+{r['rss_over_start_mib']:5.0f}), read {r['bytes_read'] / 2**20:6.1f} MiB"
                    for i, r in enumerate(per_rank)) + f"  checksum {sorted(checks)[0][:40]}")
        print(json.dumps({m: [[{k: v for k, v in r.items() if k != "check"} for r in rr] for rr in v]
                          for m, v in results.items()}))


if __name__ == "__main__":
    main()
