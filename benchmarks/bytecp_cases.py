"""bytecp's side of the comparison: sync save, async save (eager and lazy), load.

Every case passes the live module and optimizer (bytecp detects the
framework); a save is durable when ``bytecp.save`` returns or the async
handle's ``wait()`` returns (files and directory fsynced, then
``metadata.json`` committed).
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .harness import NOT_AVAILABLE, Case

if TYPE_CHECKING:
    from .harness import Ctx

__all__ = ["CASES", "rank_bytes"]

_ADAPTER_OF = {"fsdp2": "fsdp2", "fsdp2_tp": "fsdp2", "fsdp1": "fsdp1", "ddp": "ddp", "plain": "plain"}


def _adapter_missing(framework: str) -> str | None:
    mod = f"bytecp.adapters.{_ADAPTER_OF[framework]}"
    try:
        found = importlib.util.find_spec(mod) is not None
    except ModuleNotFoundError:
        found = False
    return None if found else f"{NOT_AVAILABLE}: no {mod}"


def _async_missing(framework: str, *, lazy: bool = False) -> str | None:
    import bytecp

    fn = getattr(bytecp, "async_save", None)
    fn = fn if fn is None or callable(fn) else getattr(fn, "async_save", None)
    if fn is None:
        return f"{NOT_AVAILABLE}: no bytecp.async_save"
    if lazy and "lazy" not in inspect.signature(fn).parameters:
        return f"{NOT_AVAILABLE}: bytecp.async_save has no lazy mode"
    return _adapter_missing(framework)


def _async_fn() -> Any:
    """``bytecp.async_save``, the function.

    Once ``bytecp.async_save`` the submodule has been imported (``bytecp.save``
    imports it), the package attribute of that name can be the module rather
    than the lazily exported function; take the function from the module then.
    """
    import bytecp

    fn = bytecp.async_save  # type: ignore[attr-defined]
    return fn if callable(fn) else fn.async_save


def _state(ctx: Ctx) -> dict[str, Any]:
    return {"model": ctx.model, "optimizer": ctx.optim}


def _kwargs(fn: Any, **wanted: Any) -> dict[str, Any]:
    params = inspect.signature(fn).parameters
    return {k: v for k, v in wanted.items() if k in params}


def save(ctx: Ctx) -> dict[str, Any]:
    import bytecp

    url = ctx.path("bytecp-save")
    ctx.fresh_dir(url)  # like DCP's cases: a new folder, no overwrite work in the timed call
    t0 = time.perf_counter()
    bytecp.save(url, _state(ctx), overwrite=True)
    t1 = time.perf_counter()
    ctx.expected["bytecp"] = ctx.fingerprint()
    ctx.load_from.setdefault("bytecp", url)
    return {"blocking_s": t1 - t0, "total_s": t1 - t0, "path": url}


def async_save(ctx: Ctx) -> dict[str, Any]:

    url = ctx.path("bytecp-async")
    ctx.fresh_dir(url)  # like DCP's cases: a new folder, no overwrite work in the timed call
    fn = _async_fn()
    t0 = time.perf_counter()
    handle = fn(url, _state(ctx), **_kwargs(fn, overwrite=True, lazy=False))
    t1 = time.perf_counter()
    handle.wait()
    t2 = time.perf_counter()
    return {"blocking_s": t1 - t0, "total_s": t2 - t0, "path": url}


def lazy_save(ctx: Ctx) -> dict[str, Any]:
    """Return at once, run one forward/backward, then the optimizer step.

    Blocking = the call itself plus what the step has to wait for: the time
    from the end of forward/backward until ``handle.staged()`` (bytecp's
    pre-step hook waits for exactly that). The wait is taken here, so the
    figure does not depend on hook order. The total includes the overlapped
    forward/backward.
    """

    from .model import forward_backward

    url = ctx.path("bytecp-lazy")
    ctx.fresh_dir(url)  # like DCP's cases: a new folder, no overwrite work in the timed call
    fn = _async_fn()
    t0 = time.perf_counter()
    handle = fn(url, _state(ctx), **_kwargs(fn, overwrite=True, lazy=True))
    t1 = time.perf_counter()
    forward_backward(ctx.model, ctx.cfg, seed=ctx.spec.seed)
    t2 = time.perf_counter()
    staged = getattr(handle, "staged", None)
    while callable(staged) and not staged():
        time.sleep(0.0005)
    t3 = time.perf_counter()
    ctx.optim.step()
    ctx.optim.zero_grad(set_to_none=True)
    handle.wait()
    t4 = time.perf_counter()
    return {"blocking_s": (t1 - t0) + (t3 - t2), "call_s": t1 - t0, "step_wait_s": t3 - t2,
            "compute_s": t2 - t1, "total_s": t4 - t0, "path": url}


def load(ctx: Ctx) -> dict[str, Any]:
    import bytecp

    url = ctx.load_path("bytecp")
    t0 = time.perf_counter()
    bytecp.load(url, _state(ctx))
    t1 = time.perf_counter()
    return {"blocking_s": t1 - t0, "total_s": t1 - t0, "verified": ctx.check_loaded("bytecp")}


def rank_bytes(path: str, rank: int) -> int:
    """Bytes of the data files of ``rank`` that the committed checkpoint at ``path`` references."""
    root = Path(path)
    md = json.loads((root / "metadata.json").read_text())
    files: set[str] = set()

    def walk(v: Any) -> None:  # any "data/<save_id>/<rank>-<n>.bin" string in the metadata
        if isinstance(v, str) and v.startswith("data/") and v.endswith(".bin"):
            files.add(v)
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(k)
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    walk(md)
    if not files:  # the index names the files: count this rank's under the newest save
        saves = sorted((root / "data").iterdir(), key=lambda p: p.stat().st_mtime)
        return sum(f.stat().st_size for f in saves[-1].glob(f"{rank}-*.bin"))
    return sum((root / f).stat().st_size for f in files if Path(f).name.startswith(f"{rank}-"))


CASES = {
    c.name: c
    for c in (
        Case("bytecp.save", "bytecp", "save", save, unavailable=_adapter_missing),
        Case("bytecp.async_save", "bytecp", "async", async_save, unavailable=_async_missing),
        Case("bytecp.async_save lazy", "bytecp", "lazy", lazy_save,
             unavailable=lambda fw: _async_missing(fw, lazy=True)),
        Case("bytecp.load cold", "bytecp", "load", load, cold=True, unavailable=_adapter_missing),
        Case("bytecp.load warm", "bytecp", "load", load, unavailable=_adapter_missing),
    )
}
