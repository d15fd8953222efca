"""One-process tools behind the command line: ``inspect``/``verify``, ``gc``, progress (internal)."""

__all__: list[str] = []
