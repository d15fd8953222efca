"""Storage backends (``bytecp.storage``), registered by URL protocol.

The core reaches these only through :func:`bytecp.storage_api.open_storage`:
``file``/plain paths -> :class:`~bytecp.storage.local.LocalStorage`,
``memory://`` -> :class:`~bytecp.storage.memory.MemoryStorage`, ``s3://`` ->
S3, ``hdfs://`` -> HDFS, anything else -> the generic fsspec backend.
"""

from bytecp.storage_api import Storage, open_storage, register_storage

__all__ = ["Storage", "open_storage", "register_storage"]
