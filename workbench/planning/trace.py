"""Moved to :mod:`workbench.perf.trace` (how long things take); this old path warns."""
from workbench._moved import forward

__getattr__, __dir__ = forward(__name__, "workbench.perf.trace")
