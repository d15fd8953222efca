"""The on-storage format, docs/FORMAT.md in code (internal).

``metadata`` (metadata.json, chunk records, versions), ``parts_schema``,
``parts_build``, ``parts_read`` and ``segment_wire`` (the version-4 index:
one part per rank, its segments flat words, and a directory), ``index_schema``, ``index_build`` and ``index_read`` (the
index of versions 1-3, read by ``index_read``; ``index_build`` also holds
the commit's chunk checks), ``index_check`` (the one index validation), ``limits`` and
``parquet_footer`` (the hostile-input budget), ``checksum``, ``objects``
(non-tensor values), ``chunk_batch`` (one rank's chunk records as columns).
"""

__all__: list[str] = []
