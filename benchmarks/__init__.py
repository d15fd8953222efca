"""Side-by-side benchmarks of bytecp and ``torch.distributed.checkpoint``.

One entry point: ``python -m benchmarks.run`` (``make bench``). See
docs/benchmarks.md for what each figure means.
"""

# Every benchmark process (the baselines' workers, which use no bytecp, too)
# lets gloo's worker threads settle at exit: bytecp.dist_raw's exit hook.
import bytecp.dist_raw  # noqa: F401,E402

__all__: list[str] = []
