"""Moved to :mod:`workbench.perf.hlo` (how long things take); this old path warns."""
from workbench._moved import forward

__getattr__, __dir__ = forward(__name__, "workbench.perf.hlo")
