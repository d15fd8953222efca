"""Draw docs/img/architecture.png: the save and load pipelines, where each
collective happens, the threads of an async save, and the registries.

Run from the repository root: ``.venv/bin/python tools/draw_architecture.py``.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

LOCAL, COLL, REG, THREAD = "#dbe9f6", "#f6d8c4", "#e2f0d9", "#f2f2f2"


def box(ax, x, y, w, h, text, color, size=9, bold=False):  # type: ignore[no-untyped-def]
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                fc=color, ec="#555555", lw=0.8))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size,
            fontweight="bold" if bold else "normal", wrap=True)


def arrow(ax, x0, y0, x1, y1):  # type: ignore[no-untyped-def]
    ax.annotate("", xy=(x1, y1), xytext=(x0, y0), arrowprops=dict(arrowstyle="->", color="#333333", lw=1))


def pipeline(ax, phases, x0, step, width):  # type: ignore[no-untyped-def]
    """One row of phase boxes joined by arrows."""
    for i, (t, c) in enumerate(phases):
        x = x0 + i * step
        box(ax, x, 5.35, width, 1.3, t, c, 8)
        if i:
            arrow(ax, x - (step - width), 6.0, x, 6.0)


def main() -> None:
    fig, ax = plt.subplots(figsize=(13, 8.2))
    ax.set_xlim(0, 13)
    ax.set_ylim(0, 8.2)
    ax.axis("off")

    box(ax, 0.3, 7.3, 12.4, 0.6, "bytecp.api: save / async_save / load / load_state_dict  ->  SaveOptions | LoadOptions, storage, Trace, pipeline",
        THREAD, 10, True)

    # save pipeline
    ax.text(0.3, 6.85, "saving/: schedule -> SavePipeline (every rank)", fontsize=11, fontweight="bold")
    save = [("describe\nadapter -> views", LOCAL), ("plan\nALL-GATHER\n(+gather/scatter\non cache miss)", COLL),
            ("stage\nStager: views |\nreused arena", LOCAL), ("write\ndata files,\ncrc32c, index", LOCAL),
            ("commit\nGATHER; the\ncoordinator writes\nmetadata.json;\nBROADCAST", COLL)]
    pipeline(ax, save, 0.3, 1.3, 1.15)

    # load pipeline
    ax.text(6.9, 6.85, "loading/: LoadPipeline (every rank)", fontsize=11, fontweight="bold")
    load = [("open\nBROADCAST\n(coordinator:\nopen_checkpoint)", COLL), ("match\nRUN\nkeys, shapes", COLL),
            ("plan\n[ALL-GATHER:\nzero-\nredundancy]", COLL), ("read\nRUN\nranged reads\ninto targets", COLL),
            ("apply\nRUN\nadapter", COLL)]
    pipeline(ax, load, 6.9, 1.18, 1.05)

    # async threads
    ax.text(0.3, 4.75, "async_save: the threads", fontsize=11, fontweight="bold")
    box(ax, 0.3, 4.0, 1.3, 0.5, "caller (eager)", THREAD, 8, True)
    for i, t in enumerate(["describe", "snapshot\n(copy)", "return"]):
        box(ax, 1.75 + i * 1.05, 4.0, 0.95, 0.5, t, LOCAL, 8)
    box(ax, 0.3, 3.35, 1.3, 0.5, "background", THREAD, 8, True)
    for i, t in enumerate(["plan", "write", "commit", "report"]):
        box(ax, 4.9 + i * 1.05, 3.35, 0.95, 0.5, t, LOCAL if t not in ("plan", "commit") else COLL, 8)
    box(ax, 0.3, 2.7, 1.3, 0.5, "caller (lazy)", THREAD, 8, True)
    for i, t in enumerate(["describe", "return"]):
        box(ax, 1.75 + i * 1.05, 2.7, 0.95, 0.5, t, LOCAL, 8)
    box(ax, 0.3, 2.05, 1.3, 0.5, "background", THREAD, 8, True)
    for i, t in enumerate(["snapshot\n+crc32c", "plan", "write", "commit"]):
        box(ax, 3.85 + i * 1.05, 2.05, 0.95, 0.5, t, COLL if t in ("plan", "commit") else LOCAL, 8)
    ax.text(9.3, 2.2, "optimizer.step() waits in a pre-step\nhook only while the snapshot is unfinished", fontsize=8)
    ax.text(9.3, 3.45, "own gloo group: never interleaves\nwith training's collectives", fontsize=8)

    # registries
    ax.text(0.3, 1.45, "registries (the core imports nothing else of these packages)", fontsize=11, fontweight="bold")
    regs = [("bytecp.adapters\nplain, DDP, FSDP1/2, Megatron\n(adapter_api registry, entry points)", REG),
            ("bytecp.storage\nlocal, S3, HDFS, memory, fsspec\n(storage_api registry, entry points)", REG),
            ("bytecp.monitoring\nPrometheus, gRPC collector\n(recorder subscribers)", REG),
            ("dist.DistContext\nevery collective, fail-together,\ndead-rank diagnosis", COLL)]
    for i, (t, c) in enumerate(regs):
        box(ax, 0.3 + i * 3.15, 0.2, 2.95, 1.0, t, c, 9)

    for x, (label, c) in enumerate([("local to a rank", LOCAL), ("collective (all ranks)", COLL), ("registry", REG)]):
        box(ax, 9.0 + x * 1.35, 4.6, 1.25, 0.35, label, c, 7)

    fig.savefig("docs/img/architecture.png", dpi=110, bbox_inches="tight")


if __name__ == "__main__":
    main()
