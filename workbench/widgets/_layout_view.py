"""Layout widget: one tensor's blocks across the mesh; two dims drawn, the rest as panels."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anywidget
import traitlets

from workbench._sharding.layouts import Layout, layout
from workbench.widgets import _assets
from workbench.widgets._payload import layout_payload

__all__ = ["LayoutWidget", "layout_widget"]


class LayoutWidget(anywidget.AnyWidget):
    """Draws a ``Layout``. ``dims``: [row dim, column dim] (-1: none); ``color_by``:
    ``"device"``, ``"group"`` (replica group), ``"axis:<name>"`` or ``"host"``;
    ``panel``: which slice of the other dims when there are too many for small multiples."""

    _esm = _assets.esm("layout")
    _css = _assets.css("layout")
    payload = traitlets.Dict().tag(sync=True)
    dims = traitlets.List(traitlets.Int()).tag(sync=True)
    color_by = traitlets.Unicode("").tag(sync=True)
    panel = traitlets.Int(0).tag(sync=True)
    placeholder = traitlets.Unicode("").tag(sync=True)

    def __init__(self, lay: Layout | None = None, **kwargs: Any) -> None:
        self._text = str(lay) if lay is not None else "<empty layout view>"
        super().__init__(payload={} if lay is None else layout_payload(lay), **kwargs)

    def show_layout(self, lay: Layout) -> None:
        """Draw another layout (keeps the colour mode; resets dims and panel)."""
        self._text = str(lay)
        with self.hold_sync():
            self.dims, self.panel = [], 0
            self.payload = layout_payload(lay)

    def __repr__(self) -> str:
        return self._text


def layout_widget(x: Any, spec: Any = None, mesh: Any = None, *, dims: Sequence[int] | None = None,
                  color_by: str = "", dtype: Any = "float32", name: str | None = None) -> LayoutWidget:
    """The layout widget for a ``Layout``, a sharded ``jax.Array``/``ShapeDtypeStruct``, or
    the arguments of ``wb.layout``.

    Args:
      x: a ``Layout``, an array with a sharding, or a shape (then give ``spec`` and ``mesh``).
      dims: the two tensor dims to draw as rows and columns (default: the two most split).
      color_by: "device", "group", "axis:<mesh axis>" or "host" (default picks by size).
    """
    lay = x if isinstance(x, Layout) else layout(x, spec, mesh, dtype=dtype, name=name)
    if dims is not None:
        dims = [int(d) for d in dims]
        if len(dims) != 2 or any(not -1 <= d < len(lay.shape) for d in dims) or dims[0] == dims[1]:
            raise ValueError(f"dims={dims} must name two different dims of {lay.name!r} (rank "
                             f"{len(lay.shape)}) as [row dim, column dim]; -1 for no row dim")
    return LayoutWidget(lay, dims=list(dims or []), color_by=color_by)
