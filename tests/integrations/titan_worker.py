"""One rank of a torchtitan job running several trainer runs in turn
(``python -m tests.integrations.titan_worker SPEC.json``; the test and the
benchmark start one per rank with RANK/WORLD_SIZE/MASTER_* set).

SPEC: ``{"runs": [{"name", "args": [torchtitan CLI args], "verify": URL | null,
"verify_hf": DIR | null}], "out": FILE}``. Each run builds torchtitan's
real ``Trainer`` from the CLI args (the process group is created by the first
and reused), trains (or writes the seed checkpoint) and closes it. With
``verify``, every model and optimizer tensor right after the checkpoint load
must equal (``torch.equal``) the full tensor ``bytecp.load_state_dict(URL)``
holds; ``verify_hf`` compares the model with a Hugging Face directory
through torchtitan's state-dict adapter; ``no_dcp_hf`` makes torch DCP's
load and its Hugging Face reader raise during the run. Rank 0 writes each run's losses,
checkpoint timings and step times (or its error) to ``out``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

from tests.integrations.titan_shims import install

install()

import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402


def _full(t: Any) -> Any:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _compare(live: dict[str, Any], ref: dict[str, Any], what: str) -> int:
    n = 0
    for k, v in live.items():
        if not isinstance(v, torch.Tensor):
            continue
        if k not in ref:
            raise AssertionError(f"{what}: {k} not in the reference")
        full = _full(v)
        if not torch.equal(full, ref[k]):
            raise AssertionError(f"{what}: {k} differs from the checkpoint")
        n += 1
    missing = sorted(k for k, v in ref.items() if isinstance(v, torch.Tensor) and k not in live)
    if missing:  # every tensor of the checkpoint reached the live state
        raise AssertionError(f"{what}: the live state lacks {len(missing)} of the checkpoint's tensors: {missing[:5]}")
    return n


def verify_bytecp(trainer: Any, url: str) -> int:
    import bytecp

    ref = bytecp.load_state_dict(url)
    states = trainer.checkpointer.states
    # a DCP checkpoint of torchtitan's own backend holds the model's tensors at the top
    model = ref["model"] if "model" in ref else {k: v for k, v in ref.items() if isinstance(v, torch.Tensor)}
    n = _compare(states["model"].state_dict(), model, "model")
    if "optimizer" in ref:
        n += _compare(states["optimizer"].state_dict(), ref["optimizer"], "optimizer")
        assert ref["train_state"]["step"] == trainer.step, (ref["train_state"], trainer.step)
    return n


def verify_hf(trainer: Any, path: str) -> int:
    from safetensors.torch import load_file

    hf: dict[str, Any] = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            hf.update(load_file(os.path.join(path, f)))
    ref = trainer.checkpointer.sd_adapter.from_hf(hf)
    return _compare(trainer.checkpointer.states["model"].state_dict(), ref, "model (hf)")


def _poisoned(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("torch DCP's Hugging Face reader was used")


def run_one(run: dict[str, Any], record: dict[str, Any]) -> None:
    if not run.get("no_dcp_hf"):
        return _run_one(run, record)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import hf_storage

    reader, load = hf_storage.HuggingFaceStorageReader.__init__, dcp.load
    hf_storage.HuggingFaceStorageReader.__init__ = _poisoned  # type: ignore[assignment,method-assign]
    dcp.load = _poisoned
    try:
        _run_one(run, record)
    finally:
        hf_storage.HuggingFaceStorageReader.__init__ = reader  # type: ignore[method-assign]
        dcp.load = load


def _run_one(run: dict[str, Any], record: dict[str, Any]) -> None:
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.config import ConfigManager

    losses: dict[int, float] = {}
    original_log = MetricsProcessor.log

    def log(self: Any, step: int, global_avg_loss: float, *args: Any, **kwargs: Any) -> Any:
        losses[int(step)] = float(global_avg_loss)
        return original_log(self, step, global_avg_loss, *args, **kwargs)

    MetricsProcessor.log = log  # type: ignore[method-assign]
    try:
        config = ConfigManager().parse_args(run["args"])
        trainer = config.build()
        ckpt = trainer.checkpointer
        record["manager"] = type(ckpt).__name__
        save_times: list[float] = []
        original_save = ckpt.save

        def timed_save(curr_step: int, last_step: bool = False) -> bool:
            t = time.perf_counter()
            saved = original_save(curr_step, last_step)
            if saved and not last_step:
                save_times.append(time.perf_counter() - t)
            return saved

        ckpt.save = timed_save
        step_times: list[float] = []
        starts: list[float] = []
        original_step = trainer.train_step

        def timed_step(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            starts.append(t)
            out = original_step(*a, **k)
            step_times.append(time.perf_counter() - t)
            return out

        trainer.train_step = timed_step
        if run.get("verify") or run.get("verify_hf"):
            original_load = ckpt.load

            def load_and_verify(step: int = -1) -> bool:
                loaded = original_load(step)
                assert loaded, "nothing was loaded"
                if run.get("verify"):
                    record["verified"] = verify_bytecp(trainer, run["verify"])
                else:
                    record["verified"] = verify_hf(trainer, run["verify_hf"])
                return loaded

            ckpt.load = load_and_verify
        t0 = time.perf_counter()
        try:
            if config.checkpoint.create_seed_checkpoint:
                ckpt.save(curr_step=0, last_step=True)
            else:
                trainer.train()
        finally:
            trainer.close()
        loop = [b - a for a, b in zip(starts, starts[1:], strict=False)]  # step i's train_step + save, up to step i+1
        record.update(losses=losses, save_s=save_times, step_s=step_times, loop_s=loop,
                      wall_s=time.perf_counter() - t0)
    finally:
        MetricsProcessor.log = original_log  # type: ignore[method-assign]


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    results: dict[str, Any] = {}
    for run in spec["runs"]:
        record: dict[str, Any] = {}
        try:
            run_one(run, record)
        except Exception as e:  # recorded; the later runs still run (an error in bytecp reaches every rank)
            traceback.print_exc()
            record["error"] = f"{type(e).__name__}: {e}"[:2000]
        results[run["name"]] = record
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
    if int(os.environ.get("RANK", "0")) == 0:
        with open(spec["out"], "w") as f:
            json.dump(results, f, indent=1)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
