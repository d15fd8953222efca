"""The demo's evaluation job: one process, plain torch and ``safetensors``.

    python -m bytecp.demo.evaluate EXPORTED [--json FILE]

``EXPORTED`` is what ``bytecp export`` wrote: a Hugging Face layout directory
(``model.safetensors.index.json`` and the shards its ``weight_map`` names,
or a single ``model.safetensors``) or one ``.safetensors`` file. The job
rebuilds the demo's model from its class, loads the weights strictly (every
name present, no extra one), and prints the loss on the held-out batch the
training job evaluated. Nothing of bytecp's checkpointing runs here and
torch.distributed is never initialised; ``--json`` records both facts (the
bytecp modules this process imported) next to the loss.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from bytecp.plugins import missing_extra

try:
    from safetensors.torch import load_file
except ModuleNotFoundError as e:  # the demo extra
    raise missing_extra(e, "demo", __name__) from None

from bytecp.demo.model import TinyGPT, eval_batch, loss_of

__all__ = ["read_exported", "main"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def read_exported(path: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Every tensor of an export and the files they came from."""
    if os.path.isdir(path):
        index = os.path.join(path, INDEX)
        if os.path.exists(index):
            with open(index) as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
            tensors: dict[str, torch.Tensor] = {}
            for name in files:
                tensors.update(load_file(os.path.join(path, name)))
            missing = sorted(set(weight_map) - set(tensors))
            if missing:
                raise SystemExit(f"evaluate: {index} names tensors its shards lack: {missing[:5]}")
            return tensors, [os.path.join(path, n) for n in files]
        path = os.path.join(path, SINGLE)
    if not os.path.exists(path):
        raise SystemExit(f"evaluate: no {INDEX} or {SINGLE} at {path}; pass what `bytecp export` wrote")
    return load_file(path), [path]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("exported", help="the export: a directory (Hugging Face layout) or a .safetensors file")
    ap.add_argument("--json", help="also write the loss and what this process used to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # as each training process did: the same arithmetic, the same bits
    tensors, files = read_exported(args.exported)
    model = TinyGPT()
    model.load_state_dict(tensors, strict=True)
    model.eval()
    with torch.no_grad():
        loss = float(loss_of(model, *eval_batch()))
    print(f"read {len(tensors)} tensors from {', '.join(os.path.basename(f) for f in files)}; "
          f"evaluation loss on held-out data: {loss:.4f} (exactly {loss!r}, float32)", flush=True)
    if args.json:
        used = sorted(m for m in sys.modules if m == "bytecp" or m.startswith("bytecp."))
        with open(args.json, "w") as f:
            json.dump({"loss": loss, "files": files, "tensors": len(tensors), "bytecp_modules": used,
                       "distributed_initialized": torch.distributed.is_available()
                       and torch.distributed.is_initialized()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
