"""Subprocess for the export memory test: ``save CK N MIB``, ``baseline CK``,
``export CK OUT SHARD``; prints one JSON line with this process's peak RSS
(``ru_maxrss``, KiB on Linux) and the seconds the step took."""

from __future__ import annotations

import json
import resource
import sys
import time


def tensor(i: int, mib: int):  # noqa: ANN201 - torch is imported late on purpose
    import torch

    g = torch.Generator().manual_seed(i)
    return torch.randn(mib << 18, generator=g).reshape(-1, 1024)  # mib MiB of float32


def main() -> None:
    mode, ck = sys.argv[1], sys.argv[2]
    import torch  # noqa: F401 - part of the baseline every mode pays

    import bytecp
    from bytecp.storage_api import open_storage

    t0 = time.perf_counter()
    if mode == "save":
        n, mib = int(sys.argv[3]), int(sys.argv[4])
        bytecp.save(ck, {"model": {f"layer{i}": {"weight": tensor(i, mib)} for i in range(n)}})
    elif mode == "baseline":
        from bytecp.interop.export import select_tensors
        from bytecp.loading.opened import open_checkpoint

        md = open_checkpoint(open_storage(ck)).metadata
        select_tensors(md, ck)
    else:
        from bytecp.interop.hf_export import export_hf

        export_hf(open_storage(ck), sys.argv[3], max_shard_size=sys.argv[4])
    print(json.dumps({"maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                      "seconds": time.perf_counter() - t0}))


if __name__ == "__main__":
    main()
