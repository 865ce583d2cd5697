"""Jupyter server extension: authenticated REST and websocket access to run directories.

Enabled on install by ``jupyter-config/jupyter_server_config.d/workbench.json``. Imports
only ``workbench.runs``, jupyter_server and tornado -- never jax.
"""
from __future__ import annotations

from typing import Any


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    from workbench.server.app import extension_points

    return extension_points()
