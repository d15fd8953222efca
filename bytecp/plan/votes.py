"""A plan vote as flat bytes, and every rank's votes as NumPy columns.

Called by :mod:`bytecp.plan.exchange`: every rank encodes its
:class:`PlanVote` (:meth:`PlanVote.encode`) inside the save plan phase's
all-gather, which then carries W short byte strings instead of W pickled
objects; :func:`~bytecp.plan.decide.decide` reads them all at once as
columns (:meth:`VoteTable.of`), never as W Python objects, and the
pipeline reads the coordinator's in full (:func:`read_vote`).

Layout (little-endian): a fixed header (:data:`HEADER`: flags, the number
of replica sets, own bytes, five 16-byte digests, the rank's context number), one fixed entry per
replica set (:data:`SET_ENTRY`: the set's 12-byte key, its size, the
16-byte fingerprint of its boxes), then a short JSON tail (the save id and
object names, the coordinator's; the target; the step; the specs keys of
the unions of skeletons the coordinator keeps). Digests given as 32 hex
digits are stored as their 16 bytes (and read back as the same hex);
any other text (a test's ``"s"``) is hashed to 16 bytes first, which keeps
comparisons exact. Replica-set keys are :attr:`ReplicaSet.key
<bytecp.tree.state.ReplicaSet.key>`: 24 hex digits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["PlanVote", "VoteTable", "read_vote", "digest16", "key_text", "HEADER", "SET_ENTRY", "CACHED", "UNKNOWN",
           "FIXED", "OWN"]

#: the fixed part of every encoded vote
HEADER = np.dtype([
    ("version", "u1"), ("flags", "u1"), ("nsets", "<u4"), ("own_bytes", "<i8"),
    ("fingerprint", "V16"), ("cached_for", "V16"), ("skeleton", "V16"), ("own_fp", "V16"), ("target", "V16"),
    ("tail", "<u4"), ("context", "<u4"),
])
#: one replica set the voting rank is in (its 12-byte key padded with zeros to 16)
SET_ENTRY = np.dtype([("key", "V16"), ("size", "<u4"), ("fp", "V16")])
VERSION = 3
#: the header's flag bits: a cached plan's digest, boxes without a hint, a fixed share, own boxes
CACHED, UNKNOWN, FIXED, OWN = 1, 2, 4, 8
_HEX = frozenset("0123456789abcdef")


def digest16(text: str) -> bytes:
    """16 bytes standing for ``text``: its bytes when it is 32 lowercase hex
    digits (a blake2b digest), else a digest of it."""
    if len(text) == 32 and _HEX.issuperset(text):
        return bytes.fromhex(text)
    return hashlib.blake2b(text.encode(), digest_size=16, person=b"bytecp-vote").digest()


def _key16(key: str) -> bytes:
    if len(key) != 24 or not _HEX.issuperset(key):
        raise ValueError(f"replica set key {key!r} is not a ReplicaSet.key (24 hex digits)")
    return bytes.fromhex(key) + bytes(4)


def key_text(key: bytes) -> str:
    """A set key as :attr:`ReplicaSet.key <bytecp.tree.state.ReplicaSet.key>` spells it."""
    return key[:12].hex()


@dataclasses.dataclass(frozen=True)
class PlanVote:
    """What every rank sends in the plan phase's all-gather (O(1) in the world
    size), encoded by :meth:`encode`."""

    #: fingerprint of this rank's local plan (boxes and replica hints)
    fingerprint: str
    #: digest of the fingerprints this rank's cached plan was made for (None: no cached plan)
    cached_for: str | None
    #: digest of this rank's state skeleton and of its tensors' dtypes and
    #: shapes (when the coordinator holds no union of them, the lowest rank of
    #: each digest other than the coordinator's sends its skeleton and tensor
    #: specs at the plan phase, where they are compared: bytecp.saving.union)
    skeleton: str
    #: the coordinator's only: the new save's id (None on other ranks)
    save_id: str | None = None
    #: bytes of the boxes only this rank holds: every split is balanced around them
    own_bytes: int = 0
    #: per replica set this rank is in: (set key, set size, fingerprint of its boxes in the set)
    sets: tuple[tuple[str, int, str], ...] = ()
    #: whether this rank holds boxes without a replica hint
    unknown: bool = False
    #: the coordinator's only: the names of the non-tensor values it writes
    #: (a rank whose state tree differs writes only the others)
    objects: tuple[str, ...] = ()
    #: fingerprint of the boxes only this rank holds ("": none): ranks whose
    #: own boxes are the same are replicas their hints do not name
    own_fp: str = ""
    #: this rank writes a cached share as it is (an async snapshot copied it)
    fixed: bool = False
    #: the last part of the URL this rank saves to (``step-18``; mount points may
    #: differ between nodes): ranks whose targets differ are in different
    #: saves (one missed a deadline and is a save behind): ``decide`` refuses
    target: str = ""
    #: the training step this rank saves (``save(step=)``; None: not given):
    #: ranks in different saves realign by it (:mod:`bytecp.saving.resync`)
    step: int | None = None
    #: the number of this rank's distributed context (``DistContext.uid``)
    context: int = 0
    #: the coordinator's only: the specs keys of the unions of skeletons it
    #: keeps from its last commits; when the decision's key is one of them,
    #: no rank sends its skeleton (:mod:`bytecp.saving.union`)
    unions: tuple[str, ...] = ()

    def encode(self) -> bytes:
        """(every rank, inside the plan all-gather) The vote as flat bytes (see the module)."""
        flags = ((CACHED if self.cached_for is not None else 0) | (UNKNOWN if self.unknown else 0)
                 | (FIXED if self.fixed else 0) | (OWN if self.own_fp else 0))
        tail = json.dumps([self.save_id, list(self.objects), self.target, self.step, list(self.unions)],
                          separators=(",", ":")).encode()
        head = np.zeros(1, HEADER)
        head[0] = (VERSION, flags, len(self.sets), self.own_bytes, digest16(self.fingerprint),
                   digest16(self.cached_for) if self.cached_for is not None else bytes(16),
                   digest16(self.skeleton), digest16(self.own_fp) if self.own_fp else bytes(16),
                   digest16(self.target), len(tail), self.context)
        sets = np.zeros(len(self.sets), SET_ENTRY)
        for i, (key, size, fp) in enumerate(self.sets):
            sets[i] = (_key16(key), size, digest16(fp))
        return head.tobytes() + sets.tobytes() + tail


def read_vote(data: bytes) -> PlanVote:
    """(every rank, on the coordinator's vote; tests) One encoded vote in
    full. Digests come back as 32 hex digits (text that was hashed comes back
    as its hash); ``cached_for`` as None when absent."""
    head = np.frombuffer(data, HEADER, 1)[0]
    n = int(head["nsets"])
    sets = np.frombuffer(data, SET_ENTRY, n, HEADER.itemsize)
    save_id, objects, target, step, unions = json.loads(data[len(data) - int(head["tail"]):])
    flags = int(head["flags"])
    return PlanVote(
        bytes(head["fingerprint"]).hex(), bytes(head["cached_for"]).hex() if flags & CACHED else None,
        bytes(head["skeleton"]).hex(), save_id, int(head["own_bytes"]),
        tuple((key_text(bytes(s["key"])), int(s["size"]), bytes(s["fp"]).hex()) for s in sets),
        bool(flags & UNKNOWN), tuple(objects), bytes(head["own_fp"]).hex() if flags & OWN else "",
        bool(flags & FIXED), target, step, int(head["context"]), tuple(unions))


@dataclasses.dataclass(frozen=True)
class VoteTable:
    """Every rank's encoded vote as columns (``heads``: one :data:`HEADER`
    row per rank; ``sets``: every set entry, in rank order, with the rank
    that voted it in ``set_rank``). Built by :meth:`of`: two copying passes
    over the votes, no object per vote kept."""

    votes: Sequence[bytes]
    heads: np.ndarray
    sets: np.ndarray
    set_rank: np.ndarray

    @staticmethod
    def of(votes: Sequence[bytes]) -> VoteTable:
        """(every rank, after the plan all-gather) The columns of ``votes``:
        each vote's header, then its set entries, copied into one buffer each."""
        width, entry = HEADER.itemsize, SET_ENTRY.itemsize
        raw = bytearray(len(votes) * width)
        view = memoryview(raw)
        try:
            for i, v in enumerate(votes):
                view[i * width:(i + 1) * width] = v[:width]
        except ValueError:  # (a vote shorter than a header)
            raise ValueError("a plan vote that is not one was received") from None
        heads = np.frombuffer(raw, HEADER)
        if len(heads) and (heads["version"] != VERSION).any():
            raise ValueError("a plan vote of another bytecp version (or not a plan vote) was received")
        counts = heads["nsets"].astype(np.int64)
        raw = bytearray(int(counts.sum()) * entry)
        view, at = memoryview(raw), 0
        for v, n in zip(votes, (counts * entry).tolist(), strict=True):
            if n:
                view[at:at + n] = v[width:width + n]
                at += n
        set_rank = np.repeat(np.arange(len(votes), dtype=np.int32), counts)
        return VoteTable(votes, heads, np.frombuffer(raw, SET_ENTRY), set_rank)

    def column16(self, name: str) -> np.ndarray:
        """A 16-byte digest column as a contiguous ``V16`` array (one per rank)."""
        return np.ascontiguousarray(self.heads[name])

    def set_column16(self, name: str) -> np.ndarray:
        """A 16-byte column of the set entries (``key``, ``fp``) as a contiguous ``V16`` array."""
        return np.ascontiguousarray(self.sets[name])

    def flag(self, bit: int) -> np.ndarray:
        """Whether each rank's vote has ``bit`` set."""
        return (self.heads["flags"] & bit) != 0

    def tail_of(self, rank: int) -> list[Any]:
        """A rank's JSON tail: [save id, objects, target, step, unions] (read
        one rank at a time: error texts and ranks in different saves only)."""
        data = self.votes[rank]
        return list(json.loads(data[len(data) - int(self.heads["tail"][rank]):]))

    def targets_differ(self) -> np.ndarray:
        """The ranks whose target is not rank 0's (empty: one save on every rank)."""
        targets = self.column16("target")
        return np.flatnonzero(targets != targets[0])

    def target_of(self, rank: int) -> str:
        """The target a rank's vote names."""
        return str(self.tail_of(rank)[2])
