"""What the entries of a run folder are, besides bytecp's committed
checkpoints: the checkpoints of other formats (what a job that moves onto
bytecp mid-run resumes from), bytecp's interrupted saves and retired
bases, empty folders, step folders no format reads, and the pointer files
other tools keep.

A run folder written by another checkpointer holds one sub-folder per
checkpoint, named by its step: ``step-N`` (torchtitan's DCP backend),
``global_stepN`` (DeepSpeed), ``iter_NNNNNNN`` (Megatron-LM and NeMo),
``checkpoint-N`` (the Hugging Face Trainer), ``epoch=E-step=N.ckpt`` or
``step=N.ckpt`` (Lightning's sharded strategies). :func:`classify` says
what one such entry holds; :func:`pointers` reads the files DeepSpeed
(``latest``) and Megatron-LM (``latest_checkpointed_iteration.txt``) write
once a save has finished -- their commit points.

Who calls it: the resume decision (:func:`bytecp.tools.resume.decide`, the
coordinator), which every resume path asks. Reads names and a few small
files only (each source's ``detect``). A storage error is raised, never
read as "nothing there".
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

from bytecp import interop
from bytecp.format import metadata as fmt
from bytecp.storage_api import Storage, open_storage

__all__ = ["ForeignCheckpoint", "Entry", "Pointer", "STEP_FOLDER", "STEP_LIKE", "POINTERS", "step_of",
           "checkpoint_like", "is_bytecp_folder", "classify", "pointers", "foreign_checkpoints"]

log = logging.getLogger("bytecp")

#: a checkpoint folder's name -> its step (the one group); Lightning adds ``-vN`` to a repeated name,
#: DeepSpeed's ds_to_universal output is named ``global_stepN_universal`` by convention
STEP_FOLDER = re.compile(
    r"(?:step[-_=]|global_step|iter_|checkpoint-|epoch=\d+-step=)(\d+)(?:-v\d+|_universal)?(?:\.ckpt)?")
#: a name that looks like a checkpoint's, with or without a step in it (``step-abc``)
STEP_LIKE = re.compile(r"(?:step[-_=]|global_step|iter_|checkpoint-|epoch=)")


@dataclasses.dataclass(frozen=True)
class ForeignCheckpoint:
    """A checkpoint of another format below a run folder."""

    name: str
    url: str
    step: int
    format: str  # a name of bytecp.interop.SOURCES


@dataclasses.dataclass(frozen=True)
class Entry:
    """What one checkpoint-like entry of a run folder holds (:func:`classify`)."""

    name: str
    url: str
    #: the step its name says (None: it says none)
    step: int | None
    #: ``"foreign"`` (a source reads it), ``"interrupted"`` (a bytecp save that never
    #: committed), ``"retired"`` (a bytecp base kept for newer checkpoints' files),
    #: ``"empty"``, ``"stray"`` (files no format reads), ``"gone"`` (removed meanwhile)
    kind: str
    #: ``kind == "foreign"``: the name of the :data:`bytecp.interop.SOURCES` format
    format: str = ""


@dataclasses.dataclass(frozen=True)
class Pointer:
    """A tool's file naming the newest checkpoint it finished saving."""

    file: str
    tool: str
    #: the folder it names, and its step (None: the file names none we understand)
    folder: str | None
    step: int | None
    #: the names of the folders this tool writes (those the pointer speaks for)
    governs: re.Pattern[str]


#: pointer file -> (tool, the folder names it speaks for)
POINTERS = {
    "latest": ("DeepSpeed", re.compile(r"global_step(\d+)")),
    "latest_checkpointed_iteration.txt": ("Megatron-LM", re.compile(r"iter_(\d+)")),
}


def step_of(name: str) -> int | None:
    """The step a checkpoint folder's name says, or None when it names none."""
    m = STEP_FOLDER.fullmatch(name)
    return int(m.group(1)) if m else None


def checkpoint_like(name: str) -> bool:
    """Whether an entry's name is a checkpoint's (``step-12``, ``iter_0000100``,
    ``step-abc``); hidden names (``.followers``) never are."""
    return not name.startswith(".") and STEP_LIKE.match(name) is not None


def is_bytecp_folder(sub: Storage) -> bool:
    """A bytecp checkpoint, a retired base or an interrupted bytecp save:
    the catalog's and the garbage collector's, not a foreign source."""
    from bytecp.format.references import BASE_FILE
    from bytecp.saving.leases import saves_at

    if sub.exists(BASE_FILE):
        return True
    if sub.exists(fmt.METADATA_FILE):  # Megatron's torch_dist folders have a metadata.json too
        return fmt.is_bytecp_metadata(sub)
    return bool(saves_at(sub))


def classify(root: Storage, run_url: str, name: str) -> Entry:
    """(coordinator of the resume decision) What the entry ``name`` of the run
    folder ``root`` holds, when it is not a committed bytecp checkpoint."""
    from bytecp.format.references import BASE_FILE
    from bytecp.saving.leases import saves_at

    url, step = f"{run_url.rstrip('/')}/{name}", step_of(name)
    try:
        if root.exists(name):  # a file named like a checkpoint (a Lightning single-file .ckpt, ...)
            return Entry(name, url, step, "stray" if root.size(name) else "empty")
        sub = root.child(name)
        if sub.exists(BASE_FILE):
            return Entry(name, url, step, "retired")
        if saves_at(sub):
            return Entry(name, url, step, "interrupted")
        source = interop.find_source(sub)
        if source is not None:
            return Entry(name, url, step, "foreign", source)
        return Entry(name, url, step, "stray" if any(f for f in sub.list_files("")) else "empty")
    except FileNotFoundError:  # removed since the run was listed (the run's own listing raised, if any)
        return Entry(name, url, step, "gone")


def pointers(root: Storage, names: list[str]) -> list[Pointer]:
    """(coordinator of the resume decision) The pointer files among the run
    folder's ``names``, read (64 bytes at most each). A file that names
    nothing understood is kept with ``folder=None`` (and a warning)."""
    out = []
    for file, (tool, governs) in POINTERS.items():
        if file not in names or not root.exists(file):
            continue
        text = root.read_bytes(file, 0, min(root.size(file), 256)).decode("utf-8", "replace").strip()
        folder: str | None = None
        if tool == "Megatron-LM":
            folder = f"iter_{int(text):07d}" if text.isdigit() else "release" if text == "release" else None
        elif re.fullmatch(r"[A-Za-z0-9._-]{1,200}", text) and text not in (".", ".."):
            folder = text
        if folder is None:
            log.warning("bytecp: %s/%s holds %r, which names no %s checkpoint; it is ignored",
                        root.url, file, text[:60], tool)
        m = governs.fullmatch(folder or "")  # (Megatron-LM's "release": a starting point, not a step of the run)
        out.append(Pointer(file, tool, folder, int(m.group(1)) if m else None, governs))
    return out


def foreign_checkpoints(run_url: str, *, storage_options: dict[str, Any] | None = None,
                        after_step: int = -1) -> tuple[list[ForeignCheckpoint], list[str]]:
    """(checkpoints of other formats below ``run_url``, oldest step first;
    URLs of step folders holding files no source reads), among the folders
    whose step is above ``after_step``. A missing run folder has neither."""
    root = open_storage(run_url, **(storage_options or {}))
    found: list[ForeignCheckpoint] = []
    unreadable: list[str] = []
    for name in root.list_children(""):
        step = step_of(name)
        if step is None or step <= after_step or root.exists(f"{name}/{fmt.METADATA_FILE}") and \
                is_bytecp_folder(root.child(name)):
            continue
        entry = classify(root, run_url, name)
        if entry.kind == "foreign":
            found.append(ForeignCheckpoint(name, entry.url, step, entry.format))
        elif entry.kind == "stray":
            unreadable.append(entry.url)
    found.sort(key=lambda c: c.step)
    return found, sorted(unreadable)
