"""The save path: describe -> plan -> stage -> write -> commit (internal).

``pipeline`` (the sequence), ``staging`` and ``hostcopy`` (copies the caller
waits for), ``writer`` (data files), ``commit`` (the coordinator's
metadata.json), ``handles`` (saves in flight, the background thread).
"""

__all__: list[str] = []
