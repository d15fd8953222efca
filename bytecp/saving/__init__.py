"""The save path: describe -> plan -> stage -> write -> commit (internal).

``schedule`` (the orders: a save, and the eager, lazy and memory-budget
async saves, each written once), ``pipeline`` (the phases), ``results``
(the frozen values one phase hands the next), ``staging`` and ``hostcopy``
(copies the caller waits for), ``writer`` (data files), ``commit`` (the
coordinator's metadata.json), ``handles`` (saves in flight, the background
thread).
"""

__all__: list[str] = []
