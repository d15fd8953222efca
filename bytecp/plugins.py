"""Third-party plugins found through Python entry points.

A package that ships an adapter, a storage backend or a monitor kind names
it in its own metadata, so installing the package is enough (no import in
the training script)::

    # the plugin package's pyproject.toml
    [project.entry-points."bytecp.adapters"]
    myframework = "my_pkg.bytecp_adapter:MyAdapter"     # framework name -> Adapter class
    [project.entry-points."bytecp.storage"]
    myfs = "my_pkg.storage:MyStorage"                   # URL protocol -> factory(url, **options)
    [project.entry-points."bytecp.monitors"]
    statsd = "my_pkg.monitor:StatsdRecorder"            # monitor kind -> factory(address)
    [project.entry-points."bytecp.resharders"]
    myloader = "my_pkg.data:MyLoaderResharder"          # loader kind -> Resharder (bytecp.data)

Who calls what, and when: each registry (:mod:`bytecp.adapter_api`,
:mod:`bytecp.storage_api`, :mod:`bytecp.recorder`, :mod:`bytecp.data`) calls
:func:`entry_point_targets` once per process, the first time one of its
lookups misses (a framework name, URL protocol or monitor kind it does not
know, a state no built-in adapter but the catch-all ``plain`` detects, or a
stateful object no registered resharder claims).
Entries become lazy ``"module:attr"`` strings: nothing is imported until
that name is used. A name registered in code keeps precedence.

:func:`missing_extra` is the one message of a module whose optional
dependency (an extra of the ``bytecp`` distribution) is not installed.
"""

from __future__ import annotations

import logging

__all__ = ["ADAPTERS_GROUP", "STORAGE_GROUP", "MONITORS_GROUP", "RESHARDERS_GROUP", "entry_point_targets",
           "missing_extra"]

log = logging.getLogger(__name__)

#: entry-point group of framework adapters (name -> ``Adapter`` subclass)
ADAPTERS_GROUP = "bytecp.adapters"
#: entry-point group of storage backends (URL protocol -> ``Storage`` factory)
STORAGE_GROUP = "bytecp.storage"
#: entry-point group of monitor kinds (``kind://address`` -> recorder factory)
MONITORS_GROUP = "bytecp.monitors"
#: entry-point group of data-position resharders (loader kind -> ``bytecp.data.Resharder``)
RESHARDERS_GROUP = "bytecp.resharders"


def entry_point_targets(group: str) -> dict[str, str]:
    """``name -> "module:attr"`` of every installed entry point of ``group``.

    Reads distribution metadata only (imports nothing). Where two installed
    packages declare one name, the first found wins and the clash is logged.
    A broken metadata file is logged and skipped: a plugin never stops a
    checkpoint that does not use it.
    """
    from importlib.metadata import entry_points

    try:
        found = list(entry_points(group=group))
    except Exception:  # pragma: no cover - a corrupt installation
        log.exception("bytecp: could not read the %r entry points", group)
        return {}
    out: dict[str, str] = {}
    for ep in found:
        target = f"{ep.module}:{ep.attr}" if ep.attr else ep.module
        if ep.name in out and out[ep.name] != target:
            log.warning("bytecp: entry point %r of group %r is declared twice (%s, %s); using the first",
                        ep.name, group, out[ep.name], target)
            continue
        out.setdefault(ep.name, target)
    return out


def missing_extra(err: ModuleNotFoundError, extra: str, by: str, *, needs: str = "", install: str = "") -> ImportError:
    """The one-line error a module of bytecp raises when importing its
    optional dependency failed with ``err``: it names the module, what is
    missing and the extra to install (``install`` replaces the advice where
    a plain ``pip install 'bytecp[extra]'`` is not enough).

    Called at import time by the modules that need an extra (the monitoring
    exporters, the framework plugins, the contract kits)::

        try:
            import grpc
        except ModuleNotFoundError as e:
            raise missing_extra(e, "monitoring", __name__) from None
    """
    what = needs or (err.name or str(err))
    advice = install or f"pip install 'bytecp[{extra}]'"
    out = ModuleNotFoundError(f"{by} needs {what}: {advice}", name=err.name)
    return out
