"""(run on the 4-rank pool by test_skeleton_specs.py) Ranks whose state
trees differ in kinds: rank 0 holds kind ``a``, ranks 1 and 3 kind ``b``,
rank 2 kind ``c``; each kind has a tensor and a value of its own beside a
tensor every rank holds."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import bytecp

KINDS = ("a", "b", "c", "b")


def kind_state(kind: str, fill: float | None = None) -> dict[str, Any]:
    """The state of a rank of ``kind`` (``fill``: zeros or another value, to load into)."""
    t = torch.arange(5, dtype=torch.float32) + 10 * ord(kind)
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    if fill is not None:
        t, w = torch.full_like(t, fill), torch.full_like(w, fill)
    return {"shared": {"w": w}, f"kind_{kind}": {"t": t, "n": {"kind": kind, "ord": ord(kind)}}}


def save_kinds(url: str) -> dict[str, Any]:
    """(every rank) Save the rank's kind, then load it back into a state of
    the same kind: whether it came back bitwise, how often this rank sent
    its skeleton and specs at commit, and (rank 0) the whole checkpoint."""
    from bytecp.plan.exchange import PLAN_STATS

    r = dist.get_rank()
    kind = KINDS[r]
    before = PLAN_STATS.specs_sent
    md = bytecp.save(url, kind_state(kind))
    sent = PLAN_STATS.specs_sent - before
    dist.barrier()
    into = kind_state(kind, fill=-1.0)
    bytecp.load(url, into, strict=False)  # (the other kinds are in the checkpoint too)
    want = kind_state(kind)
    same = torch.equal(into["shared"]["w"], want["shared"]["w"]) and \
        torch.equal(into[f"kind_{kind}"]["t"], want[f"kind_{kind}"]["t"]) and \
        into[f"kind_{kind}"]["n"] == want[f"kind_{kind}"]["n"]
    return {"sent": sent, "same": same, "tensors": sorted(md.tensors),
            "state": bytecp.load_state_dict(url) if r == 0 else None}


def save_again(url: str) -> dict[str, Any]:
    """(every rank) Save the ranks' kinds twice, then again after rank 2's
    tensor changed shape and rank 3 changed kind: how often this rank sent
    its skeleton at each save, whether the coordinator's second commit
    reused the first one's union of the skeletons (the same objects), and
    (rank 0) the second and third checkpoints whole."""
    from bytecp.plan.exchange import PLAN_STATS

    def kind(k: str) -> dict[str, Any]:  # (a tree no other case saves: the pool's coordinator keeps none for it)
        return kind_state(k) | {"again": {"n": 1}}

    r = dist.get_rank()
    sent = [PLAN_STATS.specs_sent]
    first = bytecp.save(f"{url}/1", kind(KINDS[r]))
    sent.append(PLAN_STATS.specs_sent)
    second = bytecp.save(f"{url}/2", kind(KINDS[r]))
    sent.append(PLAN_STATS.specs_sent)
    state = kind("d" if r == 3 else KINDS[r])
    if r == 2:
        state["kind_c"]["t"] = torch.arange(7, dtype=torch.float64)
    third = bytecp.save(f"{url}/3", state)
    sent.append(PLAN_STATS.specs_sent)
    dist.barrier()
    return {"sent": [b - a for a, b in zip(sent, sent[1:], strict=False)],
            "reused": second.tensors is first.tensors and second.skeleton is first.skeleton,
            "rebuilt": third.tensors is not second.tensors,
            "second": bytecp.load_state_dict(f"{url}/2") if r == 0 else None,
            "third": bytecp.load_state_dict(f"{url}/3") if r == 0 else None}


def save_outcome(url: str) -> dict[str, Any]:
    """(every rank) Save the ranks' kinds with every state counted large
    (bytecp.saving.outcome): what ``save()`` returned on each rank, and its
    large members, read when first asked for."""
    from bytecp.format import member_text

    large, member_text.LARGE_STATE = member_text.LARGE_STATE, 0
    try:
        md = bytecp.save(url, kind_state(KINDS[dist.get_rank()]))
    finally:
        member_text.LARGE_STATE = large
    lazy = type(md).__name__
    dist.barrier()
    return {"type": lazy, "unread": "tensors" not in md.__dict__, "save_id": md.save_id,
            "tensors": sorted(md.tensors), "files": len(md.data_files), "skeleton": md.skeleton.to_json()}


def save_disagreeing(url: str) -> dict[str, Any]:
    """(every rank) Save the ranks' kinds with rank 2's shared tensor of
    another shape: what each rank's save raised, and what the directory
    holds after."""
    import os

    state = kind_state(KINDS[dist.get_rank()])
    if dist.get_rank() == 2:
        state["shared"]["w"] = torch.zeros(4, 3)
    try:
        bytecp.save(url, state)
        raised = ""
    except Exception as e:
        raised = f"{type(e).__name__}: {e}"
    dist.barrier()
    return {"raised": raised, "left": sorted(os.listdir(url)) if os.path.isdir(url) else []}


def save_union_fault(url: str) -> dict[str, Any]:
    """(every rank) Save the ranks' kinds with rank 1 failing as it sends
    its skeleton (the fault phase ``union``), then again without the fault:
    what the first save raised on each rank, what the directory held after
    it, and whether the second loads back bitwise."""
    import os

    def kind(k: str, fill: float | None = None) -> dict[str, Any]:  # (a tree no other case saves)
        return kind_state(k, fill) | {"fault": {"n": 2}}

    r = dist.get_rank()
    os.environ["BYTECP_FAULT_ERROR"] = "union:1"
    try:
        bytecp.save(f"{url}/1", kind(KINDS[r]))
        raised = ""
    except Exception as e:
        raised = f"{type(e).__name__}: {e}"
    finally:
        os.environ.pop("BYTECP_FAULT_ERROR", None)
    dist.barrier()
    left = sorted(os.listdir(f"{url}/1")) if os.path.isdir(f"{url}/1") else []
    bytecp.save(f"{url}/2", kind(KINDS[r]))
    into = kind(KINDS[r], fill=-1.0)
    bytecp.load(f"{url}/2", into, strict=False)
    want = kind(KINDS[r])
    k = f"kind_{KINDS[r]}"
    same = torch.equal(into["shared"]["w"], want["shared"]["w"]) and torch.equal(into[k]["t"], want[k]["t"]) \
        and into[k]["n"] == want[k]["n"] and into["fault"] == want["fault"]
    return {"raised": raised, "left": left, "same": same}
