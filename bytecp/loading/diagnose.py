"""Why a URL is not a checkpoint: one clear line naming the path and what to do.

Called by :func:`bytecp.loading.opened.read_metadata` (every reader: ``load``,
``load_state_dict``, ``inspect``, ``verify``, ``export``) when
``metadata.json`` cannot be read, and only then, so the look-ups here cost
nothing on the normal path. The cases, in the order they are checked:

- the URL names a **file** (``ckpt/metadata.json``, a ``.pt`` file): name
  the directory to use instead;
- the URL is a **run directory** holding committed checkpoints (``step-N``
  folders): name its latest committed checkpoint;
- a ``base.json``: a checkpoint **retired by retention**, kept only for the
  files newer checkpoints reference;
- **another tool's checkpoint** (a Hugging Face model directory, a
  torch.distributed.checkpoint directory): say what it is and how to load it;
- ``data/``/``index/`` but no ``metadata.json``: an **interrupted or failed
  save** (the next save to that URL or ``bytecp gc`` removes its files);
- other entries: **not a checkpoint**, naming a few of them;
- **nothing** there: say so, and how to list a run's checkpoints.

Only the URL's top level is listed, never a whole tree: a wrong path may be
``/tmp`` or a bucket's root.

Storage errors that are not "missing" (permissions, throttling, an
unreachable server) are returned unchanged: they already say what is wrong.
"""

from __future__ import annotations

import logging
import os
from typing import NoReturn

from bytecp.errors import CheckpointNotFoundError, IncompleteCheckpointError, StorageError
from bytecp.format import metadata as fmt
from bytecp.storage_api import Storage, open_storage, split_protocol

__all__ = ["not_a_checkpoint", "raise_not_a_checkpoint", "foreign_kind", "nothing_to_list"]

log = logging.getLogger(__name__)


def not_a_checkpoint(storage: Storage, error: BaseException) -> BaseException:
    """(coordinator) The error to raise for a checkpoint URL without a readable
    ``metadata.json``; ``error`` is what reading it raised."""
    url = storage.url.rstrip("/")
    missing = isinstance(error, FileNotFoundError)
    if not missing and not isinstance(error, StorageError):
        return error
    if _is_a_file(storage):
        parent = url.rsplit("/", 1)[0] if "/" in url else "."
        hint = (
            f"use its directory {parent}"
            if url.endswith("/" + fmt.METADATA_FILE) or url == fmt.METADATA_FILE
            else "pass the checkpoint's directory (the one holding metadata.json); "
            "a single-file checkpoint (torch.save) is not a bytecp checkpoint"
        )
        return CheckpointNotFoundError(f"{url} is a file, not a checkpoint directory: {hint}")
    if not missing:
        return error  # a real storage failure (permission, network): it says what is wrong
    latest = _latest_committed(storage)
    if latest is not None:
        return CheckpointNotFoundError(
            f"{url} is a run directory, not a checkpoint: its latest committed checkpoint is "
            f"{url}/{latest}; pass that instead (`bytecp ls {url}` lists the run's checkpoints; in a training "
            f"job, CheckpointManager({url!r}).restore loads the newest)"
        )
    try:  # one level only: a wrong path may be the root of a huge tree
        names = storage.list_children("")
    except Exception:  # noqa: BLE001 - listing is only for the message
        names = []
    if "base.json" in names:  # format version 3: retention retired it (bytecp.format.references)
        return CheckpointNotFoundError(
            f"{url} was retired by retention: it only holds the files newer checkpoints of its run "
            "reference (base.json); load one of those (`bytecp ls RUN_DIR` lists them)"
        )
    foreign = foreign_kind(names)
    if foreign is not None:
        return CheckpointNotFoundError(f"{url} is {foreign}")
    if _SAVE_FOLDERS & set(names):
        return IncompleteCheckpointError(
            f"{url} has no metadata.json but holds files of a save: an interrupted or failed save, not a "
            f"checkpoint; load an earlier one (`bytecp ls` on its run directory lists them). The next save "
            f"to {url} removes these files, or `bytecp gc {url}` once no save is running there"
        )
    if names:
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        return CheckpointNotFoundError(
            f"{url} is not a checkpoint: no metadata.json among its {len(names)} entries ({shown}); pass "
            "a checkpoint directory (`bytecp ls RUN_DIR` lists a run's committed checkpoints)"
        )
    return CheckpointNotFoundError(
        f"no checkpoint at {url}: nothing is stored there; check the path "
        "(`bytecp ls RUN_DIR` lists a run's committed checkpoints)"
    )


#: the folders a bytecp save writes before its metadata.json
_SAVE_FOLDERS = {"data", "index"}
_HF_WEIGHTS = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json", ".h5", ".msgpack", ".gguf")


def foreign_kind(names: list[str]) -> str | None:
    """What another tool's checkpoint directory is, from its top-level names,
    and how to load it (None: not one we recognise). Hugging Face model
    directories and torch.distributed.checkpoint (DCP) directories are
    named; bytecp's load reads a Hugging Face directory of safetensors
    (:mod:`bytecp.interop.safetensors_dir`) and a DCP directory before this
    is asked (so does ``bytecp inspect``/``verify``/``export``)."""
    has = set(names)
    if ".metadata" in has and any(n.endswith(".distcp") for n in names):
        return (
            "a torch.distributed.checkpoint (DCP) checkpoint (.metadata, *.distcp), not a bytecp one: "
            "bytecp.load, bytecp.load_state_dict and bytecp inspect/verify/export read it as it is "
            "(unless format='bytecp' is given)"
        )
    hf_files = "config.json" in has or "tokenizer_config.json" in has or "adapter_config.json" in has
    weights = [n for n in names if n.endswith(_HF_WEIGHTS) and not n.startswith(".")]
    if hf_files or any(n.startswith(("model", "pytorch_model", "adapter_model")) for n in weights):
        what = ", ".join(sorted(n for n in names if n == "config.json" or n in weights)[:3]) or "tokenizer files"
        return (
            f"a Hugging Face model directory ({what}), not a bytecp checkpoint: bytecp.load and "
            "bytecp.load_state_dict read it when it holds model.safetensors or model.safetensors.index.json "
            "(else load it with transformers' AutoModel...from_pretrained, or save it again with save_pretrained)"
        )
    return None


def nothing_to_list(storage: Storage) -> CheckpointNotFoundError:
    """(``bytecp ls``) The one-line reason the run URL ``storage`` has no
    checkpoint to list (a resume there starts afresh)."""
    from bytecp.format.references import BASE_FILE

    url = storage.url
    if storage.exists(fmt.METADATA_FILE):
        return CheckpointNotFoundError(f"{url} is a checkpoint, not a run directory: `bytecp inspect {url}` "
                                       "describes it; `bytecp ls` lists the step-<N> checkpoints of a run directory")
    names = storage.list_children("")
    if not names:
        return CheckpointNotFoundError(f"nothing at {url}: check the path (a resume there starts afresh)")
    foreign = foreign_kind(names)
    if foreign is not None:
        return CheckpointNotFoundError(f"{url} is {foreign}")
    uncommitted = [n for n in names if storage.list_children(n) and not storage.exists(f"{n}/{fmt.METADATA_FILE}")
                   and _SAVE_FOLDERS & set(storage.list_children(n))
                   and not storage.exists(f"{n}/{BASE_FILE}")]  # a retired base: gc never removes it
    tail = (f"; {', '.join(uncommitted[:5])} hold(s) files of saves that never committed (`bytecp gc {url}` "
            "removes them)") if uncommitted else ""
    return CheckpointNotFoundError(f"no committed checkpoint below {url}{tail}")


def raise_not_a_checkpoint(storage: Storage, error: BaseException) -> NoReturn:
    """Raise :func:`not_a_checkpoint`'s answer (``error`` itself when it is a real storage failure)."""
    err = not_a_checkpoint(storage, error)
    if err is error:
        raise error
    raise err from None


def _is_a_file(storage: Storage) -> bool:
    """Whether the URL itself names a file (asked of its parent directory)."""
    url = storage.url.rstrip("/")
    proto, rest = split_protocol(url)
    if proto in ("file", "local"):
        path = os.path.abspath(os.path.expanduser(rest))
        parent_url, name = os.path.dirname(path), os.path.basename(path)
    elif "/" in rest.strip("/"):
        parent_url, name = url.rsplit("/", 1)
    else:
        return False  # a bucket or filesystem root is never a file
    if not name or parent_url == url:
        return False
    try:
        return open_storage(parent_url, **storage.options()).exists(name)
    except Exception as e:  # noqa: BLE001 - only a better message is at stake
        log.debug("bytecp: could not check whether %s is a file: %s", url, e)
        return False


def _latest_committed(storage: Storage) -> str | None:
    """The committed checkpoint directly below the URL with the highest step, if any."""
    from bytecp.catalog import list_checkpoints

    try:
        found = list_checkpoints(storage.url, storage_options=storage.options())
    except Exception as e:  # noqa: BLE001 - only a better message is at stake
        log.debug("bytecp: could not list checkpoints below %s: %s", storage.url, e)
        return None
    return found[-1].name if found else None
