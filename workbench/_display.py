"""The one display hook of core objects: a widget in a notebook, text elsewhere.

A core class names its view as ``_view = "<module of workbench.widgets>:<function>"``;
:func:`workbench.widgets.show` draws it with that function. This module never imports a
display library itself; ``workbench.widgets`` is imported only when a notebook asks for a
rich display.
"""
from __future__ import annotations

from typing import Any, ClassVar

from workbench._notebook import in_notebook

# Packages a view needs that a headless install may lack; any other import error is a bug.
UI_PACKAGES = frozenset({"anywidget", "ipywidgets", "IPython", "plotly", "traitlets", "treescope"})


class Displayable:
    """Mixin: ``_repr_mimebundle_`` through ``workbench.widgets.show``; ``repr`` stays the text."""

    _view: ClassVar[str]

    def widget(self, **options: Any) -> Any:
        """This object's interactive view (what a notebook shows for it)."""
        from workbench import widgets

        return widgets.show(self, **options)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> Any:
        if not in_notebook():
            return {"text/plain": repr(self)}
        try:
            view = self.widget()
        except ModuleNotFoundError as e:  # a headless install: text only
            if (e.name or "").partition(".")[0] not in UI_PACKAGES:
                raise
            return {"text/plain": repr(self)}
        bundle = view._repr_mimebundle_(include=include, exclude=exclude)
        data, meta = bundle if isinstance(bundle, tuple) else (bundle, {})
        return {**data, "text/plain": repr(self)}, meta
