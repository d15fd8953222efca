"""``bytecp monitor ...``: serve the collector, list checkpoints, show one.

The core's CLI (``bytecp.cli``) hands ``bytecp monitor <args>`` to
:func:`main`. Subcommands:

``serve``  run the collector (gRPC for ranks, /metrics for Prometheus).
``ls``     checkpoints a collector knows, newest first.
``show``   the per-rank, per-phase table of one checkpoint, from a collector
           (``--collector``) or from the reports stored beside the checkpoint
           (``<checkpoint>/reports/<rank>.json``); ``--png FILE`` also draws
           the timeline picture.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bytecp.errors import ConfigError
from bytecp.recorder import CheckpointReport

from ._channel import TOKEN_ENV
from .aggregate import CheckpointAggregate

__all__ = ["main", "load_stored_reports"]

log = logging.getLogger("bytecp.monitoring")


def _default_collector() -> str:
    from .server import DEFAULT_GRPC_ADDRESS

    return os.environ.get("BYTECP_MONITOR") or DEFAULT_GRPC_ADDRESS


def _token(args: argparse.Namespace) -> str | None:
    if getattr(args, "token_file", None):
        return Path(args.token_file).read_text().strip()
    return args.token or os.environ.get(TOKEN_ENV) or None


def load_stored_reports(url: str, storage_options: dict[str, Any] | None = None) -> CheckpointAggregate:
    """The reports every rank stored beside a committed checkpoint."""
    from bytecp.storage_api import open_storage

    storage = open_storage(url, **(storage_options or {}))
    try:
        names = sorted(p for p in storage.list_files("reports") if p.endswith(".json"))

        def read(path: str) -> CheckpointReport:
            return CheckpointReport.from_json(json.loads(storage.read_bytes(path)))

        # one small file per rank: read them in parallel (thousands of GETs on object stores)
        with ThreadPoolExecutor(max_workers=min(32, max(1, len(names)))) as pool:
            reports = list(pool.map(read, names))
    finally:
        storage.close()
    if not reports:
        raise FileNotFoundError(
            f"no reports stored at {url.rstrip('/')}/reports/ (is it a checkpoint saved by bytecp? "
            "or ask a collector with --collector HOST:PORT)"
        )
    return CheckpointAggregate.from_reports(reports)


def _serve(args: argparse.Namespace) -> int:
    from .server import CollectorServer

    cert = Path(args.tls_cert).read_bytes() if args.tls_cert else None
    key = Path(args.tls_key).read_bytes() if args.tls_key else None
    server = CollectorServer(
        args.grpc,
        None if args.metrics in ("", "none") else args.metrics,
        token=_token(args),
        tls_cert=cert,
        tls_key=key,
        allow_unauthenticated=args.allow_unauthenticated,
        complete_after=args.complete_after,
        keep=args.keep,
    ).start()
    # print the bound addresses (useful with port 0), then serve until a signal
    print(f"grpc {server.grpc_port} metrics {server.metrics_port}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    try:
        server.wait()
    except KeyboardInterrupt:
        server.stop()
    return 0


def _ls(args: argparse.Namespace) -> int:
    from .client import CollectorClient
    from .table import format_size

    with CollectorClient(args.collector, token=_token(args)) as client:
        items = client.list(args.job, args.operation, args.limit)
    if not items:
        print("no checkpoints known to the collector")
        return 0
    for s in items:
        step = s.step if s.HasField("step") else "-"
        st = f"rank {s.straggler.rank} {s.straggler.phase}" if s.HasField("straggler") and s.world_size > 1 else "-"
        print(
            f"{s.job}\t{s.operation}\tstep {step}\t{s.ranks_reported}/{s.world_size} ranks\t"
            f"{'ok' if s.ok else 'FAILED'}\t{s.ended - s.started:.3f}s\tstall {s.max_stall_seconds:.3f}s\t"
            f"{format_size(s.nbytes)}\tstraggler {st}\t{s.checkpoint_id}"
        )
    return 0


def _show(args: argparse.Namespace) -> int:
    from .table import format_table

    if args.collector:
        from .client import CollectorClient

        with CollectorClient(args.collector, token=_token(args)) as client:
            agg = client.get(args.checkpoint, args.job, args.operation)
    else:
        from bytecp.cli import _json_options

        agg = load_stored_reports(args.checkpoint, _json_options(args.storage_options, "--storage-options"))
    if args.json:
        print(json.dumps([r.to_json() for r in agg.ranked()], indent=1))
    else:
        print(format_table(agg))
    if args.png:
        from .timeline import render_timeline

        layout = render_timeline(agg, args.png)
        print(f"timeline written to {args.png} ({layout.width}x{layout.height})", file=sys.stderr)
    return 0


def _parser() -> argparse.ArgumentParser:
    from .server import DEFAULT_GRPC_ADDRESS, DEFAULT_METRICS_ADDRESS

    p = argparse.ArgumentParser(prog="bytecp monitor", description="bytecp checkpoint monitoring")
    p.add_argument("--log-level", default="INFO")
    sub = p.add_subparsers(dest="command", required=True)

    def auth(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--token", help=f"shared token (default ${TOKEN_ENV})")
        sp.add_argument("--token-file", help="read the shared token from this file")

    s = sub.add_parser("serve", help="run the collector ranks push reports to")
    s.add_argument("--grpc", default=DEFAULT_GRPC_ADDRESS, help="host:port for ranks' reports (default %(default)s)")
    s.add_argument(
        "--metrics",
        default=DEFAULT_METRICS_ADDRESS,
        help="host:port of the Prometheus /metrics endpoint, 'none' to disable (default %(default)s)",
    )
    auth(s)
    s.add_argument("--tls-cert", help="PEM certificate chain (TLS)")
    s.add_argument("--tls-key", help="PEM private key (TLS)")
    s.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve a non-loopback address without a token (trusted networks only)",
    )
    s.add_argument(
        "--complete-after",
        type=float,
        default=120.0,
        help="seconds after a checkpoint's first report to stop waiting for missing ranks",
    )
    s.add_argument("--keep", type=int, default=1000, help="checkpoints kept in memory")
    s.set_defaults(func=_serve)

    ls = sub.add_parser("ls", help="checkpoints a collector knows, newest first")
    ls.add_argument("--collector", default=_default_collector(), help="host:port (default $BYTECP_MONITOR or %(default)s)")
    ls.add_argument("--job", default="")
    ls.add_argument("--operation", default="", choices=("", "save", "load"))
    ls.add_argument("--limit", type=int, default=20)
    auth(ls)
    ls.set_defaults(func=_ls)

    sh = sub.add_parser("show", help="per-rank, per-phase table of one checkpoint (and a timeline PNG)")
    sh.add_argument("checkpoint", help="checkpoint URL (reads its stored reports) or, with --collector, a URL or id")
    sh.add_argument("--collector", default=None, help="ask this collector (host:port) instead of storage")
    sh.add_argument("--job", default="")
    sh.add_argument(
        "--operation", default="save", choices=("save", "load"), help="with --collector: which operation (default %(default)s)"
    )
    sh.add_argument("--png", help="write the timeline picture to this PNG file")
    sh.add_argument("--json", action="store_true", help="print the raw per-rank reports as JSON")
    sh.add_argument("--storage-options", default=None,
                    help="the checkpoint's storage options as a JSON object (as for the other commands)")
    auth(sh)
    sh.set_defaults(func=_show)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``bytecp monitor``; returns the exit status."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args.func(args))
    except (Exception, KeyboardInterrupt) as e:  # the exit codes of every bytecp command (bytecp.cli)
        from bytecp.cli import EXIT_INTERNAL, EXIT_STORAGE, EXIT_USAGE, exit_code

        try:
            import grpc
        except ImportError:  # pragma: no cover - grpcio is part of the monitoring extra
            grpc = None
        if grpc is not None and isinstance(e, grpc.RpcError) and isinstance(e, grpc.Call):
            print(f"bytecp monitor: collector said {e.code().name}: {e.details()}", file=sys.stderr)
            unreachable = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            return EXIT_STORAGE if unreachable else EXIT_USAGE
        code = EXIT_USAGE if isinstance(e, FileNotFoundError | ConfigError) else exit_code(e)
        if code == EXIT_INTERNAL:
            raise
        print(f"bytecp monitor: {e or type(e).__name__}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
