"""Notebook widgets of Workbench objects; ``show(obj)`` picks the view by the object's type.

Every view lives in its own module and is imported only when first used, so importing
this package imports neither anywidget nor the objects' modules. Importing it registers
the views with the core's display hook (``workbench._display``; the table is
``_show.VIEWS``, classes named by path), so no core module names a view. A view function
takes the object (plus any keyword options of ``show``) and returns a widget.
"""
from __future__ import annotations

from typing import Any

from workbench.widgets._show import show, status_line, view_for

__all__ = ["ExpertLoad", "GenerationView", "show", "status_line", "view_for"]


def __getattr__(name: str) -> Any:
    """``ExpertLoad`` (the live expert-load heat map) and ``GenerationView`` (streamed
    text of ``wb.generate``) import anywidget on first use only."""
    if name == "ExpertLoad":
        from workbench.widgets._expert_load_view import ExpertLoad

        return ExpertLoad
    if name == "GenerationView":
        from workbench.widgets._generation_view import GenerationView

        return GenerationView
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
