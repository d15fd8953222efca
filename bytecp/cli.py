"""The ``bytecp`` command: demo, inspect, verify, ls, gc, export, monitor.

``monitor`` lives outside the core (``bytecp.monitoring``) and is reached
through the subcommand registry below (imported only when used). The
benchmarks ship with the source tree, not the package: ``make bench``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from collections.abc import Sequence
from typing import Any

from .errors import BytecpError
from .storage_api import open_storage

__all__ = ["main"]

# subcommand -> "module:function(argv) -> int", for commands outside the core
_EXTERNAL = {
    "monitor": ("bytecp.monitoring.cli:main", "per-rank checkpoint monitoring (serve, show)"),
}


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _storage_options(args: argparse.Namespace) -> dict[str, Any]:
    return json.loads(args.storage_options) if getattr(args, "storage_options", None) else {}


def cmd_inspect(args: argparse.Namespace) -> int:
    from .inspect import summarize

    info = summarize(open_storage(args.url, **_storage_options(args)))
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    t = info["totals"]
    print(f"checkpoint   {info['url']}")
    print(f"format       v{info['format_version']} (bytecp {info['bytecp_version']}), save {info['save_id']}, {info['created']}")
    print(f"saved by     {info['framework']}, world size {info['world_size']}, parallelism {json.dumps(info['parallelism'])}")
    print(f"step         {info['step']}")
    if info["user_metadata"]:
        print(f"metadata     {json.dumps(info['user_metadata'])}")
    print()
    rows = [(fqn, p["dtype"], "x".join(map(str, p["shape"])) or "scalar", _human(p["nbytes"]), str(p["chunks"]))
            for fqn, p in info["tensors"].items()]
    head = ("tensor", "dtype", "shape", "size", "chunks")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(5)]
    for r in [head, *rows]:
        print("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))
    if info["objects"]:
        print()
        print("objects: " + ", ".join(f"{k} ({v})" for k, v in info["objects"].items()))
    if info["per_rank_objects"]:
        print("per-rank objects: " + ", ".join(f"{k} (ranks {v})" for k, v in info["per_rank_objects"].items()))
    print()
    print(f"total        {t['tensors']} tensors, {_human(t['tensor_bytes'])} in {t['chunks']} chunks, "
          f"{t['data_files']} data files ({_human(t['data_file_bytes'])})")
    per_rank = ", ".join(f"rank {r}: {_human(b)}" for r, b in t["bytes_written_per_rank"].items())
    print(f"written      {per_rank}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from .inspect import verify

    nbytes, problems = verify(open_storage(args.url, **_storage_options(args)))
    for p in problems:
        print(f"FAIL {p}", file=sys.stderr)
    if problems:
        print(f"{args.url}: {len(problems)} problem(s) found", file=sys.stderr)
        return 1
    print(f"{args.url}: OK, {_human(nbytes)} checked")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    from .manager import list_checkpoints

    for c in list_checkpoints(args.url, storage_options=_storage_options(args)):
        print(f"{c.name}\tstep={c.step}\t{c.created}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from .export import export_safetensors, export_torch

    fn = export_safetensors if args.format == "safetensors" else export_torch
    n = fn(open_storage(args.url, **_storage_options(args)), args.out, prefix=args.prefix,
           strip_prefix=not args.keep_prefix)
    print(f"wrote {args.out} ({_human(n)})")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from .gc import collect_garbage

    res = collect_garbage(open_storage(args.url, **_storage_options(args)), dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for p in res.removed:
        print(f"{verb} {p}")
    if res.kept_newer:
        print(f"kept {len(res.kept_newer)} file(s) of saves newer than the committed one (maybe still running)")
    print(f"{args.url}: {verb} {len(res.removed)} unreferenced file(s)")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args.out)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _EXTERNAL:
        module, _, fn = _EXTERNAL[argv[0]][0].partition(":")
        return int(getattr(importlib.import_module(module), fn)(argv[1:]) or 0)

    p = argparse.ArgumentParser(prog="bytecp", description="Checkpoints for distributed PyTorch training.")
    sub = p.add_subparsers(dest="cmd", required=True)

    def url_cmd(name: str, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help)
        sp.add_argument("url", help="checkpoint URL (path, s3://, hdfs://, memory://, any fsspec URL)")
        sp.add_argument("--storage-options", help="JSON dict of backend options (endpoint_url=...)")
        return sp

    sp = url_cmd("inspect", "tensors, shapes, dtypes, sizes, chunks, framework and world size")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.set_defaults(fn=cmd_inspect)
    url_cmd("verify", "read every chunk and check its crc32c").set_defaults(fn=cmd_verify)
    url_cmd("ls", "committed checkpoints below a run directory").set_defaults(fn=cmd_ls)
    sp = url_cmd("gc", "remove files of failed saves that the committed checkpoint does not reference")
    sp.add_argument("--dry-run", action="store_true", help="list what would be removed")
    sp.set_defaults(fn=cmd_gc)
    sp = url_cmd("export", "write full tensors to one safetensors file or torch state dict (streamed)")
    sp.add_argument("out", help="output file")
    sp.add_argument("--format", choices=["safetensors", "torch"], default="safetensors")
    sp.add_argument("--prefix", default="model.", help="export tensors whose FQN starts with this ('' for all)")
    sp.add_argument("--keep-prefix", action="store_true", help="keep the prefix in the exported names")
    sp.set_defaults(fn=cmd_export)
    sp = sub.add_parser("demo", help="a training job's life: a killed rank, elastic restarts, export, evaluation")
    sp.add_argument("--out", default="demo-out", help="directory for the demo's checkpoints, logs and summary.json")
    sp.set_defaults(fn=cmd_demo)
    for name, (_, help) in _EXTERNAL.items():
        sub.add_parser(name, help=help, add_help=False)

    args = p.parse_args(argv)
    try:
        return int(args.fn(args))
    except BytecpError as e:
        print(f"bytecp {args.cmd}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
