"""Generate deploy/grafana/dashboards/bytecp.json (the provisioned Grafana dashboard).

Run ``python deploy/grafana/make_dashboard.py`` after changing a panel and
commit the JSON; ``tests/monitoring/test_mon_deploy.py`` fails when the
checked-in file differs from this script's output, and
``test_mon_prometheus_server.py`` evaluates every expression below against a
real Prometheus scraping a real collector, so a panel cannot use a metric
the collector does not export.

Every query reads the collector's job-level metrics
(``bytecp.monitoring.job_metrics.JOB_METRICS``). The scrape must keep the
metrics' own ``job`` label (``honor_labels: true``, see deploy/prometheus).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "dashboards" / "bytecp.json"
UID = "bytecp-checkpoints"
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'job=~"$job", operation=~"$operation"'


def target(expr: str, legend: str = "", *, instant: bool = False, table: bool = False, ref: str = "A") -> dict[str, Any]:
    t: dict[str, Any] = {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref}
    if instant:
        t["instant"] = True
        t["range"] = False
    if table:
        t["format"] = "table"
    return t


def panel(
    pid: int,
    kind: str,
    title: str,
    description: str,
    grid: tuple[int, int, int, int],
    targets: list[dict[str, Any]],
    *,
    unit: str = "short",
    options: dict[str, Any] | None = None,
    custom: dict[str, Any] | None = None,
    transformations: list[dict[str, Any]] | None = None,
    thresholds: list[tuple[float | None, str]] | None = None,
) -> dict[str, Any]:
    x, y, w, h = grid
    steps = [{"color": c, "value": v} for v, c in (thresholds or [(None, "green")])]
    p: dict[str, Any] = {
        "id": pid,
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "targets": targets,
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "custom": custom or {},
                "thresholds": {"mode": "absolute", "steps": steps},
                "color": {"mode": "thresholds" if kind in ("stat", "bargauge") else "palette-classic"},
            },
            "overrides": [],
        },
        "options": options or {},
    }
    if transformations:
        p["transformations"] = transformations
    return p


STAT_OPTS = {
    "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
    "colorMode": "value",
    "graphMode": "none",
    "textMode": "auto",
    "justifyMode": "auto",
    "orientation": "auto",
}
TS_CUSTOM = {"drawStyle": "line", "lineInterpolation": "stepAfter", "lineWidth": 2, "fillOpacity": 10, "showPoints": "auto"}
TS_OPTS = {"legend": {"displayMode": "table", "placement": "right", "calcs": ["lastNotNull", "max"]}, "tooltip": {"mode": "multi"}}


def panels() -> list[dict[str, Any]]:
    p: list[dict[str, Any]] = []
    # --- headline figures of the last checkpoint -------------------------
    p.append(panel(1, "stat", "Stall, last checkpoint",
        "Largest time any rank's training loop was blocked by the last save/load (staging, waits on the previous save, lazy-mode waits).",
        (0, 0, 4, 4), [target(f"max by (job, operation) (bytecp_job_last_stall_seconds{{{SEL}}})", "{{job}} {{operation}}")],
        unit="s", options=STAT_OPTS, thresholds=[(None, "green"), (1, "orange"), (10, "red")]))
    p.append(panel(2, "stat", "Straggler, last checkpoint",
        "The rank and phase that held the last checkpoint up: slowest in that phase against the median rank, and finished it last.",
        (4, 0, 5, 4), [target(f"bytecp_job_straggler_info{{{SEL}}}", "rank {{rank}} · {{phase}}")],
        options={**STAT_OPTS, "textMode": "name", "colorMode": "background"}, thresholds=[(None, "orange")]))
    p.append(panel(3, "stat", "Straggler lag",
        "How much later than the median rank the straggler finished its slow phase.",
        (9, 0, 3, 4), [target(f"max by (job, operation) (bytecp_job_straggler_lag_seconds{{{SEL}}})", "{{job}} {{operation}}")],
        unit="s", options=STAT_OPTS, thresholds=[(None, "green"), (1, "orange"), (10, "red")]))
    p.append(panel(4, "stat", "Throughput, last checkpoint",
        "Bytes of all ranks over the wall-clock time of the last checkpoint (first start to last end).",
        (12, 0, 4, 4), [target(f"sum by (job, operation) (bytecp_job_last_throughput_bytes_per_second{{{SEL}}})", "{{job}} {{operation}}")],
        unit="Bps", options=STAT_OPTS, thresholds=[(None, "blue")]))
    p.append(panel(5, "stat", "Failed checkpoints",
        "Checkpoints in the time range on which at least one rank failed.",
        (16, 0, 4, 4), [target(f"sum by (job, operation) (increase(bytecp_job_checkpoints_failed_total{{{SEL}}}[$__range]))", "{{job}} {{operation}}")],
        options=STAT_OPTS, thresholds=[(None, "green"), (1, "red")]))
    p.append(panel(6, "stat", "Storage retries",
        "Storage retries (throttling, 5xx, resets) summed over ranks in the time range.",
        (20, 0, 4, 4), [target(f"sum by (job, operation) (increase(bytecp_job_retries_total{{{SEL}}}[$__range]))", "{{job}} {{operation}}")],
        options=STAT_OPTS, thresholds=[(None, "green"), (1, "orange")]))
    # --- per checkpoint over time ----------------------------------------
    p.append(panel(7, "timeseries", "Stall and duration per checkpoint",
        "Each step is one checkpoint: the largest stall over ranks (what training paid) and the checkpoint's wall-clock duration.",
        (0, 4, 12, 8), [
            target(f"max by (job, operation) (bytecp_job_last_stall_seconds{{{SEL}}})", "stall {{job}} {{operation}}"),
            target(f"max by (job, operation) (bytecp_job_last_duration_seconds{{{SEL}}})", "duration {{job}} {{operation}}", ref="B"),
        ], unit="s", custom=TS_CUSTOM, options=TS_OPTS))
    p.append(panel(8, "timeseries", "Throughput per checkpoint",
        "Bytes of all ranks per second of the checkpoint's wall-clock time.",
        (12, 4, 12, 8), [target(f"sum by (job, operation) (bytecp_job_last_throughput_bytes_per_second{{{SEL}}})", "{{job}} {{operation}}")],
        unit="Bps", custom=TS_CUSTOM, options=TS_OPTS))
    # --- per rank, last checkpoint ---------------------------------------
    p.append(panel(9, "barchart", "Per-rank phase breakdown, last checkpoint",
        "Seconds each rank spent in each phase of the last checkpoint (stacked). Gaps between a rank's bar and the longest are waits on other ranks.",
        (0, 12, 16, 10), [target(f"sum by (rank, phase) (bytecp_job_rank_phase_seconds{{{SEL}}})", "", instant=True, table=True)],
        unit="s",
        options={"orientation": "horizontal", "stacking": "normal", "showValue": "never", "xField": "rank",
                 "legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        custom={"fillOpacity": 90, "lineWidth": 0},
        transformations=[{"id": "groupingToMatrix", "options": {"columnField": "phase", "rowField": "rank", "valueField": "Value"}},
                         {"id": "convertFieldType", "options": {"conversions": [{"targetField": "rank\\phase", "destinationType": "string"}]}},
                         {"id": "organize", "options": {"renameByName": {"rank\\phase": "rank"}}}]))
    p.append(panel(10, "bargauge", "Stall per rank, last checkpoint",
        "How long each rank's training loop was blocked by the last checkpoint.",
        (16, 12, 8, 10), [target(f"max by (rank) (bytecp_job_rank_stall_seconds{{{SEL}}})", "rank {{rank}}", instant=True)],
        unit="s", options={"orientation": "horizontal", "displayMode": "basic", "showUnfilled": True,
                           "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
        thresholds=[(None, "green"), (1, "orange"), (10, "red")]))
    # --- stragglers and phases over time ---------------------------------
    p.append(panel(11, "timeseries", "Straggler rank per checkpoint",
        "Which rank held each checkpoint up; a rank that keeps coming back points at a slow node, disk or link.",
        (0, 22, 12, 8), [target(f"bytecp_job_straggler_rank{{{SEL}}}", "{{job}} {{operation}}")],
        custom={**TS_CUSTOM, "drawStyle": "points", "pointSize": 8}, options=TS_OPTS))
    p.append(panel(12, "timeseries", "Slowest rank per phase",
        "Per phase, the longest time any rank spent in it, per checkpoint.",
        (12, 22, 12, 8), [target(f"max by (phase) (bytecp_job_rank_phase_seconds{{{SEL}}})", "{{phase}}")],
        unit="s", custom=TS_CUSTOM, options=TS_OPTS))
    # --- failures, retries, reporting -----------------------------------
    p.append(panel(13, "timeseries", "Checkpoints, failures and retries",
        "Checkpoints completed, failed, and storage retries, per interval.",
        (0, 30, 12, 8), [
            target(f"sum by (job, operation) (increase(bytecp_job_checkpoints_total{{{SEL}}}[$__rate_interval]))", "checkpoints {{job}} {{operation}}"),
            target(f"sum by (job, operation) (increase(bytecp_job_checkpoints_failed_total{{{SEL}}}[$__rate_interval]))", "failed {{job}} {{operation}}", ref="B"),
            target(f"sum by (job, operation) (increase(bytecp_job_retries_total{{{SEL}}}[$__rate_interval]))", "retries {{job}} {{operation}}", ref="C"),
        ], custom={**TS_CUSTOM, "drawStyle": "bars", "fillOpacity": 60}, options=TS_OPTS))
    p.append(panel(14, "timeseries", "Ranks reporting",
        "Ranks whose report reached the collector for the last checkpoint, against the world size; incomplete checkpoints mean reports were dropped or ranks lost.",
        (12, 30, 12, 8), [
            target(f"max by (job, operation) (bytecp_job_last_ranks_reported{{{SEL}}})", "reported {{job}} {{operation}}"),
            target(f"max by (job, operation) (bytecp_job_last_world_size{{{SEL}}})", "world size {{job}} {{operation}}", ref="B"),
            target(f"sum by (job, operation) (increase(bytecp_job_incomplete_checkpoints_total{{{SEL}}}[$__range]))", "incomplete {{job}} {{operation}}", ref="C"),
        ], custom=TS_CUSTOM, options=TS_OPTS))
    p.append(panel(15, "timeseries", "Collector intake",
        "Reports received per second, and calls refused (bad token) or ignored (duplicates).",
        (0, 38, 24, 6), [
            target('sum by (job) (rate(bytecp_collector_reports_total{job=~"$job"}[$__rate_interval]))', "reports/s {{job}}"),
            target("sum by (reason) (increase(bytecp_collector_rejected_total[$__rate_interval]))", "rejected {{reason}}", ref="B"),
        ], custom=TS_CUSTOM, options=TS_OPTS))
    # --- the memory tier (keepers) -----------------------------------------
    keeper = 'job=~"$job"'
    p.append(panel(16, "timeseries", "Memory tier: memory held per host",
        "Bytes of memory checkpoints each host's keeper holds (its own shards and its peers' copies), against its budget.",
        (0, 44, 12, 8), [
            target(f"max by (job, host) (bytecp_keeper_memory_bytes{{{keeper}}})", "held {{job}} {{host}}"),
            target(f"max by (job, host) (bytecp_keeper_budget_bytes{{{keeper}}})", "budget {{job}} {{host}}", ref="B"),
        ], unit="bytes", custom=TS_CUSTOM, options=TS_OPTS))
    p.append(panel(17, "timeseries", "Memory tier: replication and drain lag",
        "Seconds the newest memory checkpoint spent being copied to peer hosts, and the age of the oldest drain to storage still running.",
        (12, 44, 12, 8), [
            target(f"max by (job, host) (bytecp_keeper_replication_seconds{{{keeper}}})", "replication {{job}} {{host}}"),
            target(f"max by (job, host) (bytecp_keeper_drain_lag_seconds{{{keeper}}})", "drain lag {{job}} {{host}}", ref="B"),
            target(f"sum by (job) (bytecp_keeper_drains{{{keeper}, state=\"failed\"}})", "failed drains {{job}}", ref="C"),
        ], unit="s", custom=TS_CUSTOM, options=TS_OPTS))
    p.append(panel(18, "timeseries", "Memory tier: staging arenas",
        "Arenas each host's keeper has lent to ranks now and holds free in its pool, and per interval the arenas lent, adopted as data files (single copy), copied out (a rank that writes few of the boxes it staged) and reclaimed unadopted (a save that died or dropped its arena).",
        (0, 52, 12, 8), [
            target(f"max by (job, host, state) (bytecp_keeper_arenas{{{keeper}}})", "{{state}} {{job}} {{host}}"),
            target(f"sum by (job, host, event) (increase(bytecp_keeper_arena_events_total{{{keeper}}}[$__rate_interval]))", "{{event}} {{job}} {{host}}", ref="B"),
        ], custom=TS_CUSTOM, options=TS_OPTS))
    p.append(panel(19, "timeseries", "Memory tier: bytes adopted vs written",
        "Bytes of data files each keeper stored per interval, by how they came: adopted from arenas (the rank copied them once), written by the ranks (two copies, or a host without a keeper), received from peers (replication); and the bytes of its free arena pool.",
        (12, 52, 12, 8), [
            target(f"sum by (job, host, how) (increase(bytecp_keeper_data_bytes_total{{{keeper}}}[$__rate_interval]))", "{{how}} {{job}} {{host}}"),
            target(f"max by (job, host) (bytecp_keeper_arena_pool_bytes{{{keeper}}})", "arena pool {{job}} {{host}}", ref="B"),
        ], unit="bytes", custom=TS_CUSTOM, options=TS_OPTS))
    # --- followers (evaluation and serving processes: bytecp.follow) ------------
    p.append(panel(20, "timeseries", "Followers: lag behind the run",
        "Steps and seconds from the run's newest commit to what each follower (bytecp.follow, scraped from its own "
        "Prometheus endpoint) holds, at its last update.",
        (0, 60, 12, 8), [
            target(f"max by (job, rank) (bytecp_follower_lag_seconds{{{keeper}}})", "seconds {{job}} {{rank}}"),
            target(f"max by (job, rank) (bytecp_follower_lag_steps{{{keeper}}})", "steps {{job}} {{rank}}", ref="B"),
        ], unit="s", custom=TS_CUSTOM, options=TS_OPTS))
    p.append(panel(21, "timeseries", "Followers: bytes read per update",
        "Stored bytes each follower read at its last update: only the tensors that changed (a LoRA's adapters, the "
        "trainable layers).",
        (12, 60, 12, 8), [
            target(f"max by (job, rank) (bytecp_follower_update_bytes{{{keeper}}})", "{{job}} {{rank}}"),
        ], unit="bytes", custom=TS_CUSTOM, options=TS_OPTS))
    return p


def dashboard() -> dict[str, Any]:
    return {
        "uid": UID,
        "title": "bytecp checkpoints",
        "description": "Checkpoint stall, per-rank phases, stragglers, throughput, failures and retries, from `bytecp monitor serve`.",
        "tags": ["bytecp", "checkpoint", "training"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-6h", "to": "now"},
        "annotations": {"list": []},
        "links": [],
        "templating": {
            "list": [
                {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
                 "current": {}, "hide": 0, "refresh": 1, "regex": "", "options": []},
                {"name": "job", "label": "Job", "type": "query", "datasource": DS,
                 "query": {"query": "label_values(bytecp_job_checkpoints_total, job)", "refId": "job"},
                 "definition": "label_values(bytecp_job_checkpoints_total, job)",
                 "multi": True, "includeAll": True, "allValue": ".+", "current": {}, "refresh": 2, "sort": 1,
                 "hide": 0, "regex": "", "options": []},
                {"name": "operation", "label": "Operation", "type": "custom", "query": "save,load",
                 "current": {"text": "save", "value": "save"}, "multi": True, "includeAll": True, "allValue": ".+",
                 "hide": 0, "options": []},
            ]
        },
        "panels": panels(),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, sort_keys=False) + "\n"


def main() -> int:
    OUT.write_text(render())
    print(OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
