"""Workbench's cache directory (``$WORKBENCH_CACHE`` or ``$XDG_CACHE_HOME/workbench``)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Workbench's cache directory: ``$WORKBENCH_CACHE`` or ``~/.cache/workbench``."""
    root = os.environ.get("WORKBENCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "workbench")
    return Path(root)
