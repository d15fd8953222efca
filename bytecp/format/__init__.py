"""The on-storage format, docs/FORMAT.md in code (internal).

``metadata`` (metadata.json, chunk records, versions), ``index_schema``,
``index_build`` and ``index_read`` (the index; ``index_read`` decodes both
versions), ``index_check`` (the one index validation), ``limits`` and
``parquet_footer`` (the hostile-input budget), ``checksum``, ``objects``
(non-tensor values), ``chunk_batch`` (one rank's chunk records as columns).
"""

__all__: list[str] = []
