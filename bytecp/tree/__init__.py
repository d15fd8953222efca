"""The state tree: what adapters hand the core (internal).

``state`` (the tree of tensors, boxes and values an adapter builds), ``skeleton``
(its typed JSON shape), ``regions`` (boxes in a global index space) and
``dtypes`` (names and byte views); beside them the helpers every stage
shares about memory: ``bulk`` (the cyclic collector paused) and ``buffers``
(guards of reused buffers, their debug mode). Pure data; no I/O, no collectives.
"""

__all__: list[str] = []
