"""Jupyter server extension: authenticated REST and websocket access to run directories.

Enabled on install by ``jupyter-config/jupyter_server_config.d/workbench.json``. Imports
only ``workbench._runs``, jupyter_server and tornado -- never jax.
"""
from __future__ import annotations

from typing import Any

__all__: list[str] = []   # nothing for users: jupyter_server calls the hook below


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    from workbench.server._app import extension_points

    return extension_points()
