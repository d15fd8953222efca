"""The scale benchmark's MoE load from S3: one rank's ``read_parts`` +
``plan_load`` reading the index parts one at a time against
``PART_READERS`` (16) at once (``python -m benchmarks.scale_s3_load``).

The checkpoint is the one :func:`benchmarks.scale.loads` builds for the
DeepSeek-V3-like MoE (EP 64, :func:`benchmarks.scale_jobs.moe_job`): the
directory and ``metadata.json`` of every rank, and the real parts of every
rank the middle rank's targets meet (2,058 at 131,072 ranks;
:func:`benchmarks.scale_load.prepare`). It is built in a temporary
directory, then every file of it is uploaded to a new bucket on an S3
server (16 files at once through bytecp's own S3 backend, ``write_file``,
then ``metadata.json`` by ``commit`` as a save does), and the middle rank's
:func:`benchmarks.scale_load.load` is timed through that backend with
:data:`bytecp.format.parts_fetch.PART_READERS` set to 1 (one part at a time,
the reader before parts were read at once) and to 16 (the default), and on
the local directory for reference (a local disk's parts are read one at a
time whatever ``PART_READERS`` says). The three are alternated, each
repeat in a rotated order, after one untimed load of each (the S3 client's
connections opened, the server's and the page cache warm); the figures are
medians of ``--repeats``. The S3 backend lets ``max_concurrency`` (8 by
default; ``--max-concurrency``) requests be in flight at once whatever the
number of threads asking. Also: ``metadata.json`` fetched from S3 and parsed
(every loading rank does both first), the parts and bytes each load read,
the CPU seconds of this process and of the Ceph daemons during each load,
each part's ``read_ranges`` call (its wall time: at once, with the wait for
one of the backend's request slots), and the upload.

The S3 server is started here and stopped at the end, also on error:
``ceph`` (default) a Ceph RADOS Gateway on 127.0.0.1 (``tools/ceph/
start_rgw.sh`` via :class:`benchmarks.s3_bench.Server`, bluestore on a
sparse file, or ``--osd-store memstore``), a real S3 server over loopback;
``moto`` moto's threaded emulator, which runs in this process's threads and
competes with the reader for the interpreter (for a quick check only).
Over loopback a request costs CPU time on both sides, not a network round
trip; but RGW's beast frontend leaves Nagle's algorithm on by default, and a
small GET's reply then often waits for the client's delayed ACK (~40 ms),
much as a request would on a real network. ``--tcp-nodelay`` turns it off
(``RGW_TCP_NODELAY=1`` for the script): then each GET costs about 4 ms of
CPU, client and server together, and on few cores reading at once gains
little. Results: docs/benchmarks-history-scale.md, "The MoE middle rank's index read from S3".

    python -m benchmarks.scale_s3_load --world 131072            # Ceph, 3 repeats
    python -m benchmarks.scale_s3_load --world 131072 --tcp-nodelay --max-concurrency 16
    python -m benchmarks.scale_s3_load --world 4096 --server moto --repeats 1 --out s3load.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from bytecp.format import metadata as fmt
from bytecp.format import parts_fetch
from bytecp.format.parts_schema import buckets_for
from bytecp.storage_api import Storage, open_storage

from . import scale_jobs as jobs
from . import scale_load as sl
from .scale_parts import Entries

__all__ = ["main", "run"]

REPO = Path(__file__).resolve().parents[1]


class Counting(sl.Recording):
    """A :class:`~benchmarks.scale_load.Recording` that also counts the bytes
    of each file and the ``read_ranges``/``read_files`` calls, and times each call (thread-safe:
    parts are read at once)."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.bytes: dict[str, int] = {}
        self.calls: list[tuple[str, float]] = []
        self._lock = threading.Lock()

    def read_ranges(self, path: str, ranges: Any, **kw: Any) -> None:
        t0 = time.perf_counter()
        super().read_ranges(path, ranges, **kw)
        took = time.perf_counter() - t0
        n = sum(len(v) for _, v in ranges)
        with self._lock:
            self.bytes[path] = self.bytes.get(path, 0) + n
            self.calls.append((path, took))

    def read_files(self, reads: Any) -> None:  # (a local disk's batch: one call)
        t0 = time.perf_counter()
        super().read_files(reads)
        took = time.perf_counter() - t0
        with self._lock:
            for path, ranges in reads:
                self.bytes[path] = self.bytes.get(path, 0) + sum(len(v) for _, v in ranges)
            self.calls.append((reads[0][0] if reads else "", took))

    def clear(self) -> None:
        self.read.clear()
        self.bytes.clear()
        self.calls.clear()


class Moto:
    """moto's threaded S3 server (tests/storage/s3_servers.py), as :class:`benchmarks.s3_bench.Server` is used."""

    def __init__(self) -> None:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
        sys.path.insert(0, str(REPO / "tests" / "storage"))
        from s3_servers import start_moto

        self.server = start_moto()
        self.endpoint = self.server.endpoint_url

    def options(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint, "key": self.server.key, "secret": self.server.secret}

    def stop(self) -> None:
        self.server.stop()


def server_cpu(server: Any) -> float | None:
    """CPU seconds the Ceph daemons (mon, osd, radosgw: their pid files) have used so far; None for moto
    (it runs in this process: its CPU is the client's)."""
    run_dir = Path(server.dir) / "run" if getattr(server, "dir", None) else None
    if run_dir is None:
        return None
    total = 0
    for f in run_dir.glob("*.pid"):
        try:
            stat = Path(f"/proc/{int(f.read_text())}/stat").read_text()
        except (OSError, ValueError):
            continue
        fields = stat.rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of proc(5))
    return total / os.sysconf("SC_CLK_TCK")


def start_server(kind: str, osd_store: str, tcp_nodelay: bool) -> Any:
    if kind == "moto":
        return Moto()
    from .s3_bench import Server

    before = os.environ.get("RGW_TCP_NODELAY")
    os.environ["RGW_TCP_NODELAY"] = str(int(tcp_nodelay))  # read by tools/ceph/start_rgw.sh
    try:
        return Server(None, osd_store)
    finally:
        if before is None:
            del os.environ["RGW_TCP_NODELAY"]
        else:
            os.environ["RGW_TCP_NODELAY"] = before


def upload(root: Path, url: str, options: dict[str, Any], width: int) -> dict[str, Any]:
    """Every file under ``root`` to ``url``, ``width`` at once through bytecp's S3 backend;
    ``metadata.json`` last, by ``commit`` (as a save publishes it)."""
    import s3fs

    bucket = url[len("s3://"):].split("/", 1)[0]
    fs = s3fs.S3FileSystem(skip_instance_cache=True, endpoint_url=options["endpoint_url"],
                           key=options.get("key"), secret=options.get("secret"))
    fs.mkdir(bucket)
    storage = open_storage(url, **options)
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    files.remove(fmt.METADATA_FILE)
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(width, "upload") as ex:
        sizes = list(ex.map(lambda rel: _put(storage, root, rel), files))
    md = (root / fmt.METADATA_FILE).read_bytes()
    storage.commit(fmt.METADATA_FILE, md)
    took = time.perf_counter() - t0
    listed = storage.file_sizes()
    assert len(listed) == len(files) + 1 and sum(listed.values()) == sum(sizes) + len(md), "upload incomplete"
    return {"files": len(files) + 1, "mb": (sum(sizes) + len(md)) / 1e6, "s": took}


def _put(storage: Storage, root: Path, rel: str) -> int:
    data = (root / rel).read_bytes()
    storage.write_file(rel, [data])
    return len(data)


def timed_load(storage: Counting, md: fmt.Metadata, job: jobs.Job, rank: int, written: set[str],
               readers: int, server: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """One middle-rank load with ``PART_READERS = readers``: (its times: seconds, this process's
    CPU seconds, the server's, each part's ``read_ranges`` call; what it read)."""
    saved = parts_fetch.PART_READERS
    parts_fetch.PART_READERS = readers
    try:
        storage.clear()
        gc.collect()
        s0 = server_cpu(server)
        c0 = time.process_time()
        t0 = time.perf_counter()
        rows, segs, reqs = sl.load(storage, md, job, rank, written)
        took = time.perf_counter() - t0
        cpu = time.process_time() - c0
        s1 = server_cpu(server)
    finally:
        parts_fetch.PART_READERS = saved
    assert md.index is not None
    directory = md.index.file
    parts = storage.read - {directory}
    times = {"s": took, "client_cpu_s": cpu, "server_cpu_s": None if s0 is None or s1 is None else s1 - s0,
             "part_reads_s": [t for p, t in storage.calls if p != directory]}
    return times, {"rows": rows, "segments": segs, "requests_planned": reqs, "parts_read": len(parts),
                   "part_bytes": sum(n for p, n in storage.bytes.items() if p != directory),
                   "directory_bytes": storage.bytes.get(directory, 0), "read_calls": len(storage.calls)}


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the runs' times; each part read's wait over every run (median, 90th percentile,
    how many took over 30 ms: a reply held back by Nagle's algorithm waits ~40 ms)."""
    waits = sorted(t for r in runs for t in r["part_reads_s"])
    servers = [r["server_cpu_s"] for r in runs if r["server_cpu_s"] is not None]
    return {"s": statistics.median(r["s"] for r in runs), "runs_s": [r["s"] for r in runs],
            "client_cpu_s": statistics.median(r["client_cpu_s"] for r in runs),
            "server_cpu_s": statistics.median(servers) if servers else None,
            "part_read_ms": {"p50": 1e3 * waits[len(waits) // 2], "p90": 1e3 * waits[9 * len(waits) // 10],
                             "over_30ms_share": sum(t > 0.03 for t in waits) / len(waits)} if waits else None}


def run(world: int, server_kind: str, repeats: int, readers: int, osd_store: str, max_parts: int,
        upload_width: int, max_concurrency: int | None = None, tcp_nodelay: bool = False) -> dict[str, Any]:
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")  # s3fs's mkdir (a region kwarg sends a LocationConstraint)
    job = jobs.moe_job(world)
    rank = world // 2
    t0 = time.perf_counter()
    entries = Entries(job, buckets_for(world))
    out: dict[str, Any] = {"world": world, "rank": rank, "label": job.label, "server": server_kind,
                           "repeats": repeats, "readers": readers, "max_concurrency": max_concurrency,
                           "rgw_tcp_nodelay": tcp_nodelay if server_kind == "ceph" else None}
    with tempfile.TemporaryDirectory(prefix="bytecp-s3load-") as tmp:
        root = Path(tmp) / "ck"
        got = sl.prepare(root, job, entries, [rank], max_parts)
        if not got["written"]:
            raise SystemExit(f"the middle rank touches {got['touched'][rank]['parts']} parts, more than "
                             f"--max-parts {max_parts}")
        out |= {"touched": got["touched"][rank], "parts_written": got["parts_written"],
                "build_s": time.perf_counter() - t0}
        written = sl.written_parts(entries)
        print(f"built: {out['touched']} in {out['build_s']:.1f} s; starting {server_kind}", flush=True)
        server = start_server(server_kind, osd_store, tcp_nodelay)
        try:
            out["endpoint"] = server.endpoint
            url = f"s3://bench-{uuid.uuid4().hex[:8]}/ck"
            out["upload"] = upload(root, url, server.options(), upload_width)
            print(f"uploaded: {out['upload']}", flush=True)
            extra = {} if max_concurrency is None else {"max_concurrency": max_concurrency}
            s3 = Counting(open_storage(url, **server.options(), **extra))
            out["max_concurrency"] = s3.inner.max_concurrency  # type: ignore[attr-defined]
            local = Counting(open_storage(str(root)))
            assert s3.remote and not local.remote

            fetch, parse = [], []
            md = None
            for _ in range(repeats):
                gc.collect()
                t1 = time.perf_counter()
                raw = s3.inner.read_bytes(fmt.METADATA_FILE)
                t2 = time.perf_counter()
                md = fmt.Metadata.from_bytes(raw, s3.url)
                parse.append(time.perf_counter() - t2)
                fetch.append(t2 - t1)
            assert md is not None
            md_local = fmt.Metadata.from_bytes((root / fmt.METADATA_FILE).read_bytes(), local.url)
            out["metadata"] = {"mb": len(raw) / 1e6, "fetch_s": statistics.median(fetch),
                               "parse_s": statistics.median(parse)}

            modes = {"s3, one part at a time": (s3, md, 1), f"s3, {readers} at once": (s3, md, readers),
                     "local disk": (local, md_local, readers)}
            for storage, m, width in modes.values():  # untimed: connections opened, caches warm
                timed_load(storage, m, job, rank, written, width, server)
            times: dict[str, list[dict[str, Any]]] = {name: [] for name in modes}
            seen: dict[str, dict[str, Any]] = {}
            names = list(modes)
            for r in range(repeats):
                for name in names[r % len(names):] + names[: r % len(names)]:
                    storage, m, width = modes[name]
                    took, what = timed_load(storage, m, job, rank, written, width, server)
                    times[name].append(took)
                    assert seen.setdefault(name, what) == what, (name, what, seen[name])
                    server_s = "" if took["server_cpu_s"] is None else f", {took['server_cpu_s']:.2f} s server"
                    print(f"repeat {r} {name:24s} {took['s']:7.3f} s, CPU {took['client_cpu_s']:.2f} s here"
                          f"{server_s}", flush=True)
            rows = {(w["rows"], w["segments"], w["parts_read"], w["part_bytes"]) for w in seen.values()}
            assert len(rows) == 1, f"the loads read different rows: {seen}"
            out["loads"] = {name: {**summary(ts), **seen[name]} for name, ts in times.items()}
            serial, wide = (out["loads"][n]["s"] for n in names[:2])
            out["serial_over_concurrent"] = serial / wide
        finally:
            server.stop()
    return out


def table(res: dict[str, Any]) -> str:
    md = res["metadata"]
    lines = ["| load of the middle rank (`read_parts` + `plan_load`) | median s | CPU s: client, server "
             "| a part's read: median, p90 ms (over 30 ms) | parts read | part bytes | directory bytes | rows |",
             "|---|---|---|---|---|---|---|---|"]
    for name, v in res["loads"].items():
        server = "" if v["server_cpu_s"] is None else f", {v['server_cpu_s']:.2f}"
        w = v["part_read_ms"]
        wait = "" if w is None else f"{w['p50']:.1f}, {w['p90']:.1f} ({100 * w['over_30ms_share']:.0f}%)"
        lines.append(f"| {name} | {v['s']:.3f} | {v['client_cpu_s']:.2f}{server} | {wait} | {v['parts_read']:,} "
                     f"| {v['part_bytes']:,} | {v['directory_bytes']:,} | {v['rows']:,} |")
    lines.append(f"\none at a time / {res['readers']} at once: {res['serial_over_concurrent']:.2f}x "
                 f"(the S3 backend's requests in flight: at most {res['max_concurrency']}); "
                 f"metadata.json {md['mb']:.1f} MB: fetched from S3 in {md['fetch_s']:.3f} s, "
                 f"parsed in {md['parse_s']:.3f} s; upload of {res['upload']['files']:,} files, "
                 f"{res['upload']['mb']:.1f} MB in {res['upload']['s']:.1f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=131072, help="simulated world size (MoE, EP 64)")
    p.add_argument("--server", choices=["ceph", "moto"], default="ceph")
    p.add_argument("--osd-store", choices=["bluestore", "memstore"], default="bluestore", help="Ceph's OSD store")
    p.add_argument("--tcp-nodelay", action="store_true",
                   help="Ceph's RGW with Nagle's algorithm off (beast's tcp_nodelay=1; its default is 0)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--readers", type=int, default=parts_fetch.PART_READERS, help="parts read at once (against 1)")
    p.add_argument("--max-concurrency", type=int, help="the S3 backend's requests in flight (default: its own, 8)")
    p.add_argument("--upload-width", type=int, default=16, help="files uploaded at once")
    p.add_argument("--max-parts", type=int, default=3000, help="most real parts written for the reader")
    p.add_argument("--out", help="write the results here as JSON")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.readers < 2:
        p.error("--repeats must be at least 1 and --readers at least 2")
    res = run(args.world, args.server, args.repeats, args.readers, args.osd_store, args.max_parts, args.upload_width,
              args.max_concurrency, args.tcp_nodelay)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    print(table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
