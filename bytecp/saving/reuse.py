"""Incremental saves: boxes unchanged since this process's last committed
save are not written again; their index rows name that checkpoint's data
file instead (format version 3, :mod:`bytecp.format.references`).

What is unchanged is known without reading a byte: every in-place change of
a tensor moves its storage's version counter (``tensor._version``, shared by
every view; for a DTensor its own, not its local tensor's), so a box whose tensor has the same data pointer and version as
when the last committed save described it holds the same bytes. Frozen
parameters (``requires_grad=False``) never move; trainable ones and their
optimizer state move at every optimizer step. Frameworks that write tensors
through ``.data`` (which has a version counter of its own) say so with
:attr:`bytecp.adapter_api.Adapter.tracks_versions`; their saves never reference.

Who calls what (every rank, in the save pipeline's order):

1. :func:`live_tokens` -- describe: each shard's (pointer, version) token,
   before any copy (the versions read at once, one attribute a shard; the
   mapping by FQN built when first asked for, on whichever thread).
2. :meth:`Incremental.split` -- plan: the boxes this rank writes, less those
   unchanged since the base (the last committed save of this process, in the
   run's sibling checkpoint ``base``); their rows travel as :class:`Reused`.
3. :meth:`Reused.add_to` -- commit: those rows and the sizes of the files
   they name join this rank's output.
4. :meth:`Incremental.committed` -- after the commit: this save becomes the
   base the next one may reference (:data:`LAST_SAVES`; its boxes made from
   its rows and tokens when that next save first asks).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from bytecp.errors import ConfigError
from bytecp.format import metadata as fmt
from bytecp.format.references import name_of, run_url
from bytecp.plan.planner import WriteItem
from bytecp.tree.regions import Region
from bytecp.tree.state import FlatTree, PieceShard

__all__ = ["Token", "TokenEntry", "Tokens", "live_tokens", "LastSave", "LAST_SAVES", "Incremental", "Reused"]

log = logging.getLogger("bytecp")

#: a shard's identity and in-place-change count: (data pointer, version, device)
Token = tuple[int, int, str]
#: one shard's entry: its box, its token (None: no version counter) and the tensor whose counter moves
TokenEntry = tuple[Region, Token | None, torch.Tensor]

#: a box of a tensor, as incremental saves key it: (fqn, offsets, lengths)
#: (tuples hash and compare in C; a :class:`Region` key costs two Python calls a look-up)
BoxKey = tuple[str, tuple[int, ...], tuple[int, ...]]

_VERSION = operator.attrgetter("_version")


def _versions(tensors: Sequence[torch.Tensor]) -> list[int | None]:
    """Each tensor's version counter (None for inference tensors, which have none)."""
    try:
        return list(map(_VERSION, tensors))
    except RuntimeError:
        out: list[int | None] = []
        for t in tensors:
            try:
                out.append(t._version)
            except RuntimeError:
                out.append(None)
        return out


class Tokens(Mapping[str, list[TokenEntry]]):
    """Every shard's token, by FQN: the shards listed at describe, their
    versions read by :meth:`read` -- at describe, or for a lazy save first
    thing on the background thread, in any case before any of the state's
    bytes is copied or written (a version read before the bytes are is
    never newer than they: at worst the next save writes a box again) --
    and the mapping made on first use."""

    def __init__(self, shards: Sequence[PieceShard], versions: Sequence[int | None] | None = None) -> None:
        self._shards, self._versions = shards, versions
        self._by_fqn: dict[str, list[TokenEntry]] | None = None
        self._exact: dict[BoxKey, tuple[Token | None, torch.Tensor]] | None = None
        self._lock = threading.Lock()

    def read(self) -> None:
        """Read every shard's version now, unless read already."""
        if self._versions is None:
            with self._lock:
                if self._versions is None:
                    self._versions = _versions([t for _, _, t, _, _ in self._shards])

    def _table(self) -> dict[str, list[TokenEntry]]:
        table = self._by_fqn  # (set once, never changed after)
        if table is not None:
            return table
        self.read()
        with self._lock:
            if self._by_fqn is None:
                made: dict[str, list[TokenEntry]] = {}
                assert self._versions is not None
                for (fqn, region, t, ptr, device), v in zip(self._shards, self._versions, strict=True):
                    made.setdefault(fqn, []).append((region, None if v is None else (ptr, v, device), t))
                self._by_fqn = made
            return self._by_fqn

    def exact(self) -> dict[BoxKey, tuple[Token | None, torch.Tensor]]:
        """Each shard's token and tensor keyed by its own box, (fqn, offsets,
        lengths), made on first use straight from the shards (the first shard
        of a box where two are the same): :meth:`find`'s look-up of a box that
        is a whole shard (most are) in one dict probe."""
        table = self._exact
        if table is not None:
            return table
        self.read()
        with self._lock:
            if self._exact is None:
                shards, versions = self._shards, self._versions
                assert versions is not None
                self._exact = {(fqn, region.offsets, region.lengths): (None if v is None else (ptr, v, device), t)
                               for (fqn, region, t, ptr, device), v in zip(reversed(shards), reversed(versions),
                                                                           strict=True)}
            return self._exact

    def find(self, key: BoxKey) -> tuple[Token | None, torch.Tensor | None]:
        """The token of the shard holding the box ``key`` and its tensor
        (None, None: no shard holds it): the shard that is the box, else the
        first that contains it."""
        hit = self.exact().get(key)
        if hit is not None:
            return hit
        fqn, offsets, lengths = key
        box = Region(offsets, lengths)
        for region, tok, t in self._table().get(fqn, ()):
            if region.contains(box):
                return tok, t
        return None, None

    def __getitem__(self, fqn: str) -> list[TokenEntry]:
        return self._table()[fqn]

    def get(self, fqn: str, default: Any = None) -> Any:
        return self._table().get(fqn, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())


def _shards_of(fqn: str, leaf: Any) -> list[PieceShard]:
    out: list[PieceShard] = []
    for sh in leaf.shards:
        t = sh.tensor
        out.append((fqn, sh.region, t if leaf.versioned is None else leaf.versioned, t.data_ptr(), str(t.device)))
    return out


def live_tokens(flat: FlatTree, *, read: bool = True) -> Tokens:
    """(every rank, describe) The token of every shard this rank holds (the
    version of the leaf's ``versioned`` tensor where the adapter names one:
    a DTensor's, whose local tensor's counter never moves). The shards of
    :class:`~bytecp.tree.state.Prebuilt` pieces are listed by the piece.
    ``read=False``: the versions are read later (:meth:`Tokens.read`)."""
    shards: list[PieceShard] = []
    for p in flat.pieces:
        shards.extend(p.shards)
    for fqn, leaf in flat.loose_tensors():
        shards.extend(_shards_of(fqn, leaf))
    tokens = Tokens(shards)
    if read:
        tokens.read()
    return tokens


class _Box(NamedTuple):  # (a tuple: made for every box of every save, on its background thread)
    token: Token
    #: the row as the next save of the run references it: its file "../<checkpoint>/data/<save_id>/<file>.bin"
    ref: fmt.ChunkRecord
    file_size: int


class LastSave:
    """What this process wrote (or referenced) in its last committed save:
    its rows and the tokens of its shards, kept as the commit left them; the
    boxes a next save may reference made from them when one first asks
    (:attr:`boxes`: tens of thousands of rows on a MoE rank, which a save
    whose successor names no base never pays for). Holding the tokens holds
    the tensors described then, so that no other tensor can be given their
    memory (a pointer equal to one of theirs is theirs)."""

    def __init__(self, name: str, save_id: str, tokens: Tokens,
                 chunks: Sequence[fmt.ChunkRecord], data_files: Mapping[str, int]) -> None:
        self.name = name  # the checkpoint's name in its run
        self.save_id = save_id
        self._tokens, self._chunks, self._data_files = tokens, chunks, data_files
        self._boxes: dict[BoxKey, _Box] | None = None
        self._lock = threading.Lock()

    @property
    def boxes(self) -> dict[BoxKey, _Box]:
        """Each box with a token, by (fqn, offsets, lengths): its token, its row as the
        next save of the run references it, the size of its file (made once, on first use)."""
        with self._lock:
            if self._boxes is None:
                self._boxes = self._made()
            return self._boxes

    def _made(self) -> dict[BoxKey, _Box]:
        boxes: dict[BoxKey, _Box] = {}
        mine, data_files, find = f"../{self.name}/", self._data_files, self._tokens.find
        for c in self._chunks:  # (on the next incremental save's background thread)
            key = (c.fqn, c.offsets, c.lengths)
            tok, t = find(key)
            if tok is None or t is None:
                continue
            # the next save names this row's file from its own folder: "../<checkpoint>/data/..." (a row
            # this save referenced is named so already)
            file = c.file
            boxes[key] = _Box(tok, c if file.startswith("../") else c.in_file(mine + file), data_files[file])
        return boxes


class _LastSaves:
    """The last committed save of this process, per (run, world size, rank)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[tuple[Any, ...], LastSave] = {}

    def get(self, key: tuple[Any, ...]) -> LastSave | None:
        with self._lock:
            return self._by_key.get(key)

    def put(self, key: tuple[Any, ...], last: LastSave) -> None:
        with self._lock:
            self._by_key[key] = last

    def clear(self) -> None:
        with self._lock:
            self._by_key.clear()


LAST_SAVES = _LastSaves()


@dataclasses.dataclass(frozen=True)
class Reused:
    """(plan -> commit) The rows of the boxes a rank references instead of
    writing, and the sizes of the files they name (``../<name>/data/...``)."""

    records: tuple[fmt.ChunkRecord, ...] = ()
    files: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def add_to(self, output: Any) -> Any:
        """(every rank, commit) ``output`` (a RankOutput) with these rows and files."""
        if not self.records:
            return output
        return dataclasses.replace(output, chunks=[*output.chunks, *self.records],
                                   data_files={**output.data_files, **self.files})


class Incremental:
    """What one save on one rank may reference (see the module's docstring);
    holds only the save's target and base, no state between phases."""

    def __init__(self, url: str, base: str | None, world_size: int, rank: int) -> None:
        self.url, self.name = url, name_of(url)
        try:
            self.run = run_url(url)
        except Exception:
            self.run = ""  # a checkpoint at a storage's root: nothing to share with
        if base is not None and (not self.run or run_url(base) != self.run or name_of(base) == self.name):
            raise ConfigError(
                f"base={base!r}: the base must be another checkpoint of the same run as {url!r} "
                "(a sibling directory under the same parent)"
            )
        self.base = name_of(base) if base is not None else None
        self.key = (self.run, world_size, rank)
        #: the last split's (items, tokens, base) and answer: an async snapshot's share and the plan phase
        #: split the same plan (tens of thousands of boxes on a MoE rank, on the save's background thread)
        self._last_split: tuple[Sequence[WriteItem], Tokens, LastSave, list[WriteItem], Reused] | None = None

    def split(self, items: Sequence[WriteItem], tokens: Tokens | None) -> tuple[list[WriteItem], Reused]:
        """(every rank, plan) ``items`` less the boxes unchanged since the
        base, and the rows of those; ``tokens``: describe's (None: the
        framework writes tensors behind their version counter)."""
        if self.base is None or tokens is None:
            return list(items), Reused()
        last = LAST_SAVES.get(self.key)
        if last is None or last.name != self.base:
            log.info("bytecp: %s: no save of this process at base %s; writing every box", self.url, self.base)
            return list(items), Reused()
        memo = self._last_split
        if memo is not None and memo[0] is items and memo[1] is tokens and memo[2] is last:
            return list(memo[3]), memo[4]
        write: list[WriteItem] = []
        records: list[fmt.ChunkRecord] = []
        files: dict[str, int] = {}
        boxes, own, find = last.boxes, f"../{self.name}/", tokens.find
        for it in items:  # (tens of thousands of boxes on a MoE rank, on the save's background thread)
            region = it.region
            key = (it.fqn, region.offsets, region.lengths)
            box = boxes.get(key)
            if box is None:
                write.append(it)
                continue
            tok = find(key)[0]
            rec = box.ref
            if (tok is None or tok != box.token or rec.dtype != it.dtype or rec.global_shape != it.global_shape
                    or rec.file.startswith(own)):
                write.append(it)
                continue
            records.append(rec)
            files[rec.file] = box.file_size
        reused = Reused(tuple(records), files)
        self._last_split = (items, tokens, last, write, reused)
        return list(write), reused

    def committed(self, md: fmt.Metadata, tokens: Tokens | None, chunks: Sequence[fmt.ChunkRecord],
                  data_files: Mapping[str, int]) -> None:
        """(every rank, after the commit) This save is the base of the next."""
        if not self.run or tokens is None:
            return
        LAST_SAVES.put(self.key, LastSave(self.name, md.save_id, tokens, tuple(chunks), dict(data_files)))
