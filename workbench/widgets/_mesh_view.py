"""Mesh widget: a grid of devices with ids, mesh coordinates, hosts and chip coordinates."""
from __future__ import annotations

from typing import Any

import anywidget
import traitlets

from workbench._sharding.mesh import mesh_info
from workbench.widgets import _assets
from workbench.widgets._payload import mesh_payload

__all__ = ["MeshWidget", "mesh_widget"]


class MeshWidget(anywidget.AnyWidget):
    """Draws a mesh; ``color_by`` is ``"axis:<name>"``, ``"host"`` or ``"device"``."""

    _esm = _assets.esm("mesh")
    _css = _assets.css("mesh")
    payload = traitlets.Dict().tag(sync=True)
    color_by = traitlets.Unicode("").tag(sync=True)
    rows = traitlets.Unicode("").tag(sync=True)  # mesh axes on the grid's rows, "a,b"; "": auto

    def __init__(self, mesh: Any, **kwargs: Any) -> None:
        self._text = str(mesh_info(mesh))
        super().__init__(payload=mesh_payload(mesh), **kwargs)

    def __repr__(self) -> str:
        return self._text


def mesh_widget(mesh: Any, *, color_by: str = "", rows: str | tuple[str, ...] = "") -> MeshWidget:
    """The mesh widget for a ``jax.sharding.Mesh``, ``AbstractMesh`` or ``wb.abstract_mesh``.

    Args:
      mesh: the mesh.
      color_by: ``"axis:data"`` colours devices by their ``data`` coordinate; ``"host"``
        by owning process; ``"device"`` one colour each (small meshes). Default: hosts
        when there are several, else the first axis.
      rows: the mesh axes drawn as rows (the others are columns), e.g. ``"model"``;
        default: the first axes for small meshes, else whichever split gives a wide grid.
    """
    names = mesh_info(mesh).axis_names
    picked = tuple(rows.split(",")) if isinstance(rows, str) and rows else tuple(rows)
    unknown = [a for a in picked if a not in names]
    if unknown or (picked and len(picked) >= len(names)):
        raise ValueError(f"rows={rows!r} must name some (not all) of the mesh axes {names}")
    ordered = ",".join(a for a in names if a in picked)
    return MeshWidget(mesh, color_by=color_by, rows=ordered)
