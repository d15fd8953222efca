"""The timeline picture of one checkpoint: ranks as rows, phases as coloured bars.

Called by ``bytecp monitor show --png FILE`` (and by people from Python) with
a :class:`~.aggregate.CheckpointAggregate`. What a reader sees, left to right:

* one row per rank (rank 0 on top), each phase a bar in its colour, on a
  time axis that starts when the first rank started;
* the straggler's row shaded, its label marked, its slow phase outlined and
  annotated with its seconds against the other ranks' median;
* under each row, a dark line while that rank's training was blocked by
  the call (for an asynchronous save, only its start), and on the right the
  stall of each rank as a bar, since that is the figure that costs training
  time;
* a title with the operation, step, job, ranks, bytes, duration, throughput.

Colours are the Okabe-Ito palette (safe for colour-blind readers); the
vermillion is kept for the straggler marks only. Renders with matplotlib's
Agg backend, no display needed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .aggregate import CheckpointAggregate
from .table import format_size, ordered_phases

__all__ = ["render_timeline", "TimelineLayout", "PHASE_COLOURS", "STRAGGLER_COLOUR"]

PHASE_COLOURS: dict[str, str] = {
    "wait_previous": "#BBBBBB",
    "lazy_wait": "#666666",
    "plan": "#E69F00",
    "stage": "#56B4E9",
    "write": "#0072B2",
    "commit": "#009E73",
    "read_metadata": "#F0E442",
    "read": "#0072B2",
    "apply": "#CC79A7",
}
_EXTRA_COLOURS = ("#000000", "#8C564B", "#7F7F7F", "#BCBD22", "#17BECF")
STRAGGLER_COLOUR = "#D55E00"
_STALL_COLOUR = "#404040"
_WAIT_COLOUR = "#8a8a8a"


@dataclasses.dataclass(frozen=True)
class TimelineLayout:
    """Where things landed in the PNG (pixels, origin top-left), for checks."""

    width: int
    height: int
    row_y: dict[int, int]
    """Pixel row of the middle of each rank's bar row."""
    x_of: tuple[float, float, float]
    """``(x0_pixel, pixels_per_second, t0)``: a time t is at x0 + (t - t0) * scale."""
    colours: dict[str, str]
    """Phase -> colour used."""
    straggler: int | None


def _colour(phase: str, extra: dict[str, str]) -> str:
    if phase in PHASE_COLOURS:
        return PHASE_COLOURS[phase]
    if phase not in extra:
        extra[phase] = _EXTRA_COLOURS[len(extra) % len(_EXTRA_COLOURS)]
    return extra[phase]


def render_timeline(agg: CheckpointAggregate, path: str | Path, *, dpi: int = 110) -> TimelineLayout:
    """Draw ``agg`` to the PNG at ``path``; returns where rows and times landed."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib import pyplot as plt
    from matplotlib.collections import LineCollection, PolyCollection
    from matplotlib.patches import Patch

    ranks = list(range(agg.world_size)) or sorted(agg.reports)
    n = len(ranks)
    phases = ordered_phases(agg)
    extra: dict[str, str] = {}
    colours = {p: _colour(p, extra) for p in phases}
    st = agg.straggler()
    straggler = st.rank if st is not None and agg.world_size > 1 else None
    t0 = agg.started
    span_end = max(agg.duration, 1e-3)

    row_in = 0.42 if n <= 16 else max(0.08, 6.5 / n)
    height_in = min(2.4 + row_in * n, 24.0)
    fig = plt.figure(figsize=(13.0, height_in), dpi=dpi)
    top = 1.0 - 1.35 / height_in
    bottom = 0.75 / height_in
    grid = fig.add_gridspec(1, 2, width_ratios=(5.2, 1.0), left=0.085, right=0.975, top=top, bottom=bottom, wspace=0.04)
    ax = fig.add_subplot(grid[0, 0])
    ax_stall = fig.add_subplot(grid[0, 1], sharey=ax)

    ax.set_ylim(n - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(0, span_end * 1.04)
    row_of = {r: i for i, r in enumerate(ranks)}
    bar_h = 0.72 if n <= 64 else 0.9

    if straggler is not None and straggler in row_of:
        half = max(0.5, n / 300)  # stays visible when rows are thinner than a pixel
        for a in (ax, ax_stall):
            a.axhspan(row_of[straggler] - half, row_of[straggler] + half, color=STRAGGLER_COLOUR, alpha=0.12, lw=0)

    # One collection per phase (not one artist per bar): thousands of ranks draw in seconds.
    boxes: dict[str, list[list[tuple[float, float]]]] = {p: [] for p in phases}
    slow_boxes: list[list[tuple[float, float]]] = []
    waits: list[list[tuple[float, float]]] = []
    blocked: list[list[tuple[float, float]]] = []
    for r in ranks:
        y = row_of[r]
        rep = agg.reports.get(r)
        if rep is None:
            if n <= 64:
                ax.text(span_end * 0.01, y, "no report", va="center", ha="left", color="#777777", fontsize=9, style="italic")
            continue
        # the whole call as a thin line: gaps between phases are waits on other ranks
        waits.append([(rep.started - t0, y), (rep.ended - t0, y)])
        lo, hi = y - bar_h / 2, y + bar_h / 2
        # training blocked: the call itself (stall less lazy-mode waits, drawn as their own phase)
        in_call = rep.stall_seconds - sum(sp.duration for sp in rep.spans if sp.phase == "lazy_wait")
        if in_call > 0:
            end = min(rep.started + in_call, rep.ended) - t0
            blocked.append([(rep.started - t0, hi + 0.07), (end, hi + 0.07)])
        for s in rep.spans:
            x = s.start - t0
            w = max(s.duration, span_end * 0.002)  # keep very short phases visible
            box = [(x, lo), (x + w, lo), (x + w, hi), (x, hi)]
            boxes[s.phase].append(box)
            if straggler == r and st is not None and s.phase == st.phase:
                slow_boxes.append(box)
    ax.add_collection(LineCollection(waits, colors=_WAIT_COLOUR, linewidths=1.2 if n <= 64 else 0.5, zorder=1))
    if n <= 64:
        ax.add_collection(LineCollection(blocked, colors=_STALL_COLOUR, linewidths=2.6, zorder=2, capstyle="butt"))
    edge = 0.4 if n <= 64 else 0.0
    for phase, polys in boxes.items():
        ax.add_collection(PolyCollection(polys, facecolors=colours[phase], edgecolors="white", linewidths=edge, zorder=2))
    if slow_boxes:
        ax.add_collection(
            PolyCollection(slow_boxes, facecolors="none", edgecolors=STRAGGLER_COLOUR, linewidths=2.2, zorder=3)
        )
    failed = [row_of[r] for r in ranks if r in agg.reports and not agg.reports[r].ok]
    if failed and n > 64:
        ax.scatter([span_end * 1.02] * len(failed), failed, marker="x", color=STRAGGLER_COLOUR, s=12, zorder=4)

    # straggler annotation, placed after its slow phase
    if straggler is not None and st is not None and straggler in agg.reports:
        rep = agg.reports[straggler]
        slow_end = max((s.start + s.duration for s in rep.spans if s.phase == st.phase), default=rep.ended) - t0
        label = f"straggler: {st.phase} {st.seconds:.2f} s (others' median {st.median_seconds:.2f} s)"
        right_side = slow_end < span_end * 0.62
        ax.annotate(
            label,
            xy=(slow_end, row_of[straggler]),
            xytext=(12 if right_side else -12, 0),
            textcoords="offset points",
            ha="left" if right_side else "right",
            va="center",
            fontsize=9.5,
            weight="bold",
            color=STRAGGLER_COLOUR,
            bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": STRAGGLER_COLOUR, "lw": 1.0, "alpha": 0.92},
            arrowprops={"arrowstyle": "-|>", "color": STRAGGLER_COLOUR, "lw": 1.2},
            zorder=5,
        )

    # y labels: every rank when they fit, else a sample plus the straggler
    step = 1 if n <= 40 else max(1, n // 24)
    ticks = sorted({row_of[r] for r in ranks[::step]} | set(failed[:16]) | ({row_of[straggler]} if straggler is not None else set()))
    ax.set_yticks(ticks)
    labels = []
    for t in ticks:
        r = ranks[t]
        bad = r in agg.reports and not agg.reports[r].ok
        labels.append(f"FAILED rank {r}" if bad else f"rank {r}")
    ax.set_yticklabels(labels, fontsize=9 if n <= 40 else 7)
    for tick, t in zip(ax.get_yticklabels(), ticks, strict=True):
        if ranks[t] in agg.reports and not agg.reports[ranks[t]].ok:
            tick.set_color(STRAGGLER_COLOUR)
        if ranks[t] == straggler:
            tick.set_color(STRAGGLER_COLOUR)
            tick.set_fontweight("bold")
    ax.set_xlabel("seconds since the first rank started")
    ax.grid(axis="x", color="#dddddd", lw=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)

    # stall panel
    stalls = [agg.reports[r].stall_seconds if r in agg.reports else 0.0 for r in ranks]
    ax_stall.barh(
        range(n),
        stalls,
        height=bar_h * 0.8,
        color=_STALL_COLOUR,
    )
    max_stall = max(stalls, default=0.0)
    ax_stall.set_xlim(0, max(max_stall * 1.35, 1e-3))
    if n <= 40:
        for i, v in enumerate(stalls):
            if ranks[i] in agg.reports:
                ax_stall.text(v, i, f" {v:.2f} s", va="center", ha="left", fontsize=8, color="#222222")
    ax_stall.set_xlabel("stall (s)\ntraining blocked")
    ax_stall.tick_params(axis="y", left=False, labelleft=False)
    ax_stall.grid(axis="x", color="#dddddd", lw=0.6)
    ax_stall.set_axisbelow(True)
    for side in ("top", "right"):
        ax_stall.spines[side].set_visible(False)

    # title and legend
    step_s = "" if agg.step is None else f" at step {agg.step}"
    state = "" if agg.ok else "  —  FAILED"
    title = (
        f"{agg.key.operation}{step_s}, job {agg.key.job}: {len(agg.reports)}/{agg.world_size} ranks, "
        f"{format_size(agg.nbytes)} in {agg.duration:.2f} s ({format_size(agg.throughput)}/s), "
        f"max stall {agg.max_stall_seconds:.2f} s{state}"
    )
    fig.text(0.085, 1.0 - 0.28 / height_in, title, fontsize=11.5, weight="bold", va="top")
    sub = agg.url
    if straggler is not None and st is not None:
        sub = (
            f"straggler: rank {st.rank}, {st.phase} took {st.seconds:.2f} s vs median {st.median_seconds:.2f} s, "
            f"finished {st.lag_seconds:.2f} s after the other ranks' median   |   {agg.url}"
        )
    fig.text(0.085, 1.0 - 0.58 / height_in, sub, fontsize=9, color=STRAGGLER_COLOUR if straggler is not None else "#333333", va="top")
    from matplotlib.lines import Line2D

    handles: list[Patch | Line2D] = [Patch(facecolor=colours[p], label=p) for p in phases]
    handles.append(Line2D([], [], color=_WAIT_COLOUR, lw=1.2, label="no phase (waiting for other ranks)"))
    if n <= 64:
        handles.append(Line2D([], [], color=_STALL_COLOUR, lw=2.6, label="training blocked (stall)"))
    if straggler is not None:
        handles.append(Patch(facecolor="white", edgecolor=STRAGGLER_COLOUR, lw=2, label="straggler's slow phase"))
    ax.legend(
        handles=handles,
        loc="lower left",
        bbox_to_anchor=(0.0, 1.0),
        ncol=min(len(handles), 8),
        frameon=False,
        fontsize=9,
        handlelength=1.4,
        columnspacing=1.2,
        borderaxespad=0.25,
    )

    fig.canvas.draw()
    width, height = fig.canvas.get_width_height()
    row_y = {r: int(round(height - ax.transData.transform((0, row_of[r]))[1])) for r in ranks}
    x0 = ax.transData.transform((0, 0))[0]
    x1 = ax.transData.transform((1, 0))[0]
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return TimelineLayout(
        width=width,
        height=height,
        row_y=row_y,
        x_of=(float(x0), float(x1 - x0), t0),
        colours=colours,
        straggler=straggler,
    )
