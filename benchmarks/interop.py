"""Hand-off benchmarks: ``bytecp export --format dcp`` against ``dcp.save``
of the same state.

One process, no process group. A training state of about 200 MB (a model
of fp32 Linear layers plus Adam's two moments and step) is saved once with
bytecp; then, alternated ``--repeat`` times, each timed on its own:

- ``export_dcp``: :func:`bytecp.interop.dcp_export.export_dcp` from that
  checkpoint (reads every chunk, checks its crc32c, writes the DCP directory
  and commits it);
- ``dcp.save``: ``torch.distributed.checkpoint.save`` of the same state,
  already in memory (``get_state_dict``), to a fresh directory: what the
  export replaces is a DCP save by the training job itself.

Then both directories are loaded with ``dcp.load`` into fresh targets and
compared bitwise. Reported: median and best seconds, bytes on disk (data
files and ``.metadata``) and the ratios export / save.

Run: ``python -m benchmarks.interop [--mib 200 --repeat 3]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["build_state", "dcp_export_vs_save", "main"]


def build_state(mib: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Linear layers of 1024 x 1024 fp32 (4 MiB each) with Adam stepped once:
    about ``mib`` MiB of weights, moments and biases together."""
    torch.manual_seed(0)
    layers = max(1, mib // 12)  # weight + 2 moments = 12 MiB a layer
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(layers)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 1024)).square().mean().backward()
    opt.step()
    return model, opt


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def dcp_export_vs_save(mib: int = 200, repeat: int = 3, workdir: str | None = None) -> dict[str, Any]:
    """The figures of one run (see the module docstring)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import bytecp
    from bytecp.interop.dcp_export import export_dcp

    base = Path(tempfile.mkdtemp(prefix="bytecp-interop-", dir=workdir))
    try:
        model, opt = build_state(mib)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        bytecp.save(str(base / "ck"), {"model": model, "optim": opt})
        times: dict[str, list[float]] = {"export_dcp": [], "dcp.save": []}
        for i in range(repeat):
            for name in times:
                out = base / f"{name}-{i}"
                t0 = time.perf_counter()
                if name == "export_dcp":
                    export_dcp(str(base / "ck"), str(out))
                else:
                    dcp.save(state, checkpoint_id=str(out))
                times[name].append(time.perf_counter() - t0)
        sizes = {name: _dir_bytes(base / f"{name}-0") for name in times}
        for name in times:  # both load bitwise into fresh targets, model and optimizer
            target = {"model": {k: torch.zeros_like(v) for k, v in msd.items()},
                      "optim": {"state": {f: {k: torch.zeros_like(v) for k, v in st.items()}
                                          for f, st in osd["state"].items()},
                                "param_groups": copy.deepcopy(osd["param_groups"])}}
            dcp.load(target, checkpoint_id=str(base / f"{name}-0"))
            assert all(torch.equal(target["model"][k], v) for k, v in msd.items()), name
            assert all(torch.equal(target["optim"]["state"][f][k], v)
                       for f, st in osd["state"].items() for k, v in st.items()), name
        state_bytes = sum(t.numel() * t.element_size() for t in msd.values())
        state_bytes += sum(t.numel() * t.element_size() for st in osd["state"].values() for t in st.values()
                           if isinstance(t, torch.Tensor))
        med = {name: statistics.median(v) for name, v in times.items()}
        return {
            "state_mib": round(state_bytes / 2**20, 1), "repeat": repeat,
            "seconds": {k: round(v, 3) for k, v in med.items()},
            "runs": {k: [round(x, 3) for x in v] for k, v in times.items()},
            "best_seconds": {k: round(min(v), 3) for k, v in times.items()},
            "bytes": sizes, "ratio_time_export_over_save": round(med["export_dcp"] / med["dcp.save"], 2),
            "ratio_best_time_export_over_save": round(min(times["export_dcp"]) / min(times["dcp.save"]), 2),
            "ratio_bytes_export_over_save": round(sizes["export_dcp"] / sizes["dcp.save"], 4),
        }
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=200, help="size of the training state (default 200 MiB)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", help="where the checkpoints are written (default: the temp directory)")
    args = ap.parse_args(argv)
    print(json.dumps(dcp_export_vs_save(args.mib, args.repeat, args.workdir), indent=2))


if __name__ == "__main__":
    main()
