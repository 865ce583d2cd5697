"""Moved to :mod:`workbench.models.schedule` (beside ``Pipeline``, whose ``on`` builds a
``Schedule``): a shim that warns, then forwards."""
from workbench._moved import forward

__getattr__, __dir__ = forward(__name__, "workbench.models.schedule")
