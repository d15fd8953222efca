"""Framework adapters (``bytecp.adapters``): plain/DDP, FSDP1, FSDP2, Megatron-Core.

The core finds them through :mod:`bytecp.adapter_api`'s registry; each turns
its framework's live state into the core's state tree without copying and
writes loaded data back in place.
"""

__all__: list[str] = []
