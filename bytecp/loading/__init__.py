"""The load path: metadata -> match -> plan -> read -> exchange -> apply (internal).

``opened`` (a checkpoint opened for reading: every reader's way in),
``pipeline`` (the sequence), ``reader`` (ranged reads into targets),
``matching`` (targets against the checkpoint), ``zero_redundancy`` (shared
boxes read once), ``diagnose`` (why a URL is not a checkpoint).
"""

__all__: list[str] = []
