"""Moved to :mod:`workbench.hf.load` (``wb.hf``): a shim that warns, then forwards."""
from workbench._moved import forward

__getattr__, __dir__ = forward(__name__, "workbench.hf.load")
