"""S3 save/load throughput: bytecp vs plain s3fs vs DCP's FsspecWriter/FsspecReader.

One process, one run, methods alternated; ratios come from medians taken in
the same run. By default it starts its own Ceph RADOS Gateway on 127.0.0.1
(tools/ceph/start_rgw.sh, bluestore on a sparse file in a temp dir) and
stops it at the end; ``--endpoint`` uses a running server instead, with
credentials from the standard AWS environment.

    python -m benchmarks.s3_bench                       # 0.5 GB of state, 3 repeats
    python -m benchmarks.s3_bench --gb 1 --repeats 5 --json out.json

Methods (the same bytes: a GPT-like model's parameters and Adam state):

- ``s3fs-*``: plain s3fs uploads of the state's bytes, already serialized (the
  serialization is not timed): ``s3fs-one``, one ``pipe_file`` of all bytes;
  ``s3fs-4``/``s3fs-8``, 4 or 8 objects uploaded concurrently with 16 MiB
  parts, 2 in flight per object. All with the fast-over-HTTP client config
  (no payload signing, checksums only when required). The best is the
  reference for bytecp's save.
- ``bytecp``: ``bytecp.save``/``bytecp.load`` with the S3 backend's defaults.
- ``dcp``: ``torch.distributed.checkpoint`` save/load (no process group)
  through ``FsspecWriter``/``FsspecReader`` with the same fast client config,
  ``sync_files=False``; ``dcp-t4`` uses ``thread_count=4``.

Ceph keeps deleted data until its garbage collector runs; the benchmark
deletes each checkpoint and runs ``radosgw-admin gc process --include-all``
between measurements.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20

FAST_CONFIG = {
    "s3": {"payload_signing_enabled": False},
    "request_checksum_calculation": "when_required",
    "response_checksum_validation": "when_required",
}


# -- the server ---------------------------------------------------------------


class Server:
    def __init__(self, endpoint: str | None, osd_store: str) -> None:
        self.dir: str | None = None
        self.conf: str | None = None
        if endpoint:
            self.endpoint = endpoint
            self.key = os.environ.get("AWS_ACCESS_KEY_ID")
            self.secret = os.environ.get("AWS_SECRET_ACCESS_KEY")
            return
        sys.path.insert(0, os.path.join(REPO, "tests", "storage"))
        from s3_servers import free_port

        self.dir = tempfile.mkdtemp(prefix="bytecp-bench-ceph-")
        env = dict(os.environ, RGW_PORT=str(free_port()), MON_PORT=str(free_port()), OSD_STORE=osd_store)
        out = subprocess.run(
            ["bash", os.path.join(REPO, "tools", "ceph", "start_rgw.sh"), self.dir],
            env=env, capture_output=True, text=True, timeout=300,
        )
        if out.returncode != 0:
            sys.exit(f"could not start Ceph RGW:\n{out.stderr[-3000:]}")
        values = dict(
            line[len("export "):].split("=", 1) for line in out.stdout.splitlines() if line.startswith("export ")
        )
        self.endpoint = values["S3_ENDPOINT_URL"]
        self.key, self.secret = values["AWS_ACCESS_KEY_ID"], values["AWS_SECRET_ACCESS_KEY"]
        self.conf = values["CEPH_CONF"]

    def options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"endpoint_url": self.endpoint}
        if self.key:
            opts.update(key=self.key, secret=self.secret)
        return opts

    def s3fs(self, **kw: Any) -> Any:
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.options(), **kw)

    def gc(self) -> None:
        if self.conf:
            subprocess.run(["radosgw-admin", "-c", self.conf, "gc", "process", "--include-all"],
                           capture_output=True, timeout=300)

    def stop(self) -> None:
        if self.dir:
            subprocess.run(["bash", os.path.join(REPO, "tools", "ceph", "stop_rgw.sh"), self.dir],
                           capture_output=True, timeout=120)


# -- the state ----------------------------------------------------------------


def make_state(gb: float, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    from benchmarks.model import build, config_for_gb, state_bytes, train_step

    cfg = config_for_gb(gb)
    model, optim = build(cfg, "plain", seed=seed)
    train_step(model, optim, cfg, seed=seed)
    return model, optim, state_bytes(model, optim)


def tensors_of(model: torch.nn.Module, optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach() for p in model.parameters()]
    for st in optim.state.values():
        out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    return out


def blobs(ts: list[torch.Tensor], n: int) -> list[bytes]:
    """The tensors' bytes in ``n`` objects of about equal size (what a plain uploader would send)."""
    groups: list[list[torch.Tensor]] = [[] for _ in range(n)]
    sizes = [0] * n
    for t in sorted(ts, key=lambda t: -t.numel() * t.element_size()):
        i = sizes.index(min(sizes))
        groups[i].append(t)
        sizes[i] += t.numel() * t.element_size()
    return [b"".join(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in g) for g in groups if g]


# -- the methods --------------------------------------------------------------


def s3fs_upload(server: Server, bucket: str, prefix: str, objects: list[bytes], concurrent: bool) -> None:
    import fsspec.asyn

    fs = server.s3fs(config_kwargs=FAST_CONFIG)
    if not concurrent:
        fs.pipe_file(f"{bucket}/{prefix}/all.bin", objects[0])
        return

    async def go() -> None:
        await asyncio.gather(*[
            fs._pipe_file(f"{bucket}/{prefix}/{i}.bin", b, chunksize=16 * MiB, max_concurrency=2)
            for i, b in enumerate(objects)
        ])

    fsspec.asyn.sync(fs.loop, go)


def dcp_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": optim.state_dict()}


def dcp_save(server: Server, url: str, model: Any, optim: Any, threads: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    # storage options go to the writer; passing checkpoint_id as well would drop them
    writer = FsspecWriter(url, sync_files=False, thread_count=threads,
                          config_kwargs=FAST_CONFIG, **server.options())
    dcp.save(dcp_state(model, optim), storage_writer=writer, no_dist=True)


def dcp_load(server: Server, url: str, model: Any, optim: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    reader = FsspecReader(url, config_kwargs=FAST_CONFIG, **server.options())
    sd = dcp_state(model, optim)
    dcp.load(sd, storage_reader=reader, no_dist=True)
    optim.load_state_dict(sd["optim"])


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return all(torch.equal(sa[k], sb[k]) for k in sa)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=0.5, help="GB of model + Adam state (default 0.5)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--endpoint", help="use this S3 endpoint instead of starting Ceph RGW")
    ap.add_argument("--bucket", help="bucket to use (created if missing; default: a new one)")
    ap.add_argument("--osd-store", default="bluestore", choices=["bluestore", "memstore"])
    ap.add_argument("--methods", default="s3fs-one,s3fs-4,s3fs-8,bytecp,dcp,dcp-t4")
    ap.add_argument("--no-load", action="store_true", help="measure saves only")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

    import bytecp
    from bytecp.storage_api import open_storage

    methods = [m for m in args.methods.split(",") if m]
    server = Server(args.endpoint, args.osd_store)
    try:
        bucket = args.bucket or f"bench-{uuid.uuid4().hex[:8]}"
        fs = server.s3fs()
        if not fs.exists(bucket):
            fs.mkdir(bucket)
        model, optim, nbytes = make_state(args.gb, seed=0)
        target, target_optim, _ = make_state(args.gb, seed=1)
        ts = tensors_of(model, optim)
        pre = {m: blobs(ts, {"s3fs-one": 1, "s3fs-4": 4, "s3fs-8": 8}[m]) for m in methods if m.startswith("s3fs")}
        print(f"state: {nbytes / 1e9:.3f} GB in {len(ts)} tensors; endpoint {server.endpoint}; "
              f"bucket {bucket}; {args.repeats} repeats", flush=True)

        saves: dict[str, list[float]] = {m: [] for m in methods}
        loads: dict[str, list[float]] = {m: [] for m in methods if m in ("bytecp", "dcp")}

        def timed(fn: Callable[[], None]) -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

        for r in range(args.repeats):
            order = methods[r % len(methods):] + methods[: r % len(methods)]
            for m in order:
                prefix = f"{m}-{r}-{uuid.uuid4().hex[:6]}"
                url = f"s3://{bucket}/{prefix}"
                if m.startswith("s3fs"):
                    dt = timed(lambda m=m, prefix=prefix: s3fs_upload(server, bucket, prefix, pre[m], m != "s3fs-one"))
                elif m == "bytecp":
                    dt = timed(lambda url=url: bytecp.save(url, {"model": model, "optimizer": optim},
                                                           storage_options=server.options()))
                elif m.startswith("dcp"):
                    threads = 4 if m == "dcp-t4" else 1
                    dt = timed(lambda url=url, threads=threads: dcp_save(server, url, model, optim, threads))
                else:
                    raise SystemExit(f"unknown method {m!r}")
                saves[m].append(dt)
                line = f"repeat {r} {m:9s} save {nbytes / dt / 1e9:6.3f} GB/s ({dt:.2f} s)"
                if m in loads and not args.no_load:
                    with torch.no_grad():
                        for p in target.parameters():
                            p.zero_()
                    if m == "bytecp":
                        lt = timed(lambda url=url: bytecp.load(url, {"model": target, "optimizer": target_optim},
                                                               storage_options=server.options()))
                    else:
                        lt = timed(lambda url=url: dcp_load(server, url, target, target_optim))
                    if not same(model, target):
                        raise SystemExit(f"{m}: loaded state differs from the saved one")
                    loads[m].append(lt)
                    line += f"   load {nbytes / lt / 1e9:6.3f} GB/s ({lt:.2f} s)"
                print(line, flush=True)
                open_storage(url, **server.options()).delete_prefix()
                server.gc()

        def gbps(xs: list[float]) -> float:
            return nbytes / statistics.median(xs) / 1e9 if xs else float("nan")

        save_rate = {m: gbps(v) for m, v in saves.items()}
        load_rate = {m: gbps(v) for m, v in loads.items() if v}
        best_s3fs = max((v for m, v in save_rate.items() if m.startswith("s3fs")), default=float("nan"))
        best_dcp_save = max((v for m, v in save_rate.items() if m.startswith("dcp")), default=float("nan"))
        result: dict[str, Any] = {
            "state_gb": nbytes / 1e9,
            "repeats": args.repeats,
            "endpoint": server.endpoint,
            "osd_store": args.osd_store if not args.endpoint else None,
            "save_gbps": save_rate,
            "load_gbps": load_rate,
        }
        if "bytecp" in save_rate:
            result["bytecp_save_vs_best_s3fs"] = save_rate["bytecp"] / best_s3fs
            result["bytecp_save_vs_best_dcp"] = save_rate["bytecp"] / best_dcp_save
            if "bytecp" in load_rate and "dcp" in load_rate:
                result["bytecp_load_vs_dcp"] = load_rate["bytecp"] / load_rate["dcp"]
        print("\n| method | save GB/s | load GB/s |\n|---|---|---|")
        for m in methods:
            ld = f"{load_rate[m]:.3f}" if m in load_rate else ""
            print(f"| {m} | {save_rate[m]:.3f} | {ld} |")
        for k in ("bytecp_save_vs_best_s3fs", "bytecp_save_vs_best_dcp", "bytecp_load_vs_dcp"):
            if k in result:
                print(f"{k}: {result[k]:.2f}x")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
