"""Ranks a save apart come back into step: the plan votes name the step.

Called by the plan phase (:meth:`bytecp.saving.pipeline.SavePipeline.plan`)
on every rank right after its all-gather of votes, before
:func:`~bytecp.plan.decide.decide`.

How ranks get a save apart: collectives pair up in the order ranks call
them, and after a stall the ranks need not agree on which save a collective
belongs to. The coordinator stopped between its commit's gather and its
broadcast commits once it continues, while the others gave up at the
deadline and replaced the checkpoint group; the next save of the others
then waits for the coordinator in the new group, which the coordinator
joins only after its own next save failed on the old one: from then on
every vote of save ``n`` meets the coordinator's of save ``n + 1``. A job
whose ranks run collectives of their own between saves (a data-parallel
step) falls back into step by itself; a job that only saves does not (found
by the chaos run: every later save failed until the job restarted).

The votes carry each rank's ``step`` (``save(step=)``; the manager always
gives it). When their targets differ and every rank gave a step, a rank
whose step is below the highest skips this save (its error names the rank
ahead; nothing is written), and the ranks at the highest step vote again
with the same vote, which meets the late ranks' votes of their next save:
once every target agrees the save goes on as if nothing happened, and the
ranks number their context alike again (:meth:`DistContext.adopt`). The
ranks ahead wait no longer than the save's deadline. Steps are trusted as
labels of the same training state on every rank, as the save's target
already is. Without steps (or with different targets at the same step)
:func:`~bytecp.plan.decide.decide` refuses the save on every rank, as
before.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from bytecp.dist import DistContext
from bytecp.errors import DistributedCheckpointError
from bytecp.plan.votes import VoteTable

__all__ = ["in_step"]

log = logging.getLogger("bytecp")


def in_step(ctx: DistContext, votes: Sequence[bytes], mine: bytes) -> VoteTable:
    """(every rank, after the plan all-gather) The table of ``votes`` when
    every rank names the same target (or when steps cannot realign them:
    ``decide`` refuses); else wait, voting ``mine`` again, until the ranks
    behind reach this rank's step (the table of the votes then), or raise on
    a rank that is behind. Once they agree, every rank numbers its context
    alike (the highest)."""
    table = VoteTable.of(votes)
    rounds = 0
    while table.targets_differ().size:
        tails = [table.tail_of(r) for r in range(len(table.votes))]  # (O(W) JSON: only when ranks are apart)
        steps = [t[3] for t in tails]
        if any(type(s) is not int for s in steps):
            return table
        top = max(steps)
        ahead = [r for r, s in enumerate(steps) if s == top]
        if len({tails[r][2] for r in ahead}) > 1:
            return table
        if steps[ctx.rank] < top:
            raise DistributedCheckpointError("save/plan", {ctx.rank: (
                f"a save behind: saving step {steps[ctx.rank]} ({tails[ctx.rank][2]}) while rank {ahead[0]} "
                f"saves step {top} ({tails[ahead[0]][2]}); this save is skipped (nothing was written) and the "
                "ranks ahead wait for this rank's save of their step")})
        behind = [r for r, s in enumerate(steps) if s < top]
        log.warning("bytecp: rank %d waits for rank(s) %s, a save behind, to save step %d (%s)", ctx.rank,
                    ", ".join(map(str, behind[:8])) + (" ..." if len(behind) > 8 else ""), top, tails[ctx.rank][2])
        table = VoteTable.of(ctx.all_gather("save/plan", lambda: mine))
        rounds += 1
    contexts = table.heads["context"]
    if rounds or contexts.min() != contexts.max():
        ctx.adopt(int(contexts.max()), 1)
    return table
