"""Planning: pure functions from boxes to who writes and who reads what (internal).

``planner`` (dedup and balance of a save), ``load_plan`` (reads for a load),
``exchange`` (agreeing on a save plan across ranks from votes; the plan cache),
``votes`` (a vote as flat bytes, every vote as columns) and ``decide`` (the
decision from every vote, in NumPy).
"""

__all__: list[str] = []
