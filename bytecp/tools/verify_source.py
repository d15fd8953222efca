"""``bytecp verify`` over a foreign source (a DCP or Megatron torch_dist
folder, a DeepSpeed checkpoint, a Hugging Face directory): what the format
allows.

None of these formats stores checksums of its tensor data, so nothing can
prove the bytes are the ones written. What can be checked is the structure,
and opening the source checks it already, as a load does
(:data:`bytecp.interop.SOURCES`): every file the metadata names present,
every ``torch.save`` item's zip records and pickle parsed with the
restricted unpickler (DCP, torch_dist, DeepSpeed), every safetensors
header, every row's byte range inside its file. :func:`verify_source` then
lists the files once more and checks every row and value blob against the
sizes found, the crc32c of each value blob where the reader computed one,
each value blob decoded as a load decodes it (one that only
``allow_pickle=True`` reads is a problem: a load refuses it),
and every zip entry of every ``torch.save`` archive (each DCP item, each
``.pt`` file), which a load never reads: its local header where the central
directory says, under the directory's name, its data inside the archive.
No tensor data is read.

Who calls what: :func:`bytecp.tools.inspect.verify_any` (the CLI's
``verify``, one process) calls :func:`open_for_verify`, which turns a
source's own one-line refusal (a damaged archive, a truncated file) into a
problem to report (exit 1) rather than an unusable checkpoint (exit 2),
then :func:`verify_source` on a source it opened.
"""

from __future__ import annotations

import dataclasses

from bytecp import interop
from bytecp.catalog import one_line
from bytecp.errors import BytecpError, CorruptCheckpointError
from bytecp.format.checksum import crc32c
from bytecp.format.objects import read_object
from bytecp.interop import dcp_items, torch_zip
from bytecp.loading.opened import OpenedCheckpoint, open_checkpoint
from bytecp.storage_api import Storage
from bytecp.tools.progress import NO_PROGRESS, Progress
from bytecp.tree.regions import Region

__all__ = ["NO_CHECKSUMS", "Broken", "open_for_verify", "verify_source"]

#: what ``bytecp verify`` says of a source: its structure was checked, not its data
NO_CHECKSUMS = "no checksums in this format: structure checked"


@dataclasses.dataclass(frozen=True)
class Broken:
    """A source its reader refused as damaged: the format, the file (the source's URL) and the one-line reason."""

    format: str
    file: str
    message: str


def open_for_verify(storage: Storage) -> tuple[OpenedCheckpoint | None, Broken | None]:
    """The checkpoint or source at ``storage`` opened (foreign sources too),
    or, for a source whose reader finds it damaged, why. A bytecp checkpoint
    that cannot be opened raises, as before."""
    try:
        return open_checkpoint(storage, foreign=True), None
    except CorruptCheckpointError as e:
        source = interop.find_source(storage)
        if source is None:
            raise
        return None, Broken(source, storage.url, str(e))


def verify_source(opened: OpenedCheckpoint, progress: Progress = NO_PROGRESS) -> tuple[int, list[tuple[str, str, str, str]]]:
    """``(bytes whose structure was checked, problems as (file, what, region, message))``
    of a foreign source opened by :func:`open_for_verify`."""
    storage, md = opened.storage, opened.metadata
    problems: list[tuple[str, str, str, str]] = []
    sizes: dict[str, int | None] = {}
    for path, want in md.data_files.items():
        try:
            sizes[path] = storage.size(path)
        except FileNotFoundError:
            sizes[path] = None
            problems.append((path, "data file", "", "missing"))
            continue
        if sizes[path] != want:
            problems.append((path, "data file", "", f"size {sizes[path]} B, the source's metadata says {want} B"))
    progress.start(sum(md.data_files.values()))
    for c in opened.all_rows():
        size = sizes.get(c.file)
        if size is not None and c.byte_offset + c.nbytes > size:
            problems.append((c.file, c.fqn, str(Region(c.offsets, c.lengths)),
                             f"truncated: needs bytes {c.byte_offset}..{c.byte_offset + c.nbytes}, file has {size}"))
    for name, rec in md.objects.items():
        if not (rec.is_blob and rec.file):
            continue
        size = sizes.get(rec.file, storage.size(rec.file) if storage.exists(rec.file) else None)
        if size is None or rec.byte_offset + rec.nbytes > size:
            problems.append((rec.file, f"value {name!r}", "", f"bytes {rec.byte_offset}..{rec.byte_offset + rec.nbytes} "
                             f"outside the file ({'missing' if size is None else f'{size} B'})"))
        elif rec.crc32c and crc32c(storage.read_bytes(rec.file, rec.byte_offset, rec.nbytes)) != rec.crc32c:
            problems.append((rec.file, f"value {name!r}", "", "changed since it was read (crc32c)"))
        else:  # decoded as a load decodes it: fails where it fails
            try:
                read_object(storage, name, rec, verify=True, allow_pickle=False)
            except BytecpError as e:
                problems.append((rec.file, f"value {name!r}", "", f"a load refuses it: {one_line(e)}"))
    for file, start, length in _archives(opened):
        msg = _archive_problem(storage, file, start, length)
        if msg is not None:
            problems.append((file, f"torch.save archive at bytes {start}+{length}", "", msg))
    progress.advance(sum(md.data_files.values()))
    return sum(md.data_files.values()), problems


def _archives(opened: OpenedCheckpoint) -> list[tuple[str, int, int]]:
    """Every ``torch.save`` archive of the source as (file, start, length):
    DCP's storage items (torch_dist's below its folder), and every ``.pt`` file whole."""
    storage, md = opened.storage, opened.metadata
    out = [(f, 0, n) for f, n in md.data_files.items() if f.endswith(".pt")]
    if opened.source_format in ("dcp", "torch_dist"):
        folder = str(md.user_metadata.get("megatron_folder") or "")
        where = storage.child(folder) if folder else storage
        sizes = {n: s for n, s in where.file_sizes("").items() if n.endswith(".distcp")}
        dmd = dcp_items.read_metadata(where, f"{where.url}/.metadata")
        items = dcp_items.storage_items(dmd, f"{where.url}/.metadata", sizes)
        base = f"{folder}/" if folder else ""
        out += sorted({(base + f, a, n) for f, a, n in items.values()})
        if opened.source_format == "torch_dist" and where.exists("common.pt"):
            out.append((base + "common.pt", 0, where.size("common.pt")))
    return out


def _archive_problem(storage: Storage, file: str, start: int, length: int) -> str | None:
    """Why the zip archive at ``[start, start + length)`` of ``file`` is damaged, or None."""
    r = torch_zip._Ranged(storage, file, start, length, f"{storage.url}/{file}")
    try:
        r.keep(max(0, length - (1 << 16) - 22), (1 << 16) + 22)  # the end records, as torch_zip reads them
        for name, (local, size) in torch_zip._entries(r).items():
            raw = name.encode()
            head = r.read(local, 30 + len(raw), f"the header of entry {name!r:.80}")
            if head[:4] != b"PK\x03\x04" or head[30:] != raw:
                return f"zip entry {name!r:.80}: no local header under that name where the directory says"
            nlen, elen = int.from_bytes(head[26:28], "little"), int.from_bytes(head[28:30], "little")
            if local + 30 + nlen + elen + size > length:
                return f"zip entry {name!r:.80} runs past the archive's end"
    except CorruptCheckpointError as e:
        return str(e)
    return None
