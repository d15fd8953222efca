"""Aggregation, targets, table, JSON and the PNG of blocking and total times.

Every figure of a case is the median over repeats of the slowest rank (the
job waits for it). Bytes written are per rank from the last repeat; peak RSS
is the largest rise over the level at the start of the case, over ranks and
repeats.
"""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["aggregate", "targets", "table", "plot"]

GB = 1e9


def _case_summary(records: list[dict[str, Any]], world: int) -> dict[str, Any]:
    by_repeat: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        by_repeat.setdefault(r["repeat"], []).append(r)
    errors = sorted({f"rank {r['rank']}: {r['error']}" for r in records if "error" in r})
    good = [rs for rs in by_repeat.values() if len(rs) == world and not any("error" in r for r in rs)]
    out: dict[str, Any] = {"repeats": len(good)}
    if errors:
        out["errors"] = errors[:4]
    if not good:
        out["status"] = "failed" if errors else "not run"
        return out
    out["status"] = "ok"
    for key in ("blocking_s", "total_s", "call_s", "step_wait_s", "compute_s"):
        vals = [max(r[key] for r in rs) for rs in good if all(key in r for r in rs)]
        if vals:
            out[key] = statistics.median(vals)
            out[key + "_all"] = vals
    last = max(by_repeat)
    if all("bytes_written" in r for r in by_repeat[last]):
        per = [0] * world
        for r in by_repeat[last]:
            per[r["rank"]] = r["bytes_written"] or 0
        out["bytes_per_rank"] = per
        out["bytes_total"] = sum(per)
        if out.get("total_s"):
            out["write_gbps"] = sum(per) / out["total_s"] / GB
    rss = [0] * world
    for rs in good:
        for r in rs:
            rss[r["rank"]] = max(rss[r["rank"]], r.get("rss_peak_delta", 0))
    out["rss_peak_delta_per_rank"] = rss
    over: list[int | None] = [None] * world
    for rs in good:  # the least over repeats: memory other cases left behind only adds
        for r in rs:
            v = r.get("rss_over_train")
            if v is not None:
                over[r["rank"]] = v if over[r["rank"]] is None else min(over[r["rank"]], v)
    out["rss_over_train_per_rank"] = over
    ver = [r.get("verified") for rs in good for r in rs]
    if any(v is not None for v in ver):
        out["verified"] = all(v is not False for v in ver)
    return out


def aggregate(group: dict[str, Any]) -> dict[str, Any]:
    """One group's per-case summaries from its ranks' raw records."""
    world = group["world_size"]
    ranks = group["ranks"]
    records = [rec for r in ranks for rec in r.get("records", [])]
    cases: dict[str, Any] = {}
    for name in group["cases"]:
        cases[name] = _case_summary([r for r in records if r["case"] == name], world)
    for name, why in group.get("unavailable", {}).items():
        cases[name] = {"status": why}
    state = [r.get("state_bytes") for r in ranks]
    out = {"label": group["label"], "framework": group["framework"], "world_size": world,
           "state_bytes_per_rank": state, "cases": cases,
           "build_s": max((r.get("build_s") or 0) for r in ranks)}
    errs = sorted({f"rank {r['rank']}: {r['error']}" for r in ranks if "error" in r})
    if errs:
        out["errors"] = errs
    return out


def _get(groups: dict[str, Any], label: str, case: str, key: str) -> float | None:
    c = groups.get(label, {}).get("cases", {}).get(case, {})
    v = c.get(key)
    return v if isinstance(v, (int, float)) else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(groups: dict[str, Any]) -> list[dict[str, Any]]:
    """bytecp / DCP for every pair of comparable cases in each group."""
    pairs = [
        ("bytecp.save", "dcp.save", "total_s"),
        ("bytecp.async_save", "dcp.async_save thread", "blocking_s"),
        ("bytecp.async_save", "dcp.async_save thread reused stager", "blocking_s"),
        ("bytecp.async_save", "dcp.async_save process", "blocking_s"),
        ("bytecp.async_save", "dcp.async_save thread", "total_s"),
        ("bytecp.async_save", "dcp.async_save thread reused stager", "total_s"),
        ("bytecp.async_save lazy", "dcp.async_save thread reused stager", "blocking_s"),
        ("bytecp.load warm", "dcp.load warm", "total_s"),
        ("bytecp.load cold", "dcp.load cold", "total_s"),
    ]
    out = []
    for label in groups:
        for a, b, key in pairs:
            r = _ratio(_get(groups, label, a, key), _get(groups, label, b, key))
            if r is not None:
                out.append({"group": label, "bytecp": a, "dcp": b, "figure": key, "ratio": r})
    return out


def _target(name: str, value: float | None, limit: float, *, at_most: bool = True,
            unit: str = "x", note: str = "") -> dict[str, Any]:
    if value is None:
        return {"target": name, "status": "n/a", "limit": limit, "note": note}
    met = value <= limit if at_most else value >= limit
    return {"target": name, "value": value, "limit": limit, "unit": unit,
            "relation": "<=" if at_most else ">=", "status": "met" if met else "missed",
            "by": (value / limit) if limit else None, "note": note}


def targets(groups: dict[str, Any], disk: dict[str, Any], main: str, world: int) -> list[dict[str, Any]]:
    """The issue's targets, checked against this run's figures."""
    g = lambda lbl, c, k: _get(groups, lbl, c, k)  # noqa: E731
    t: list[dict[str, Any]] = []
    b_async = g(main, "bytecp.async_save", "blocking_s")
    t.append(_target(f"{main}: async blocking / DCP async reused stager", _ratio(b_async, g(main, "dcp.async_save thread reused stager", "blocking_s")), 0.5))
    t.append(_target(f"{main}: async blocking / DCP async default", _ratio(b_async, g(main, "dcp.async_save thread", "blocking_s")), 0.1))
    t.append(_target(f"{main}: lazy blocking", g(main, "bytecp.async_save lazy", "blocking_s"), 0.05, unit="s"))
    save_bw = _get(groups, main, "bytecp.save", "write_gbps")
    dd = max([v for v in (disk.get("write_fdatasync_gbps"), disk.get("write_parallel_gbps")) if v] or [0]) or None
    t.append(_target(f"{main}: sync save bandwidth / best dd fdatasync", _ratio(save_bw, dd), 0.9, at_most=False,
                     note=f"save {save_bw or 0:.2f} GB/s, dd {dd or 0:.2f} GB/s"))
    t.append(_target(f"{main}: sync save / DCP save", _ratio(g(main, "bytecp.save", "total_s"), g(main, "dcp.save", "total_s")), 0.6))
    t.append(_target(f"{main}: warm load / DCP warm load", _ratio(g(main, "bytecp.load warm", "total_s"), g(main, "dcp.load warm", "total_s")), 0.6))
    cold = g(main, "bytecp.load cold", "total_s")
    sb = groups.get(main, {}).get("state_bytes_per_rank") or []
    cold_bw = sum(x or 0 for x in sb) / cold / GB if cold and sb else None
    rd = max([v for v in (disk.get("read_cold_gbps"), disk.get("read_cold_parallel_gbps")) if v] or [0]) or None
    t.append(_target(f"{main}: cold load bandwidth / dd cold read", _ratio(cold_bw, rd), 0.9, at_most=False,
                     note=f"load {cold_bw or 0:.2f} GB/s of state, dd {rd or 0:.2f} GB/s"))
    for lbl in [x for x in groups if x.startswith("reshard")] or (f"reshard {world}->{world + 1}", f"reshard {world}->1"):
        for temp in ("warm", "cold"):
            t.append(_target(f"{lbl}: bytecp load {temp} / same-topology load",
                             _ratio(g(lbl, f"bytecp.load {temp}", "total_s"), g(main, f"bytecp.load {temp}", "total_s")), 1.2))
    if "fsdp1" in groups:
        t.append(_target("fsdp1: save / DCP save", _ratio(g("fsdp1", "bytecp.save", "total_s"), g("fsdp1", "dcp.save", "total_s")), 0.3))
        t.append(_target("fsdp1: load / DCP load (warm)", _ratio(g("fsdp1", "bytecp.load warm", "total_s"), g("fsdp1", "dcp.load warm", "total_s")), 0.3))
    if "ddp" in groups:
        c = groups["ddp"]["cases"].get("bytecp.save", {})
        per = c.get("bytes_per_rank")
        dev = None
        if per and sum(per):
            share = sum(per) / len(per)
            dev = max(abs(x - share) / share for x in per)
        t.append(_target("ddp: largest deviation of a rank's bytes from 1/W", dev, 0.10))
        t.append(_target("ddp: async blocking / DCP async default", _ratio(g("ddp", "bytecp.async_save", "blocking_s"), g("ddp", "dcp.async_save thread", "blocking_s")), 0.3))
    c = groups.get(main, {}).get("cases", {})
    rss = (c.get("bytecp.async_save") or {}).get("rss_over_train_per_rank")
    state = max((x or 0) for x in sb) if sb else None
    mx = lambda xs: max((x for x in xs or [] if x is not None), default=None)  # noqa: E731
    t.append(_target(f"{main}: async save peak RSS over training / rank state bytes", _ratio(mx(rss), state), 1.3))
    prss = (c.get("dcp.async_save process") or {}).get("rss_over_train_per_rank")
    t.append(_target(f"{main}: async save peak RSS over training / DCP process executor's",
                     _ratio(mx(rss), mx(prss)), 0.5))
    return t


def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def table(result: dict[str, Any]) -> str:
    """The results as Markdown tables (cases, dd figures, targets)."""
    lines = ["| group | case | blocking s | total s | total range s | GB/s | GB written per rank | peak RSS rise GB | RSS over training GB | vs DCP |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    rat: dict[tuple[str, str], list[str]] = {}
    for r in result["ratios"]:
        short = "blk" if r["figure"] == "blocking_s" else "tot"
        rat.setdefault((r["group"], r["bytecp"]), []).append(
            f"{short} {r['ratio']:.2f}x {r['dcp'].removeprefix('dcp.')}")
    for label, g in result["groups"].items():
        for name, c in g["cases"].items():
            if c.get("status") != "ok":
                lines.append(f"| {label} | {name} | {c.get('status')} | | | | | | | |")
                continue
            per = c.get("bytes_per_rank")
            rss = c.get("rss_peak_delta_per_rank") or [0]
            over = [x for x in c.get("rss_over_train_per_rank") or [] if x is not None] or [0]
            vs = rat.get((label, name), [])
            tot = c.get("total_s_all") or []
            rng = f"{min(tot):.2f}-{max(tot):.2f}" if len(tot) > 1 else ""
            ok = "" if c.get("verified", True) else " (LOADED VALUES DIFFER)"
            lines.append(
                f"| {label} | {name}{ok} | {_fmt(c.get('blocking_s'))} | {_fmt(c.get('total_s'))} | {rng} | "
                f"{_fmt(c.get('write_gbps'))} | {' / '.join(_fmt(x / GB) for x in per) if per else ''} | "
                f"{_fmt(max(rss) / GB)} | {_fmt(max(over) / GB)} | {'; '.join(vs)} |")
    d = result["disk"]
    lines += ["", "| dd | GB/s |", "|---|---|"]
    for k, v in d.items():
        if k.endswith("_gbps"):
            lines.append(f"| {k.removesuffix('_gbps').replace('_', ' ')} | {_fmt(v)} |")
    lines += ["", "| target | value | limit | status |", "|---|---|---|---|"]
    for t in result["targets"]:
        val = _fmt(t.get("value"), ".3f")
        lim = f"{t.get('relation', '')} {t['limit']}{'' if t.get('unit') == 's' else 'x'}"
        if t.get("unit") == "s":
            lim += " s"
        note = f" ({t['note']})" if t.get("note") and t["status"] != "n/a" else ""
        lines.append(f"| {t['target']} | {val}{note} | {lim} | {t['status']} |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    """Horizontal bars per case: blocking time over total time, one panel per group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(lbl, [(n, c) for n, c in g["cases"].items() if c.get("status") == "ok"])
              for lbl, g in result["groups"].items()]
    groups = [(lbl, cs) for lbl, cs in groups if cs]
    if not groups:
        return
    heights = [max(1.5, 0.38 * len(cs) + 0.8) for _, cs in groups]
    fig, axes = plt.subplots(len(groups), 1, figsize=(9, sum(heights)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, (lbl, cs) in zip(axes[:, 0], groups, strict=True):
        names = [n for n, _ in cs][::-1]
        total = [c.get("total_s", 0) for _, c in cs][::-1]
        blk = [c.get("blocking_s", 0) for _, c in cs][::-1]
        colors = ["#1f77b4" if n.startswith("bytecp") else "#ff7f0e" for n in names]
        ax.barh(names, total, color=colors, alpha=0.35, label="total (durable / loaded)")
        ax.barh(names, blk, color=colors, label="blocking")
        for y, (b, tt) in enumerate(zip(blk, total, strict=True)):
            ax.text(tt, y, f" {b:.2f} / {tt:.2f} s", va="center", fontsize=7)
        ax.set_title(f"{lbl} (world {result['groups'][lbl]['world_size']}); lazy total includes one overlapped forward/backward"
                     if any("lazy" in n for n in names) else f"{lbl} (world {result['groups'][lbl]['world_size']})",
                     fontsize=9, loc="left")
        ax.tick_params(axis="y", labelsize=7)
        ax.set_xlim(0, max(total) * 1.3 if max(total) > 0 else 1)
    axes[-1, 0].set_xlabel("seconds (median of the slowest rank); solid = blocking, pale = total")
    cfg = result.get("config", {})
    fig.suptitle(f"bytecp (blue) vs torch.distributed.checkpoint (orange): {cfg.get('state_gb', '?')} GB state, "
                 f"{result.get('world_size')} ranks, gloo/CPU", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(result: dict[str, Any]) -> str:
    """The run's conditions followed by :func:`table` (for docs/benchmarks.md)."""
    cfg = result.get("config", {})
    host = result.get("host", {})
    la0 = host.get("loadavg_start") or []
    la1 = host.get("loadavg_end") or []
    head = (
        f"Run {result.get('started', '?')}: {cfg.get('params', 0) / 1e6:.1f}M parameters, "
        f"{cfg.get('state_gb', '?')} GB of parameters + Adam state, {result.get('world_size')} ranks, "
        f"{result.get('repeats')} repeats, torch {result.get('torch', '?')}, {host.get('cpus', '?')} CPUs; "
        f"whole run {result.get('wall_s', 0) / 60:.1f} min; 1-minute load average "
        f"{la0[0] if la0 else float('nan'):.1f} at start, {la1[0] if la1 else float('nan'):.1f} at end, "
        f"mean {host.get('loadavg_1m_mean', float('nan')):.1f} and max {host.get('loadavg_1m_max', float('nan')):.1f} "
        f"during the run (the benchmark's own ranks count; on this machine other jobs ran too)."
    )
    return head + "\n\n" + table(result)
