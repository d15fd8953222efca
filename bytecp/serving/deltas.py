"""A run's serving deltas as a follower reads them: the chain of checkpoints
from the one it holds to the one it takes, and for each changed tensor the
cheapest way there (FORMAT.md §13; :mod:`bytecp.format.serving_wire`).

Called on every rank of a follower (:mod:`bytecp.serving.delta_update`,
each update of ``bytecp.follow(..., dtype=)``) and by
``bytecp.iter_weights(..., changed_since=, scatter=True)``, in one process:

1. :func:`walk` -- from the checkpoint taken back along each manifest's
   ``previous`` link (the same tier first, then the other: a drained copy
   links to the memory checkpoint before it) until the held save, reading
   each step's manifest and every saving rank's entries; it stops early when
   the deltas read already cost more than reading the tensors whole, at a
   missing or damaged link, or after :data:`MAX_STEPS`;
2. :func:`choose` -- per tensor, from the entries alone: apply the chain of
   deltas, or start from a whole serving copy written at a step of the chain
   and apply the deltas after it, or read the checkpoint's own tensors and
   cast them (``rows``), whichever costs the least: the bytes read, each
   changed element of a delta counted as :data:`ELEMENT_BYTES` more. Every
   rank of a follower group reads the same files and so chooses alike.
3. :func:`read_payloads` -- the byte ranges of the chosen parts (a whole file
   when most of it is wanted), each checked against its crc32c.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence

from bytecp.catalog import one_line
from bytecp.errors import CorruptCheckpointError
from bytecp.format import serving_wire as wire
from bytecp.format.checksum import crc32c
from bytecp.storage_api import Storage
from bytecp.tree.dtype_names import ITEMSIZES

__all__ = ["ELEMENT_BYTES", "MAX_STEPS", "Step", "Chain", "Mode", "Part", "read_step", "walk", "choose", "read_payloads"]

log = logging.getLogger("bytecp")

#: the longest chain of deltas a follower walks back
MAX_STEPS = 64
#: a changed element of a delta counts as this many bytes read (a dense delta is not taken for its bytes alone)
ELEMENT_BYTES = wire.ELEMENT_BYTES


@dataclasses.dataclass
class Step:
    """One checkpoint of a chain: its manifest and every saving rank's entries
    (None: missing or unreadable, said in ``problems``)."""

    url: str
    tier: str
    storage: Storage
    manifest: wire.Manifest
    ranks: list[wire.RankEntries | None]
    problems: list[str]
    _by_fqn: dict[str, list[tuple[int, wire.Entry]]] | None = None

    @property
    def save_id(self) -> str:
        return self.manifest.save_id

    def entries(self, fqn: str) -> list[tuple[int, wire.Entry]]:
        """(rank, entry) of every box of ``fqn`` this step's ranks wrote or referenced."""
        if self._by_fqn is None:
            self._by_fqn = {}
            for r, re_ in enumerate(self.ranks):
                for e in re_.entries if re_ is not None else ():
                    self._by_fqn.setdefault(e.fqn, []).append((r, e))
        return self._by_fqn.get(fqn, [])

    def covers(self, fqn: str, numel: int, part: str) -> bool:
        """Whether this step's entries of ``fqn`` with a ``part`` ("delta",
        "whole") hold every element of the tensor, relative to the same previous checkpoint."""
        ents = [e for r, e in self.entries(fqn) if getattr(e, part) is not None and self._linked(r)]
        return sum(e.box.numel for e in ents) == numel and bool(ents or numel == 0)

    def where(self, rank: int, e: wire.Entry) -> str:
        """Rank ``rank``'s delta of ``e`` in this step, for a message: its file, tensor and box."""
        return f"{self.url}/{wire.delta_path(self.save_id, rank)}: {e.fqn} {e.box}"

    def _linked(self, rank: int) -> bool:
        re_ = self.ranks[rank]
        return re_ is not None and re_.previous == self.manifest.previous

    def cost(self, fqn: str, part: str) -> int:
        """Bytes of ``fqn``'s ``part`` parts, each changed element of a delta counted :data:`ELEMENT_BYTES` more."""
        return sum(wire.delta_cost(e.delta.nbytes, e.delta.count) if part == "delta" and e.delta else
                   getattr(e, part).nbytes for _, e in self.entries(fqn) if getattr(e, part) is not None)


def read_step(storage: Storage, url: str, tier: str, save_id: str, threads: int = 8) -> Step | None:
    """The serving files of the save ``save_id`` at ``storage`` (the
    checkpoint ``url``); None when it carries none (no manifest). A rank's
    file missing or damaged is a problem of the step, not an error."""
    try:
        data = storage.read_bytes(wire.manifest_path(save_id))
    except FileNotFoundError:
        return None
    manifest = wire.Manifest.from_bytes(data, f"{url}/{wire.manifest_path(save_id)}")
    if manifest.save_id != save_id:
        raise CorruptCheckpointError(f"{url}/{wire.manifest_path(save_id)}: names save {manifest.save_id}")
    problems: list[str] = []

    def one(rank: int) -> wire.RankEntries | None:
        path = wire.entries_path(save_id, rank)
        try:
            got = wire.RankEntries.from_bytes(storage.read_bytes(path), f"{url}/{path}")
            if got.save_id != save_id or got.rank != rank or got.dtype != manifest.dtype:
                raise CorruptCheckpointError(f"{url}/{path}: not rank {rank}'s {manifest.dtype} entries of {save_id}")
            return got
        except (FileNotFoundError, CorruptCheckpointError) as e:
            problems.append(f"{url}: rank {rank}'s serving entries unreadable ({one_line(e)})")
            return None

    n = manifest.world_size
    if n == 1 or threads <= 1:
        ranks = [one(r) for r in range(n)]
    else:
        with concurrent.futures.ThreadPoolExecutor(min(threads, n), thread_name_prefix="bytecp-serving") as ex:
            ranks = list(ex.map(one, range(n)))
    return Step(url, tier, storage, manifest, ranks, problems)


@dataclasses.dataclass
class Chain:
    """Steps oldest first; ``from_held``: the oldest's previous is the held
    save (its deltas apply to what the follower holds)."""

    steps: list[Step]
    from_held: bool
    problems: list[str]
    bytes_read: int = 0
    #: the walk met deltas in another serving dtype than the follower's (a setting, not damage: one warning)
    other_dtype: str | None = None


#: (a link, the tier of the step it came from) -> (url, tier, storage) to look in, in order
Resolver = Callable[[wire.Link, str], Iterable[tuple[str, str, Storage]]]


def walk(target: tuple[str, str, Storage], save_id: str, held: str | None, dtype: str, resolve: Resolver,
         budget: int, served: Sequence[tuple[str, int]], *, threads: int = 8, max_steps: int = MAX_STEPS) -> Chain:
    """(every rank) The chain from the held save ``held`` (None: nothing held)
    to the save ``save_id`` at ``target`` (url, tier, storage), walked back
    along ``previous`` links. Where the walk ends short of the held save is a
    problem reported with the update; a follower holding nothing only looks
    for a step with whole copies, and not finding one is none. ``budget``: the bytes of reading the changed
    tensors whole, past which deltas cannot win; ``served``: (fqn, numel) of
    those tensors (nothing held: the walk stops at a step with every one
    whole)."""
    steps: list[Step] = []
    problems: list[str] = []
    url, tier, storage = target
    sid = save_id
    spent = 0
    other: str | None = None
    while True:
        step = read_step(storage, url, tier, sid, threads)
        if step is None:
            if steps and held is not None:
                problems.append(f"{url}: no serving deltas of save {sid} (the chain ends there)")
            break
        if step.manifest.dtype != dtype:
            problems.append(f"{url}: serving deltas in {step.manifest.dtype}, not {dtype} (follow with "
                            f"dtype=torch.{step.manifest.dtype}, or save with serving_dtype=torch.{dtype}, to read only changes)")
            other = step.manifest.dtype
            break
        steps.append(step)
        problems += step.problems
        prev = step.manifest.previous
        if prev is None or (held is not None and prev.save_id == held):
            break
        spent += sum(step.cost(f, "delta") for f, _ in served)
        if spent >= budget or len(steps) >= max_steps:
            break
        if held is None and all(step.covers(f, n, "whole") for f, n in served):
            break  # a follower holding nothing starts from here at the latest
        found = None
        for u, t, st in resolve(prev, tier):
            try:
                if st.exists(wire.manifest_path(prev.save_id)):
                    found = (u, t, st)
                    break
            except Exception as e:  # noqa: BLE001 - a tier down: the next one, else the chain ends
                log.debug("bytecp.follow: %s unreadable: %s", u, e)
        if found is None:
            if held is not None:  # nothing held: no chain could serve it, the tensors read whole is no fallback
                problems.append(f"{url}: its previous checkpoint {prev.name} (save {prev.save_id}) carries no "
                                "serving deltas any more (removed, or never written)")
            break
        url, tier, storage = found
        sid = prev.save_id
    steps.reverse()
    from_held = bool(steps) and held is not None and steps[0].manifest.previous is not None \
        and steps[0].manifest.previous.save_id == held
    return Chain(steps, from_held, problems, other_dtype=other)


@dataclasses.dataclass(frozen=True)
class Mode:
    """How a tensor is taken: ``rows`` (the checkpoint's own tensor, cast),
    ``chain`` (every step's delta applied to what is held) or ``whole`` (the
    serving copy at step ``start``, then the deltas of the steps after it)."""

    kind: str
    start: int = 0
    cost: int = 0


def choose(chain: Chain, fqn: str, numel: int, stored_dtype: str) -> Mode:
    """(every rank, alike) The cheapest way to ``fqn`` (``numel`` elements,
    stored as ``stored_dtype``): by bytes read, each changed element counted
    :data:`ELEMENT_BYTES` more; ties go to deltas."""
    best = Mode("rows", 0, numel * ITEMSIZES[stored_dtype])
    acc = 0
    steps = chain.steps
    for i in range(len(steps) - 1, -1, -1):
        st = steps[i]
        if st.covers(fqn, numel, "whole"):
            cost = st.cost(fqn, "whole") + acc
            if cost <= best.cost:
                best = Mode("whole", i, cost)
        if not st.covers(fqn, numel, "delta"):
            return best
        acc += st.cost(fqn, "delta")
    if chain.from_held and steps and acc <= best.cost:
        best = Mode("chain", 0, acc)
    return best


@dataclasses.dataclass(frozen=True)
class Part:
    """A payload range to read: ``path`` of a step's storage, its part."""

    step: int
    rank: int
    kind: str  # "delta" or "whole"
    offset: int
    nbytes: int
    crc32c: int


#: the largest single read of a payload file: a larger file (a whole serving copy) is read in pieces on threads
PIECE_BYTES = 8 << 20


def read_payloads(chain: Chain, parts: Iterable[Part], *, threads: int = 8) -> tuple[dict[Part, memoryview],
                                                                                    dict[Part, str]]:
    """(every rank) The bytes of ``parts``, each crc32c-checked: a file read
    whole when at least half of it is wanted, else its ranges one by one;
    reads of more than :data:`PIECE_BYTES` cut into pieces, the pieces and
    the checks spread over ``threads``. Returns the parts read and, for
    those that failed, why."""
    by_file: dict[tuple[int, int, str], list[Part]] = {}
    for p in dict.fromkeys(parts):
        if p.nbytes:
            by_file.setdefault((p.step, p.rank, p.kind), []).append(p)
    views: dict[Part, memoryview] = {}
    pieces: list[tuple[tuple[int, int, str], str, int, memoryview]] = []  # (file, path, offset, into)
    where: dict[tuple[int, int, str], str] = {}
    for key, want in by_file.items():
        i, rank, kind = key
        step = chain.steps[i]
        re_ = step.ranks[rank]
        assert re_ is not None
        path = (wire.delta_path if kind == "delta" else wire.whole_path)(step.save_id, rank)
        where[key] = f"{step.url}/{path}"
        size = re_.delta_nbytes if kind == "delta" else re_.whole_nbytes
        if sum(p.nbytes for p in want) * 2 >= size:
            whole = memoryview(bytearray(size))
            views.update({p: whole[p.offset:p.offset + p.nbytes] for p in want})
            ranges = [(0, whole)]
        else:
            ranges = []
            for p in want:
                views[p] = memoryview(bytearray(p.nbytes))
                ranges.append((p.offset, views[p]))
        for off, into in ranges:
            pieces += [(key, path, off + a, into[a:a + PIECE_BYTES]) for a in range(0, len(into), PIECE_BYTES)]
    failed: dict[tuple[int, int, str], str] = {}

    def read(piece: tuple[tuple[int, int, str], str, int, memoryview]) -> None:
        key, path, off, into = piece
        if key in failed:
            return
        try:
            chain.steps[key[0]].storage.read_into(path, off, into)
        except Exception as e:  # noqa: BLE001 - the parts of this file fall back to the tensors whole
            failed.setdefault(key, f"{where[key]}: {one_line(e)}")

    def check(p: Part) -> str | None:
        key = (p.step, p.rank, p.kind)
        if key in failed:
            return failed[key]
        if crc32c(views[p]) != p.crc32c:
            return f"{where[key]}: crc32c mismatch in bytes {p.offset}..{p.offset + p.nbytes}"
        return None

    parts_ = list(views)
    if threads <= 1 or len(pieces) <= 1:
        for piece in pieces:
            read(piece)
        why = [check(p) for p in parts_]
    else:
        with concurrent.futures.ThreadPoolExecutor(min(threads, len(pieces)), thread_name_prefix="bytecp-serving") as ex:
            list(ex.map(read, pieces))
            why = list(ex.map(check, parts_))
    got: dict[Part, memoryview] = {}
    bad: dict[Part, str] = {}
    for p, w in zip(parts_, why, strict=True):
        if w is None:
            got[p] = views[p]
        else:
            bad[p] = w
    chain.bytes_read += sum(len(into) for key, _, _, into in pieces if key not in failed)
    return got, bad

