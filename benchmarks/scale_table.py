"""The scale benchmark's tables (docs/benchmarks.md "Scale") from its JSON."""

from __future__ import annotations

import json
import sys
from typing import Any

__all__ = ["table", "growth"]

NAMES = {"llama": "LLaMA-7B", "moe": "MoE", "moe_fsdp": "MoE, experts FSDP"}


def _ms(s: float) -> str:
    return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.0f} ms" if s >= 0.01 else f"{s * 1e3:.1f} ms"


def _dcp(c: dict[str, Any], ref: dict[str, Any] | None) -> str:
    d = c.get("dcp")
    if d:
        return f"{_ms(d['unpickle_s'])}, {d['unpickle_peak_mb']:.0f} MB ({d['metadata_mb']:.0f} MB file)"
    if ref:
        n = c["chunks"]
        return (f"not run (~{ref['peak_mb_per_chunk'] * n / 1e3:.0f} GB, ~{ref['s_per_chunk'] * n:.0f} s, "
                f"{ref['mb_per_chunk'] * n / 1e3:.1f} GB file, extrapolated)")
    return "not run"


def _again(co: dict[str, Any]) -> str:
    """The coordinator's commit of a later save of the same state (runs before it measured only the first)."""
    again = f"{_ms(co['again_s'])}, {co['again_peak_mb']:.0f} MB " if "again_s" in co else ""
    if co.get("skeletons_sent") and "union_s" in co:  # merged at the first save's plan phase, on a thread
        again += (f"[first save's union, merged during its writes: {co['skeletons_sent']} skeletons received "
                  f"{_ms(co['union_received_s'])}, merged {_ms(co['union_s'])}, {co['union_peak_mb']:.0f} MB] ")
    if "outcome_kb" in co:  # what every other rank receives and unpickles
        again += f"[outcome to each rank: {co['outcome_kb']:.1f} kB, {_ms(co['outcome_s'])}] "
    return again


def table(results: dict[str, Any]) -> str:
    lines = ["| model | W | chunks | vote + decide (rank) | first-save share (rank) | commit part: middle rank "
             "| commit part: most loaded rank | commit: coordinator, first save; again (gathered) | metadata.json | load: middle rank "
             "(read_parts + plan_load) | load: rank with nothing | DCP `.metadata` unpickle (every rank) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    refs: dict[str, dict[str, Any]] = {}
    for world, row in results["worlds"].items():
        for name in ("llama", "moe", "moe_fsdp"):
            c = row.get(name)
            if c is None:
                continue
            refs.setdefault(name, c.get("dcp") or {})
            sp, cr, co, ld = c["save_plan"], c["commit_rank"], c["coordinator"], c["load"]
            mid, top = cr["middle"], cr["most_loaded"]
            lm = ld["middle"]
            if ld.get("written"):
                load = (f"{_ms(lm['s'])}, {lm['peak_mb']:.1f} MB; {lm['rows']} rows, {lm['segments_read']} segments "
                        f"of {lm['parts_read']} parts")
                nothing = _ms(ld["nothing"]["s"])
                md = f"{co['metadata_mb']:.1f} MB, parse {_ms(ld['metadata_parse_s'])}, {ld['metadata_parse_peak_mb']:.0f} MB"
            else:
                load = (f"not run: would read {lm['rows']:,} rows, {lm['segments']:,} segments of {lm['parts']:,} "
                        "parts")
                nothing, md = "–", f"{co['metadata_mb']:.1f} MB"
            lines.append(
                f"| {NAMES[name]} | {int(world):,} | {c['chunks'] / 1e6:.1f}M "
                f"| {_ms(sp['vote_s'] + sp['decide_s'])}, {max(sp['vote_peak_mb'], sp['decide_peak_mb']):.0f} MB "
                f"({sp['votes_received_bytes'] / 1e6:.1f} MB of votes) "
                f"| {_ms(sp['share_s'])}, {sp['share_peak_mb']:.0f} MB "
                f"| {_ms(mid['s'])}, {mid['peak_mb']:.1f} MB, {mid['rows']} rows, {mid['part_kb']:.0f} kB "
                f"| {_ms(top['s'])}, {top['peak_mb']:.1f} MB, {top['rows']} rows (rank {top['rank']}), "
                f"{top['part_kb']:.0f} kB "
                f"| {_ms(co['s'])}, {co['peak_mb']:.0f} MB; {_again(co)}({co['gathered_mb']:.1f} MB; {co['segments']:,} entries, "
                f"{co['wide_segments']:,} wide) "
                f"| {md} | {load} | {nothing} | {_dcp(c, refs.get(name))} |")
    return "\n".join(lines)


def growth(results: dict[str, Any], name: str) -> dict[str, float]:
    """Per step, its value at the largest world over the smallest (time; memory)."""
    worlds = [w for w, row in results["worlds"].items() if name in row]
    a, b = results["worlds"][worlds[0]][name], results["worlds"][worlds[-1]][name]
    pick = {
        "vote+decide s": lambda c: c["save_plan"]["vote_s"] + c["save_plan"]["decide_s"],
        "first-save share s": lambda c: c["save_plan"]["share_s"],
        "part middle s": lambda c: c["commit_rank"]["middle"]["s"],
        "part most loaded s": lambda c: c["commit_rank"]["most_loaded"]["s"],
        "part most loaded MB": lambda c: c["commit_rank"]["most_loaded"]["peak_mb"],
        "coordinator s": lambda c: c["coordinator"]["s"],
        "coordinator MB": lambda c: c["coordinator"]["peak_mb"],
        "coordinator again s": lambda c: c["coordinator"].get("again_s", c["coordinator"]["s"]),
        "union s": lambda c: c["coordinator"].get("union_s", 0.0),
        "gathered MB": lambda c: c["coordinator"]["gathered_mb"],
        "metadata.json MB": lambda c: c["coordinator"]["metadata_mb"],
    }
    return {k: f(b) / max(f(a), 1e-9) for k, f in pick.items()}


if __name__ == "__main__":
    res = json.loads(open(sys.argv[1]).read())
    print(table(res))
    for m in ("llama", "moe", "moe_fsdp"):
        if not any(m in row for row in res["worlds"].values()):
            continue
        print(m, {k: round(v, 1) for k, v in growth(res, m).items()})
