"""Prometheus metrics of a memory-tier keeper (:mod:`bytecp.storage.keeper_server`).

(the keeper process, when started with ``--metrics-port``) A collector that
reads the keeper's ``stats`` at each scrape, so nothing runs between
scrapes. Families, labelled ``job`` (the keeper's ``--job``) and ``host``:

- ``bytecp_keeper_memory_bytes`` / ``bytecp_keeper_budget_bytes``: memory held
  by the tier on this host, and its budget (0: none);
- ``bytecp_keeper_checkpoints``: committed memory checkpoints held here;
- ``bytecp_keeper_replication_seconds``: time spent pushing the newest
  checkpoint's files to peers (the replication lag a commit waits for);
- ``bytecp_keeper_drain_lag_seconds``: age of the oldest drain to storage
  still running (0: none); ``bytecp_keeper_drains``: drains by state;
- ``bytecp_keeper_arenas{state}``: staging arenas lent to ranks now, free
  in the pool, and ``returning`` (copied out, pooled at their commit); ``bytecp_keeper_arena_pool_bytes``: the pool's bytes;
- ``bytecp_keeper_arena_events_total{event}``: arenas ``lent``, ``adopted``
  as data files, ``copied_out`` (their boxes copied into a file of their
  own), ``reclaimed`` unadopted;
- ``bytecp_keeper_data_bytes_total{how}``: bytes of data files that came
  ``adopted`` (single copy), ``written`` by the ranks, ``received`` from peers;
- ``bytecp_keeper_cpu_seconds_total``: the keeper process's CPU time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from bytecp.plugins import missing_extra

try:
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.registry import Collector
except ModuleNotFoundError as e:  # the monitoring extra
    raise missing_extra(e, "monitoring", __name__) from None

__all__ = ["KeeperCollector", "serve_keeper_metrics", "KEEPER_METRICS"]

KEEPER_METRICS = (
    "bytecp_keeper_memory_bytes", "bytecp_keeper_budget_bytes", "bytecp_keeper_checkpoints",
    "bytecp_keeper_replication_seconds", "bytecp_keeper_drain_lag_seconds", "bytecp_keeper_drains",
    "bytecp_keeper_arenas", "bytecp_keeper_arena_pool_bytes", "bytecp_keeper_arena_events_total",
    "bytecp_keeper_data_bytes_total", "bytecp_keeper_cpu_seconds_total",
)


class KeeperCollector(Collector):
    """Turns ``stats()`` (the keeper's ``stats`` answer) into gauges at each scrape."""

    def __init__(self, stats: Callable[[], dict[str, Any]], job: str) -> None:
        self.stats, self.job = stats, job

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.stats()
        labels = [self.job, str(s["name"])]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["job", "host"])
            g.add_metric(labels, value)
            return g

        yield gauge("bytecp_keeper_memory_bytes", "Bytes of memory checkpoints held on this host.", s["held_bytes"])
        yield gauge("bytecp_keeper_budget_bytes", "Memory budget of the keeper (0: none).", s["budget_bytes"] or 0)
        yield gauge("bytecp_keeper_checkpoints", "Committed memory checkpoints held here.", len(s["checkpoints"]))
        rep = s["replication_s"]
        yield gauge("bytecp_keeper_replication_seconds", "Seconds pushing the newest checkpoint's files to peers.",
                    rep[next(reversed(rep))] if rep else 0.0)
        yield gauge("bytecp_keeper_drain_lag_seconds", "Age of the oldest running drain to storage.",
                    s["drain_lag_s"])
        drains = GaugeMetricFamily("bytecp_keeper_drains", "Drains to storage by state.",
                                   labels=["job", "host", "state"])
        for state in ("running", "done", "failed"):
            drains.add_metric([*labels, state], sum(d["state"] == state for d in s["drains"].values()))
        yield drains
        yield from self._arenas(s, labels)

    @staticmethod
    def _arenas(s: dict[str, Any], labels: list[str]) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """The single-copy path's figures: arenas, and how data files came."""
        a = s["arenas"]
        held = GaugeMetricFamily("bytecp_keeper_arenas", "Staging arenas lent to ranks now, free in the pool, "
                                 "and copied out, waiting for their checkpoint's commit to join the pool.",
                                 labels=["job", "host", "state"])
        held.add_metric([*labels, "lent"], a["lent"])
        held.add_metric([*labels, "free"], a["free"])
        held.add_metric([*labels, "returning"], a["returning"])
        yield held
        pool = GaugeMetricFamily("bytecp_keeper_arena_pool_bytes", "Bytes of the free staging arenas.",
                                 labels=["job", "host"])
        pool.add_metric(labels, a["free_bytes"])
        yield pool
        events = CounterMetricFamily("bytecp_keeper_arena_events", "Staging arenas lent, adopted as data files, "
                                     "copied out, reclaimed unadopted.", labels=["job", "host", "event"])
        for event, key in (("lent", "lent_total"), ("adopted", "adopted"), ("copied_out", "copied_out"),
                           ("reclaimed", "reclaimed")):
            events.add_metric([*labels, event], a[key])
        yield events
        data = CounterMetricFamily("bytecp_keeper_data_bytes", "Bytes of data files stored here, by how they came: "
                                   "adopted arenas, written by ranks, received from peers.",
                                   labels=["job", "host", "how"])
        for how, value in (("adopted", a["adopted_bytes"]), ("written", s["written_bytes"]),
                           ("received", s["received_bytes"])):
            data.add_metric([*labels, how], value)
        yield data
        cpu = CounterMetricFamily("bytecp_keeper_cpu_seconds", "CPU time of the keeper process (user + system).",
                                  labels=["job", "host"])
        cpu.add_metric(labels, s["cpu_s"])
        yield cpu


def serve_keeper_metrics(stats: Callable[[], dict[str, Any]], job: str, port: int,
                         addr: str = "127.0.0.1") -> CollectorRegistry:
    """Serve ``/metrics`` for a keeper on ``addr:port``; returns the registry."""
    registry = CollectorRegistry()
    registry.register(KeeperCollector(stats, job))
    start_http_server(port, addr=addr, registry=registry)
    return registry
