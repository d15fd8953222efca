"""``bytecp export URL OUT_DIR``: the Hugging Face layout that ``from_pretrained`` reads.

The output is what ``save_pretrained`` writes: ``model.safetensors`` when
everything fits in one shard, else ``model-00001-of-0000N.safetensors`` ...
plus ``model.safetensors.index.json`` (``{"metadata": {"total_parameters",
"total_size"}, "weight_map": {name: file}}``, JSON with ``indent=2`` and
sorted keys); ``config.json`` when a config is known. Shards are cut as
huggingface_hub's ``split_torch_state_dict_into_shards`` cuts them: tensors
in saved order, a new shard when the next tensor would pass
``max_shard_size``, a larger tensor alone.

Called by the CLI and by user code, in one process; with ``workers > 1``
the shards are written by that many spawned processes (:func:`_write_shard`),
the commit staying here. Every shard is streamed (:mod:`bytecp.interop.export`:
about one tensor plus the write buffer in memory) through
``Storage.write_stream``. The commit:

- **filesystems** (``Storage.atomic_rename``): everything is written into a
  hidden sibling ``.<name>.bytecp-export-<id>/``, then renamed to OUT in one
  step (with ``overwrite``, an atomic exchange with the old directory, which
  is then deleted). Readers see the old output or the new one; a failed
  export removes its sibling and changes nothing;
- **object stores**: files are published in place, each atomically, the
  commit file last -- shards, then ``config.json``, then the index (one
  shard: ``config.json``, then ``model.safetensors``). Without the commit
  file there is nothing ``from_pretrained`` loads. An ``overwrite`` first
  deletes the old output's commit file, so the old output is withdrawn
  before any of its files is replaced: an interrupted overwrite leaves no
  loadable output, never a mix. After the commit, files of the old output
  that the new one lacks are deleted.

OUT may be a model directory already (``config.save_pretrained(OUT)``,
tokenizer files): the weights are written beside its files, which stay;
its ``config.json`` is replaced only by an explicit ``config``. An OUT that
holds the weights of an earlier export is refused without ``overwrite``;
``overwrite`` replaces those weights and never deletes any other file.
``generation_config.json`` and tokenizer files saved in the checkpoint's
metadata (:func:`companion_files`) are written where OUT lacks them.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bytecp.errors import CheckpointExistsError, ConfigError
from bytecp.format import metadata as fmt
from bytecp.interop.export import (
    CAST_DTYPES,
    ExportResult,
    ExportTensor,
    TensorReader,
    open_export,
    publish_renamed,
    refuse_nested,
    safetensors_header,
    safetensors_metadata,
    safetensors_pieces,
    select_tensors,
    split_url,
    staged_failure,
    staging_name,
)
from bytecp.interop.mapped_export import MappedReader, choose_spec
from bytecp.storage_api import Storage, open_storage
from bytecp.tools.progress import NO_PROGRESS, Progress

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE", "WEIGHTS_NAME", "INDEX_NAME", "CONFIG_NAME", "parse_size", "plan_shards",
    "shard_names", "index_json", "resolve_config", "export_hf", "companion_files",
]  # fmt: skip

#: huggingface_hub's default (``split_torch_state_dict_into_shards``); transformers 5's
#: ``save_pretrained`` defaults to "50GB"
DEFAULT_MAX_SHARD_SIZE = "5GB"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_size(size: int | str) -> int:
    """``"5GB"`` (decimal, as huggingface_hub), ``"500MiB"`` (binary), or bytes."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        m = _SIZE.fullmatch(str(size))
        if m is None:
            raise ConfigError(f"max_shard_size {size!r} is not a size such as 5GB, 500MB, 2GiB or 1000000")
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])
    if n < 1:
        raise ConfigError(f"max_shard_size must be at least 1 byte, got {size!r}")
    return n


def plan_shards(items: Sequence[ExportTensor], max_bytes: int) -> list[list[ExportTensor]]:
    """huggingface_hub's cut: in order, a new shard when the next tensor would
    pass ``max_bytes``; a tensor larger than ``max_bytes`` gets a shard of its own."""
    shards: list[list[ExportTensor]] = []
    cur: list[ExportTensor] = []
    size = 0
    for it in items:
        if it.nbytes > max_bytes:
            shards.append([it])
            continue
        if size + it.nbytes > max_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(it)
        size += it.nbytes
    if cur or not shards:
        shards.append(cur)
    return shards


def shard_names(n: int) -> list[str]:
    """``model.safetensors`` for one shard, else ``model-00001-of-0000N.safetensors``..."""
    if n == 1:
        return [WEIGHTS_NAME]
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def index_json(shards: Sequence[Sequence[ExportTensor]], names: Sequence[str]) -> bytes:
    """``model.safetensors.index.json`` as ``save_pretrained`` writes it
    (``total_parameters`` counts every exported tensor's elements, buffers included)."""
    items = [it for shard in shards for it in shard]
    index = {
        "metadata": {"total_parameters": sum(it.numel for it in items), "total_size": sum(it.nbytes for it in items)},
        "weight_map": {it.name: name for shard, name in zip(shards, names, strict=True) for it in shard},
    }
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()


def _config_from_state(md: fmt.Metadata, where: str) -> tuple[Any, str] | None:
    """An ``hf_config`` saved in the state (``{"hf_config": config.to_dict()}``, top level or nested)."""
    found = [(fqn, node) for fqn, node in md.skeleton.walk() if fqn == "hf_config" or fqn.endswith(".hf_config")]
    if not found:
        return None
    if len(found) > 1 and found[0][0] != "hf_config":
        raise ConfigError(f"{where}: several saved values are named hf_config ({', '.join(f for f, _ in found)}); "
                          "pass --config FILE to choose")
    fqn, node = found[0]

    def leaf(kind: str, name: str) -> Any:
        rec = md.objects.get(name) if kind == "obj" else None
        if rec is None or rec.is_blob:
            raise ConfigError(f"{where}: the saved {fqn!r} holds {name!r}, which is not JSON; save "
                              "config.to_dict() (plain JSON values) as hf_config, or pass --config FILE")
        return rec.json

    return node.build(leaf), f"the checkpoint's {fqn!r} value"


def resolve_config(md: fmt.Metadata, where: str, config: str | Path | dict[str, Any] | None,
                   dtype: str | None = None) -> tuple[bytes | None, str | None]:
    """``config.json``'s bytes and where they came from: ``config`` (a JSON
    file or a dict), else ``hf_config`` in the save's ``metadata=``, else an
    ``hf_config`` value saved in the state; ``(None, None)`` when none is known.
    With a ``dtype`` cast, the config's ``dtype`` (and ``torch_dtype``) say the
    new dtype, so ``from_pretrained(dtype="auto")`` picks it."""
    raw: bytes | None = None
    cfg: Any
    if isinstance(config, str | Path):
        try:
            raw = Path(config).read_bytes()
            cfg = json.loads(raw)
        except OSError as e:
            raise ConfigError(f"--config {config}: cannot read it ({e.strerror or e}); pass a JSON file") from e
        except ValueError as e:
            raise ConfigError(f"--config {config}: not valid JSON ({e})") from e
        source = str(config)
    elif config is not None:
        cfg, source = config, "the config argument"
    elif "hf_config" in md.user_metadata:
        cfg, source = md.user_metadata["hf_config"], "the checkpoint's metadata (hf_config)"
    else:
        found = _config_from_state(md, where)
        if found is None:
            return None, None
        cfg, source = found
    if not isinstance(cfg, dict):
        raise ConfigError(f"{source}: a Hugging Face config must be a JSON object, got {type(cfg).__name__}")
    if dtype is not None:
        cfg = dict(cfg, dtype=CAST_DTYPES[dtype])
        if "torch_dtype" in cfg:
            cfg["torch_dtype"] = CAST_DTYPES[dtype]
        raw = None
    if raw is None:
        raw = (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()
    return raw, source


@dataclasses.dataclass(frozen=True)
class _Shard:
    """One shard file to write: where (``out_url``/``path``, with its storage
    options) and what; picklable, for worker processes."""

    src_url: str
    src_options: dict[str, Any]
    out_url: str
    out_options: dict[str, Any]
    path: str
    header: bytes
    items: tuple[ExportTensor, ...]

    @property
    def size(self) -> int:
        return len(self.header) + sum(it.nbytes for it in self.items)


#: (worker process) the checkpoint each worker opened, by URL: read once per process
_OPENED: dict[str, tuple[Storage, TensorReader]] = {}


def _write_shard(shard: _Shard, reader: Any = None, progress: Progress = NO_PROGRESS,
                 target: Storage | None = None) -> int:
    """Write one shard (in this process, or in a worker of ``workers > 1``,
    which opens the checkpoint and the output from the shard's URLs)."""
    if reader is None:
        if shard.src_url not in _OPENED:
            opened = open_export(open_storage(shard.src_url, **shard.src_options))
            _OPENED[shard.src_url] = (opened.storage, TensorReader(opened))
        reader = _OPENED[shard.src_url][1]
    if target is None:
        target = open_storage(shard.out_url, **shard.out_options)
    return target.write_stream(shard.path, safetensors_pieces(shard.header, shard.items, reader, progress),
                               size_hint=shard.size)


def _write_parallel(shards: list[_Shard], workers: int, progress: Progress) -> list[int]:
    """Shards in ``workers`` spawned processes; on any failure every worker is
    stopped before the error is raised (so the caller's clean-up runs last)."""
    import multiprocessing as mp

    pool = mp.get_context("spawn").Pool(min(workers, len(shards)))
    try:
        sizes = []
        for shard, n in zip(shards, pool.imap(_write_shard, shards), strict=True):
            sizes.append(n)
            progress.advance(shard.size - len(shard.header))
        pool.close()
        pool.join()
        return sizes
    except BaseException:
        pool.terminate()
        pool.join()
        raise


def _write_all(target: Storage, base: str, files: list[tuple[str, Any]], reader: Any, workers: int,
               progress: Progress) -> dict[str, int]:
    """Write ``files`` (name, bytes or a :class:`_Shard`) below ``base``: the
    shards (in parallel with ``workers > 1``), then the small files, in order."""
    sizes: dict[str, int] = {}
    shards = [(n, f) for n, f in files if isinstance(f, _Shard)]
    rooted = [(n, dataclasses.replace(f, out_url=target.url, out_options=target.options(),
                                      path=f"{base}/{n}" if base else n)) for n, f in shards]
    if workers > 1 and len(rooted) > 1:
        sizes.update(zip([n for n, _ in rooted], _write_parallel([f for _, f in rooted], workers, progress),
                         strict=True))
    todo = dict(rooted)
    for name, what in files:
        path = f"{base}/{name}" if base else name
        if isinstance(what, bytes):
            target.commit(path, what)
            sizes[name] = len(what)
        elif name not in sizes:
            sizes[name] = _write_shard(todo[name], reader, progress, target)
    return sizes


def _publish_renamed(out: str, options: dict[str, Any], files: list[tuple[str, Any]], overwrite: bool,
                     reader: Any, workers: int, progress: Progress) -> dict[str, int]:
    parent_url, name = split_url(out)
    parent = open_storage(parent_url, **options)
    occupied = name in parent.list_children("")
    if occupied and parent.exists(name) and not overwrite:
        raise CheckpointExistsError(f"{out} is a file; pass a directory name for the Hugging Face layout "
                                    "(or a name ending in .safetensors for one file), or --overwrite to replace it")
    return publish_renamed(parent, name, out, occupied,
                           lambda st: _write_all(parent, st, files, reader, workers, progress), too_large=TOO_LARGE)


def _publish_beside(out: str, options: dict[str, Any], old_weights: list[str], files: list[tuple[str, Any]],
                    reader: Any, workers: int, progress: Progress) -> dict[str, int]:
    """(filesystems, OUT a model directory) Write into a hidden sibling, then
    rename each file into OUT, the commit file last, and remove the old
    export's weights the new one lacks. A failed export changes nothing in
    OUT; OUT's other files are never touched."""
    parent_url, name = split_url(out)
    parent = open_storage(parent_url, **options)
    stage = staging_name(name)
    try:
        sizes = _write_all(parent, stage, files, reader, workers, progress)
        for n, _ in files:
            parent.rename(f"{stage}/{n}", f"{name}/{n}", replace=True)
    except BaseException as e:
        parent.delete_prefix(stage)
        told = staged_failure(e, stage, name, out, too_large=TOO_LARGE)
        if told is e:
            raise
        raise told from e
    parent.delete_prefix(stage)
    parent.delete([f"{name}/{f}" for f in old_weights if f not in sizes])
    return sizes


def _publish_in_place(target: Storage, existing: list[str], files: list[tuple[str, Any]],
                      reader: Any, workers: int, progress: Progress, kept: Sequence[str] = ()) -> dict[str, int]:
    """``existing``: the old export's weights (replaced); ``kept``: the
    directory's other files (never deleted, even when this export fails)."""
    target.delete([f for f in (INDEX_NAME, WEIGHTS_NAME) if f in existing])  # withdraw the old output first
    sizes: dict[str, int] = {}
    try:
        sizes = _write_all(target, "", files, reader, workers, progress)
    except BaseException:
        try:
            # a stopped worker may leave an unfinished multipart upload (S3)
            target.abort_incomplete_uploads()
            target.delete([n for n, _ in files if n not in existing and n not in kept])
        except Exception:  # noqa: BLE001 - best effort; the original error matters
            pass
        raise
    target.delete([f for f in existing if f not in sizes])
    return sizes


#: what to do when a shard passed the largest file allowed where the export writes
TOO_LARGE = "pass --max-shard-size (max_shard_size=) below that size"

#: the weights of an export (what --overwrite replaces; every other file of OUT stays)
_WEIGHTS_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")
#: user metadata keys whose values become files of the export, when present
COMPANIONS = {"hf_generation_config": "generation_config.json"}
TOKENIZER_KEY = "hf_tokenizer_files"  # {file name: text}, e.g. from tokenizer.save_pretrained(dir)


def companion_files(md: fmt.Metadata, where: str) -> list[tuple[str, bytes]]:
    """``generation_config.json`` and tokenizer files saved in the checkpoint's
    metadata (``metadata={"hf_generation_config": gen.to_dict(),
    "hf_tokenizer_files": {"tokenizer.json": text, ...}}``)."""
    out = []
    for key, name in COMPANIONS.items():
        if key in md.user_metadata:
            out.append((name, json.dumps(md.user_metadata[key], indent=2, sort_keys=True).encode() + b"\n"))
    tok = md.user_metadata.get(TOKENIZER_KEY) or {}
    if not isinstance(tok, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tok.items()):
        raise ConfigError(f"{where}: metadata {TOKENIZER_KEY!r} must map file names to their text")
    for name, text in sorted(tok.items()):
        if ("/" in name or "\\" in name or name in ("", ".", "..") or _WEIGHTS_FILE.fullmatch(name) or name == CONFIG_NAME
                or len(name.encode("utf-8", "surrogatepass")) > 255 or not name.isprintable()
                or any(0xD800 <= ord(ch) <= 0xDFFF for ch in name)):
            raise ConfigError(f"{where}: metadata {TOKENIZER_KEY!r} names {name!r:.80}, not a tokenizer file name")
        try:
            out.append((name, text.encode()))
        except UnicodeEncodeError as e:  # (a lone surrogate: no UTF-8 text)
            raise ConfigError(f"{where}: metadata {TOKENIZER_KEY!r}: the text of {name!r} is not UTF-8 ({e.reason})"
                              ) from None
    return out


def export_hf(
    src: str | Storage, out: str, *, prefix: str | None = None, strip_prefix: bool = True,
    max_shard_size: int | str | None = None, dtype: str | None = None,
    config: str | Path | dict[str, Any] | None = None, overwrite: bool = False,
    out_options: dict[str, Any] | None = None, workers: int = 1, progress: Progress = NO_PROGRESS,
    spec: str | None = None, masters: bool = False,
) -> ExportResult:
    """Export the checkpoint at ``src`` (a URL or an opened storage) to the
    Hugging Face layout at ``out`` (any URL bytecp writes).

    ``prefix``/``strip_prefix``/``dtype``/``masters`` select and cast as
    :func:`bytecp.interop.export.select_tensors` (``prefix`` None: the checkpoint's default); ``config`` as :func:`resolve_config`;
    ``max_shard_size``: see :func:`parse_size` (default :data:`DEFAULT_MAX_SHARD_SIZE`);
    ``out_options``: storage options of the output (default: none);
    ``workers``: processes writing disjoint shards at once (each holds
    about one tensor; the commit stays in this process);
    ``spec``: a mapping spec's name (:mod:`bytecp.interop.mapped_export`): the
    tensors are converted (e.g. Megatron -> ``LlamaForCausalLM``) before
    they are written; by default detected for a Megatron checkpoint from the
    config's ``model_type``; ``"none"``: never."""
    if workers < 1:
        raise ConfigError(f"workers must be at least 1, got {workers}")
    max_bytes = parse_size(DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size)
    opened = open_export(src)
    storage, md = opened.storage, opened.metadata
    config_bytes, config_source = resolve_config(md, storage.url, config, dtype)
    chosen = choose_spec(md, spec, config_bytes)
    reader: TensorReader | MappedReader
    if chosen is not None:
        if workers > 1:
            raise ConfigError(f"--workers {workers} with --spec {chosen}: a converted export runs in one process "
                              "(it streams one source tensor at a time); drop --workers")
        reader = MappedReader(opened, storage.url, chosen, config_bytes, prefix=prefix, dtype=dtype, masters=masters)
        items, omitted = reader.items, list[str]()
    else:
        items, omitted = select_tensors(md, storage.url, prefix=prefix, strip_prefix=strip_prefix, dtype=dtype,
                                        masters=masters)
        reader = TensorReader(opened)
    options = dict(out_options or {})
    target = open_storage(out, **options)
    refuse_nested(storage.url, target.url)
    existing = target.list_files("")
    old_weights = [f for f in existing if _WEIGHTS_FILE.fullmatch(f)]
    if old_weights and not overwrite:
        shown = ", ".join(old_weights[:3]) + (", ..." if len(old_weights) > 3 else "")
        raise CheckpointExistsError(f"{out} already holds the weights of an export ({shown}); pass --overwrite "
                                    "(overwrite=True) to replace them, or choose another output")
    # a model directory (config, tokenizer, generation config...): the weights go beside its files, which
    # stay; its config.json is replaced only by an explicit --config
    kept = [f for f in existing if f not in old_weights]
    if CONFIG_NAME in kept and config is None:
        config_bytes, config_source = None, f"kept {out.rstrip('/')}/{CONFIG_NAME}"
    extras = [(n, b) for n, b in companion_files(md, storage.url) if n not in kept]
    shards = plan_shards(items, max_bytes)
    names = shard_names(len(shards))
    meta = safetensors_metadata(md)
    weights: list[tuple[str, Any]] = [
        (n, _Shard(storage.url, storage.options(), "", {}, "", safetensors_header(s, meta), tuple(s)))
        for n, s in zip(names, shards, strict=True)
    ]
    config_file = [(CONFIG_NAME, config_bytes)] if config_bytes is not None else []
    config_file += extras
    if len(shards) == 1:  # the one shard is the commit file: after the config
        files: list[tuple[str, Any]] = config_file + weights
    else:
        files = weights + config_file + [(INDEX_NAME, index_json(shards, names))]
    total = sum(it.nbytes for it in items)
    progress.start(total)
    if target.atomic_rename:  # a model directory's other files stay: the new files go in beside them
        sizes = (_publish_beside(out, options, old_weights, files, reader, workers, progress) if kept else
                 _publish_renamed(out, options, files, overwrite, reader, workers, progress))
    else:
        sizes = _publish_in_place(target, old_weights, files, reader, workers, progress, kept)
    return ExportResult(out, "hf", sizes, len(items), total, omitted, config_source)
