"""Pytree widget: a table of every tensor's layout, memory per device, a treescope tab, and the
layout of the row you click (computed on demand, in the kernel)."""
from __future__ import annotations

from typing import Any

import anywidget
import ipywidgets
import traitlets

from workbench._sharding.pytrees import TreeLayouts, tree_layouts
from workbench.widgets import _assets
from workbench.widgets._tree_payload import tree_payload, tree_text
from workbench.widgets._layout_view import LayoutWidget

__all__ = ["TreeTable", "TreeView", "tree_widget"]


class TreeTable(anywidget.AnyWidget):
    """The table, memory bars and treescope tab. The front end sets ``selected`` (a path)
    and ``want_treescope``; the kernel answers with a layout and ``treescope_html``."""

    _esm = _assets.esm("tree")
    _css = _assets.css("tree")
    payload = traitlets.Dict().tag(sync=True)
    selected = traitlets.Unicode("").tag(sync=True)
    tab = traitlets.Unicode("table").tag(sync=True)
    group_axis = traitlets.Unicode("").tag(sync=True)
    want_treescope = traitlets.Bool(False).tag(sync=True)
    treescope_html = traitlets.Unicode("").tag(sync=True)


class TreeView(ipywidgets.VBox):
    """The tree table above the layout of the selected tensor.

    Attributes:
      table: the ``TreeTable`` widget.
      layout_view: the ``LayoutWidget`` that draws the selected row.
      layouts: the core ``TreeLayouts`` behind both (``layouts[path]`` is any tensor's).
    """

    def __init__(self, tree: Any, layouts: TreeLayouts, *, title: str | None = None) -> None:
        self.tree = tree
        self.layouts = layouts
        self.table = TreeTable(payload=tree_payload(
            layouts, title=title or ("pytree" if isinstance(tree, dict) else type(tree).__name__)))
        self.layout_view = LayoutWidget(placeholder="click a row above to draw that tensor's layout")
        super().__init__(children=[self.table, self.layout_view])
        self.table.observe(self._on_select, names="selected")
        self.table.observe(self._on_treescope, names="want_treescope")

    def select(self, path: str) -> None:
        """Draw the layout of the tensor at ``path`` (as a click on its row does)."""
        self.table.selected = path

    def _on_select(self, change: dict) -> None:
        if change["new"]:
            self.layout_view.show_layout(self.layouts[change["new"]])

    def _on_treescope(self, change: dict) -> None:
        if change["new"] and not self.table.treescope_html:
            self.table.treescope_html = treescope_html(self.tree)

    def __repr__(self) -> str:
        return tree_text(self.layouts)


def treescope_html(tree: Any) -> str:
    """A self-contained treescope rendering of ``tree`` (HTML with its own scripts)."""
    import treescope

    return treescope.render_to_html(tree, roundtrip_mode=False)


def tree_widget(tree: Any, *, mesh: Any = None, rules: Any = None, specs: Any = None,
                select: str | None = None, title: str | None = None) -> TreeView:
    """The pytree widget for a pytree of arrays or an ``nnx.Module``.

    Args:
      tree: arrays with shardings, ``ShapeDtypeStruct`` s, numpy arrays, or an NNX model.
      mesh: the mesh (default: that of the first sharded leaf).
      rules: ``wb.Rules`` mapping the logical axes in NNX metadata to mesh axes, for
        leaves without a sharding of their own.
      specs: a matching pytree of ``PartitionSpec``.
      select: a path to draw at once (e.g. ``"blocks.0.mlp.up"``).
    """
    layouts = tree_layouts(tree, mesh, rules=rules, specs=specs)
    if not layouts.layouts:
        raise ValueError(f"wb.show(obj): nothing to draw: the {type(tree).__name__} has no "
                         "array leaves "
                         f"(leaves skipped: {layouts.skipped[:5]}); wb.show draws pytrees of "
                         "arrays, ShapeDtypeStructs or an nnx.Module")
    view = TreeView(tree, layouts, title=title)
    if select:
        view.select(select)
    return view
