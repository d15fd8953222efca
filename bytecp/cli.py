"""The ``bytecp`` command: demo, inspect, verify, ls, gc, export, monitor.

``monitor`` lives outside the core (``bytecp.monitoring``) and is reached
through the subcommand registry below (imported only when used). The
benchmarks ship with the source tree, not the package: ``make bench``.

Every command follows the same exit codes (docs/operations.md, "Command line"):
0 success; 1 the command ran and found problems (``verify``); 2 a usage
error or a checkpoint that cannot be used (bad arguments, not a checkpoint,
corrupt or too new, an output that exists); 3 a storage error (unreachable,
permission denied, missing bucket, no space); 70 an internal error (a bug:
the traceback is printed); 130 interrupted; 141 stdout was closed by its
reader (``| head``), nothing printed. Errors are one line on stderr;
with ``--json`` the command also prints ``{"error": ..., "exit_code": ...}`` on
stdout. Progress bars (``verify``, ``export``, ``gc``) go to stderr, if a terminal.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import sys
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from bytecp.errors import BytecpError, ConfigError, CorruptCheckpointError, StorageError
from bytecp.interop import WRITERS
from bytecp.storage_api import Storage, open_storage, split_protocol

if TYPE_CHECKING:
    from bytecp.tools.progress import Progress

__all__ = ["main", "exit_code", "EXIT_OK", "EXIT_PROBLEMS", "EXIT_USAGE", "EXIT_STORAGE", "EXIT_INTERNAL",
           "EXIT_INTERRUPTED", "EXIT_CLOSED_PIPE"]

EXIT_OK = 0
EXIT_PROBLEMS = 1  # the command ran and found problems (verify)
EXIT_USAGE = 2  # bad arguments, or a checkpoint/output that cannot be used as asked
EXIT_STORAGE = 3  # the storage failed: unreachable, permission denied, missing bucket, no space
EXIT_INTERNAL = 70  # a bug (EX_SOFTWARE): the traceback is printed
EXIT_INTERRUPTED = 130
EXIT_CLOSED_PIPE = 141  # 128 + SIGPIPE: stdout's reader went away (``| head``); nothing is printed

# subcommand -> "module:function(argv) -> int", for commands outside the core
_EXTERNAL = {
    "monitor": ("bytecp.monitoring.cli:main", "per-rank checkpoint monitoring (serve, show)"),
    "keeper": ("bytecp.storage.keeper_server:main", "a host's memory-tier keeper (keeper:// checkpoints)"),
    "follow": ("bytecp.serving.cli:main", "one line per newly committed checkpoint of a run (--json)"),
}


def exit_code(e: BaseException) -> int:
    """The exit code for an exception that ended a command."""
    if isinstance(e, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(e, StorageError):
        return EXIT_STORAGE
    if isinstance(e, BytecpError):
        return EXIT_USAGE
    if isinstance(e, OSError):
        return EXIT_STORAGE
    return EXIT_INTERNAL


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _json_options(text: str | None, flag: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        opts = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"{flag}: not valid JSON ({e}); pass a JSON object such as '{{\"endpoint_url\": ...}}'") from e
    if not isinstance(opts, dict):
        raise ConfigError(f"{flag}: pass a JSON object, not {type(opts).__name__}")
    return opts


def _storage_options(args: argparse.Namespace) -> dict[str, Any]:
    return _json_options(getattr(args, "storage_options", None), "--storage-options")


def _checkpoint(args: argparse.Namespace) -> Storage:
    """The checkpoint at ``args.url``, or the one-line reason it is not one,
    found before the readers (and torch) are imported: a wrong path costs a
    look at its top level, never a listing of the tree below it."""
    from bytecp.errors import StorageNotFoundError
    from bytecp.loading.diagnose import not_a_checkpoint

    storage = open_storage(args.url, **_storage_options(args))
    if not storage.exists("metadata.json"):
        from bytecp.interop import find_source

        # a DCP or DeepSpeed folder...: read as a source (nothing there: no reader, nor torch, imported)
        if storage.list_children("") and find_source(storage) is not None:
            return storage
        missing = StorageNotFoundError(f"{storage.url}: no metadata.json")
        raise not_a_checkpoint(storage, missing)
    return storage


def cmd_inspect(args: argparse.Namespace) -> int:
    storage = _checkpoint(args)
    from bytecp.tools.inspect import summarize

    info = summarize(storage)
    if args.json:
        print(json.dumps(info, indent=2))
        return EXIT_OK
    t = info["totals"]
    print(f"checkpoint   {info['url']}")
    print(f"format       bytecp v{info['format_version']} (bytecp {info['bytecp_version']}), save {info['save_id']}, "
          f"{info['created']}" if info["format"] == "bytecp" else
          f"format       {info['format']} (read as a source, no conversion; no checksums), save {info['save_id']}")
    print(f"saved by     {info['framework']}, world size {info['world_size']}, parallelism {json.dumps(info['parallelism'])}")
    print(f"step         {info['step']}")
    for fqn, pos in info["data"].items():  # data loaders' positions (bytecp.data)
        print(f"data         {fqn}: {pos['text']}")
    if info["user_metadata"]:
        print(f"metadata     {json.dumps(info['user_metadata'])}")
    print()
    if args.tensors:
        rows: list[tuple[str, ...]] = [
            (fqn, p["dtype"], "x".join(map(str, p["shape"])) or "scalar", _human(p["nbytes"]), str(p["chunks"]))
            for fqn, p in info["tensors"].items()]
        _table(("tensor", "dtype", "shape", "size", "chunks"), rows, left=3)
    else:
        groups: dict[str, list[Any]] = {}
        for fqn, p in info["tensors"].items():
            g = groups.setdefault(fqn.split(".", 1)[0], [0, 0, set()])
            g[0] += 1
            g[1] += p["nbytes"]
            g[2].add(p["dtype"])
        rows = [(k, str(n), _human(b), ", ".join(sorted(d))) for k, (n, b, d) in groups.items()]
        _table(("group", "tensors", "size", "dtypes"), rows, left=1)
        print("(--tensors lists every tensor)")
    if info["objects"]:
        print()
        print("objects: " + ", ".join(f"{k} ({v})" for k, v in info["objects"].items()))
    if info["per_rank_objects"]:
        print("per-rank objects: " + ", ".join(f"{k} (ranks {v})" for k, v in info["per_rank_objects"].items()))
    print()
    print(f"total        {t['tensors']} tensors, {_human(t['tensor_bytes'])} in {t['chunks']} chunks, "
          f"{t['data_files']} data files ({_human(t['data_file_bytes'])})")
    if info["format"] == "bytecp":
        print("written      " + ", ".join(f"rank {r}: {_human(b)}" for r, b in t["bytes_written_per_rank"].items()))
    for name, ref in info["references"].items():
        print(f"references   {name} (save {ref['save_id']}): {ref['files']} data files, {_human(ref['bytes'])}")
    return EXIT_OK


def _table(head: tuple[str, ...], rows: Sequence[tuple[str, ...]], left: int) -> None:
    """Columns padded to their widest cell; the first ``left`` aligned left."""
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print("  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))


def _bar(args: argparse.Namespace, desc: str, unit: str = "B") -> Progress:
    from bytecp.tools.progress import terminal_bar

    return terminal_bar(desc, unit, enabled=False if args.no_progress else None)


def cmd_verify(args: argparse.Namespace) -> int:
    storage = _checkpoint(args)
    from bytecp.tools.inspect import verify_any
    from bytecp.tools.verify_source import NO_CHECKSUMS

    bar = _bar(args, "verify")
    try:
        fmt, nbytes, problems = verify_any(storage, progress=bar)
    finally:
        bar.close()
    if args.json:
        print(json.dumps({"url": args.url, "format": fmt, "checksums": fmt == "bytecp", "ok": not problems,
                          "bytes_checked": nbytes, "problems": [dataclasses.asdict(p) for p in problems]}, indent=2))
    sys.stderr.writelines(f"FAIL {p}\n" for p in problems)
    if problems:
        print(f"{args.url}: {len(problems)} problem(s) found", file=sys.stderr)
        return EXIT_PROBLEMS
    if not args.json:
        print(f"{args.url}: OK, {_human(nbytes)} checked" if fmt == "bytecp" else
              f"{args.url}: OK ({fmt}; {NO_CHECKSUMS}: every file, item and byte range of {_human(nbytes)})")
    return EXIT_OK


def cmd_ls(args: argparse.Namespace) -> int:
    """The run's checkpoints, and which one a resume takes (:mod:`bytecp.tools.resume`)."""
    from bytecp.catalog import list_bases
    from bytecp.tools.resume import decide

    options = _storage_options(args)
    decision = decide(args.url, options)
    found = list(decision.checkpoints)
    if not found and decision.blocker is None:
        from bytecp.loading.diagnose import nothing_to_list

        raise nothing_to_list(open_storage(args.url, **options))
    pick, unreadable = _resume_pick(found, options) if decision.blocker is None else (None, {})
    if args.json:
        print(json.dumps([{**dataclasses.asdict(c), "resume": c.url == pick,
                           **({"unreadable": unreadable[c.url]} if c.url in unreadable else {})} for c in found],
                         indent=2))
    else:
        for c in found:
            refs = f"\treferences={','.join(c.references)}" if c.references else ""
            kind = f"\tformat={c.format}" if c.format != "bytecp" else ""
            mark = "\t<- resume" if c.url == pick else ""
            if c.url in unreadable:
                mark = f"\t(resume skips it: {unreadable[c.url]})"
            print(f"{c.name}\tstep={c.step}\t{c.created or '-'}{refs}{kind}{mark}")
        for name in list_bases(args.url, storage_options=options):
            print(f"{name}\t(retired: kept for the files newer checkpoints reference)")
        for url, why in decision.passed_over:
            print(f"{url.rstrip('/').rsplit('/', 1)[-1]}\t(no checkpoint: {why})")
    decision.check()  # undecided: the reason, on stderr, and a non-zero exit
    return EXIT_OK


def _resume_pick(found: list[Any], options: dict[str, Any]) -> tuple[str | None, dict[str, str]]:
    """(``bytecp ls``) The checkpoint a resume loads, as far as metadata
    tells: the newest whose ``metadata.json`` reads whole (a resume skips
    the others, :meth:`~bytecp.CheckpointManager.restore`); the skipped ones
    with why. Data is not read (``bytecp verify`` does)."""
    from bytecp.catalog import one_line
    from bytecp.format import metadata as fmt

    skipped: dict[str, str] = {}
    for c in reversed(found):
        if c.format != "bytecp":
            return c.url, skipped
        try:  # (the format alone: ls imports no torch)
            fmt.Metadata.from_bytes(fmt.read_metadata(open_storage(c.url, **options)), c.url)
        except CorruptCheckpointError as e:
            skipped[c.url] = one_line(e)
            continue
        return c.url, skipped
    return None, skipped


def _export_format(args: argparse.Namespace) -> str:
    if args.format:
        return str(args.format)
    out = args.out.rstrip("/").lower()
    if out.endswith(".safetensors"):
        return "safetensors"
    return "torch" if out.endswith((".pt", ".pth")) else "hf"


def _out_options(args: argparse.Namespace) -> dict[str, Any]:
    """``--out-storage-options``; by default the input's options when both URLs share a protocol."""
    if args.out_storage_options:
        return _json_options(args.out_storage_options, "--out-storage-options")
    same = split_protocol(args.url)[0] == split_protocol(args.out)[0]
    return _storage_options(args) if same else {}


def cmd_export(args: argparse.Namespace) -> int:
    from bytecp.interop import writer

    fmt = _export_format(args)
    prefix = args.prefix if args.prefix is not None else ("" if fmt == "dcp" else None)  # None: the source's
    common: dict[str, Any] = dict(prefix=prefix, strip_prefix=not args.keep_prefix, dtype=args.dtype,
                                  overwrite=args.overwrite, out_options=_out_options(args),
                                  **({"masters": True} if args.masters and fmt != "dcp" else {}))
    if fmt != "hf" and (args.config or args.max_shard_size or args.workers != 1 or args.spec) or \
            fmt == "dcp" and args.masters:
        raise ConfigError("--config, --max-shard-size, --spec and --workers belong to the Hugging Face layout, "
                          f"--masters to the safetensors ones; drop them or --format {fmt} (OUT a directory)")
    storage = open_storage(args.url, **_storage_options(args))
    bar = _bar(args, "export")
    try:
        if fmt == "hf":
            common.update(max_shard_size=args.max_shard_size, config=args.config, workers=args.workers,
                          spec=args.spec)
        res = writer(fmt)(storage, args.out, progress=bar, **common)
    finally:
        bar.close()
    if args.json:
        print(json.dumps(res.to_json(), indent=2))
        return EXIT_OK
    what = dict(hf="Hugging Face layout", torch="torch state dict", dcp="torch.distributed.checkpoint").get(fmt, fmt)
    print(f"wrote {res.out} ({what}: {res.tensors} tensors, {_human(res.tensor_bytes)} in {len(res.files)} file(s))")
    if fmt == "hf":
        print(f"  files: {', '.join(res.files)}")
        print(f"  config.json: {res.config}" if res.config and res.config.startswith("kept") else
              f"  config.json from {res.config}" if res.config else
              "  no config.json: pass --config FILE (or save with metadata={'hf_config': config.to_dict()}) "
              "before from_pretrained")
    if res.omitted_aliases:
        print(f"  tied tensors written once (aliases left out): {', '.join(res.omitted_aliases)}")
    return EXIT_OK


def cmd_gc(args: argparse.Namespace) -> int:
    from bytecp.tools.gc import collect_garbage

    bar = _bar(args, "gc", "files")
    try:
        res = collect_garbage(open_storage(args.url, **_storage_options(args)), dry_run=args.dry_run, progress=bar)
    finally:
        bar.close()
    if args.json:
        print(json.dumps({"url": args.url, "dry_run": args.dry_run, **dataclasses.asdict(res)}, indent=2))
        return EXIT_OK
    verb = "would remove" if args.dry_run else "removed"
    for p in res.removed:
        print(f"{verb} {p}")
    if res.kept_newer:
        print(f"kept {len(res.kept_newer)} file(s) of saves that may still be running (a live lease, or "
              "started less than a lease term ago)")
    print(f"{args.url}: {verb} {len(res.removed)} file(s) of saves that never committed")
    for where, why in res.skipped:
        print(f"bytecp gc: left {where} untouched: {why}; `bytecp verify` it, then delete it or move it out "
              "of the run if it is unwanted", file=sys.stderr)
    return EXIT_OK


def cmd_materialize(args: argparse.Namespace) -> int:
    from bytecp.tools.materialize import materialize

    bar = _bar(args, "materialize")
    try:
        md = materialize(open_storage(args.url, **_storage_options(args)), open_storage(args.out, **_out_options(args)),
                         overwrite=args.overwrite, progress=bar)
    finally:
        bar.close()
    if args.json:
        print(json.dumps({"url": args.url, "out": args.out, "save_id": md.save_id,
                          "data_files": len(md.data_files), "bytes": sum(md.data_files.values())}))
    else:
        print(f"{args.out}: self-contained copy of {args.url} ({len(md.data_files)} data files, "
              f"{_human(sum(md.data_files.values()))})")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from bytecp.demo import run_demo

    return run_demo(args.out)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bytecp", description="Checkpoints for distributed PyTorch training.",
        epilog="exit codes: 0 ok, 1 problems found, 2 usage or checkpoint error, 3 storage error, "
               "70 internal error, 130 interrupted, 141 stdout closed by its reader")
    sub = p.add_subparsers(dest="cmd", required=True)

    def url_cmd(name: str, help: str, *, progress: bool = False) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help)
        sp.add_argument("url", help="checkpoint URL (path, s3://, hdfs://, memory://, any fsspec URL)")
        sp.add_argument("--storage-options", help="JSON dict of backend options (endpoint_url=...)")
        sp.add_argument("--json", action="store_true", help="machine-readable output on stdout")
        if progress:
            sp.add_argument("--no-progress", action="store_true",
                            help="no progress bar (it is shown only when stderr is a terminal)")
        return sp

    sp = url_cmd("inspect", "what a checkpoint holds: framework, world size, step, tensor groups, sizes")
    sp.add_argument("--tensors", action="store_true", help="list every tensor (dtype, shape, size, chunks)")
    sp.set_defaults(fn=cmd_inspect)
    url_cmd("verify", "read every chunk and check its crc32c; a source: its structure (exit 1 if any problem)",
            progress=True).set_defaults(fn=cmd_verify)
    url_cmd("ls", "committed checkpoints below a run directory").set_defaults(fn=cmd_ls)
    sp = url_cmd("gc", "remove files of saves that never committed (killed or failed) and cannot be running; "
                 "URL: a checkpoint, an uncommitted save's directory or a run directory", progress=True)
    sp.add_argument("--dry-run", action="store_true", help="list what would be removed")
    sp.set_defaults(fn=cmd_gc)
    sp = url_cmd("export", "full tensors of a checkpoint or source in the Hugging Face layout, one safetensors "
                 "file, a torch state dict or DCP; streamed", progress=True)
    sp.add_argument("out", help="output directory (Hugging Face layout), or a file ending in .safetensors / .pt; "
                    "any URL bytecp writes")
    sp.add_argument("--format", choices=list(WRITERS),
                    help="default: hf, or safetensors/torch when OUT ends in .safetensors/.pt/.pth. torch holds "
                         "every exported tensor in memory at once (torch.save needs them together); the others "
                         "hold about one tensor")
    sp.add_argument("--prefix", help="export tensors whose name starts with this key (default 'model'; a DCP "
                    "checkpoint without it: the top level less optimizer/scheduler/dataloader state; a Hugging Face "
                    "directory and --format dcp: ''); '' for all")
    sp.add_argument("--masters", action="store_true", help="the fp32 master weights in place of a bf16/fp16 "
                    "model's (DeepSpeed's optimizer.state.<name>.fp32, as zero_to_fp32 writes them)")
    sp.add_argument("--keep-prefix", action="store_true", help="keep the prefix in the exported names")
    sp.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="cast floating tensors")
    sp.add_argument("--max-shard-size", help="largest shard, e.g. 5GB, 500MB, 2GiB (default 5GB, as huggingface_hub)")
    sp.add_argument("--config", help="JSON file written as config.json (default: the hf_config saved with the "
                    "checkpoint, if any)")
    sp.add_argument("--spec", help="convert through this mapping spec first (gpt2, llama, qwen2, mixtral: a "
                    "Megatron GPTModel as that transformers class); default: detected for a Megatron checkpoint "
                    "from the config's model_type; 'none' never converts")
    sp.add_argument("--overwrite", action="store_true", help="replace an existing output")
    sp.add_argument("--workers", type=int, default=1,
                    help="processes writing disjoint shards in parallel (Hugging Face layout; default 1)")
    sp.add_argument("--out-storage-options", help="JSON dict of the output's backend options (default: "
                    "--storage-options when both URLs have the same protocol)")
    sp.set_defaults(fn=cmd_export)
    sp = url_cmd("materialize", "a self-contained copy of a checkpoint: the bytes it references in other "
                 "checkpoints of the run copied in", progress=True)
    sp.add_argument("out", help="output checkpoint URL")
    sp.add_argument("--overwrite", action="store_true", help="replace a checkpoint at OUT")
    sp.add_argument("--out-storage-options", help="JSON dict of the output's backend options (default: "
                    "--storage-options when both URLs have the same protocol)")
    sp.set_defaults(fn=cmd_materialize)
    sp = sub.add_parser("demo", help="a training job's life: a killed rank, elastic restarts, export, evaluation")
    sp.add_argument("--out", default="demo-out", help="directory for the demo's checkpoints, logs and summary.json")
    sp.set_defaults(fn=cmd_demo)
    for name, (_, help) in _EXTERNAL.items():
        sub.add_parser(name, help=help, add_help=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit code (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _EXTERNAL:
        module, _, fn = _EXTERNAL[argv[0]][0].partition(":")
        try:
            entry = getattr(importlib.import_module(module), fn)
        except ModuleNotFoundError as e:  # an extra not installed: its one line (bytecp.plugins.missing_extra)
            print(f"bytecp {argv[0]}: {e}", file=sys.stderr)
            return EXIT_USAGE
        return int(entry(argv[1:]) or 0)
    args = _parser().parse_args(argv)  # usage errors exit 2 (argparse)
    try:
        code = int(args.fn(args))
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        return _closed_pipe()
    except (Exception, KeyboardInterrupt) as e:
        code = exit_code(e)
        if code == EXIT_INTERNAL:
            traceback.print_exc()
            msg = f"internal error ({type(e).__name__}: {e}); please report it with the traceback above"
        elif code == EXIT_INTERRUPTED:
            msg = "interrupted"
        else:
            msg = str(e) if isinstance(e, BytecpError) else f"{type(e).__name__}: {e}"
        print(f"bytecp {args.cmd}: {msg}", file=sys.stderr)
        if getattr(args, "json", False):
            print(json.dumps({"error": msg, "exit_code": code}))
        return code


def _closed_pipe() -> int:
    """The reader of stdout went away (``bytecp inspect CK | head -1``): end
    quietly, as a command killed by SIGPIPE does, with its code (141)."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # nothing more to flush at exit
    except (OSError, ValueError):
        pass
    return EXIT_CLOSED_PIPE


if __name__ == "__main__":
    sys.exit(main())
