"""Side-by-side benchmarks of bytecp and ``torch.distributed.checkpoint``.

One entry point: ``python -m benchmarks.run`` (``make bench``). See
docs/benchmarks.md for what each figure means.
"""

__all__: list[str] = []
