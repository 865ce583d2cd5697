"""Whether code runs in a Jupyter kernel, without importing IPython (the core stays headless)."""
from __future__ import annotations

import sys


def in_notebook() -> bool:
    """True inside a Jupyter kernel (IPython is only looked at if already imported)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})
