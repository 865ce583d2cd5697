"""Moved to :mod:`workbench.perf.profile` (how long things take); this old path warns."""
from workbench._moved import forward

__getattr__, __dir__ = forward(__name__, "workbench.perf.profile")
