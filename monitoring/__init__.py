"""bytecp.monitoring: exporters behind the core's neutral recorder.

* :func:`enable_prometheus` / :class:`PrometheusRecorder`: per-process
  metrics, optional ``/metrics`` endpoint.
* :class:`PushRecorder`: what ``monitor="host:port"`` / ``$BYTECP_MONITOR``
  resolve to; pushes each rank's reports to a collector, never blocking.
* :class:`CollectorServer` (``bytecp monitor serve``): aggregates reports
  across ranks, names stragglers, exports job-level metrics.
* :class:`CollectorClient`, :func:`render_timeline`, :func:`format_table`:
  what ``bytecp monitor ls``/``show`` use.

* :func:`register_monitor`, :func:`add_recorder`, :func:`recording`, :class:`Recorder`,
  :class:`CheckpointReport`: the extension point (a new exporter is a
  :class:`Recorder`; a new ``monitor="kind://address"`` kind is a factory
  registered by kind), re-exported from :mod:`bytecp.recorder`.

Names are imported lazily so that ``import bytecp.monitoring`` pulls in
neither gRPC nor matplotlib until they are used.
"""

from __future__ import annotations

import importlib
from typing import Any

from bytecp.recorder import (
    CheckpointReport,
    Recorder,
    Span,
    add_recorder,
    recording,
    register_monitor,
    remove_recorder,
)

__all__ = [
    "Recorder",
    "CheckpointReport",
    "Span",
    "add_recorder",
    "remove_recorder",
    "recording",
    "register_monitor",
    "PrometheusRecorder",
    "enable_prometheus",
    "PushRecorder",
    "CollectorServer",
    "CollectorClient",
    "Aggregator",
    "CheckpointAggregate",
    "Straggler",
    "find_straggler",
    "render_timeline",
    "format_table",
    "load_stored_reports",
]

_WHERE = {
    "PrometheusRecorder": "prometheus",
    "enable_prometheus": "prometheus",
    "PushRecorder": "push",
    "CollectorServer": "server",
    "CollectorClient": "client",
    "Aggregator": "aggregate",
    "CheckpointAggregate": "aggregate",
    "Straggler": "aggregate",
    "find_straggler": "aggregate",
    "render_timeline": "timeline",
    "format_table": "table",
    "load_stored_reports": "cli",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
