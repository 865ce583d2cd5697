"""The one display hook of core objects: a widget in a notebook, text elsewhere.

A core class names its view as ``_view = "<module of workbench.widgets>:<function>"``;
:func:`workbench.widgets.show` draws it with that function. This module never imports a
display library itself; ``workbench.widgets`` is imported only when a notebook asks for a
rich display.
"""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
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

    def _view_function(self, name: str) -> Callable[..., Any]:
        """Another function of this object's view module (``compare_figure`` beside
        ``compare_widget``), for views that offer more than the widget."""
        module = self._view.partition(":")[0]
        return getattr(importlib.import_module(f"workbench.widgets.{module}"), name)

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


def status_line(text: str) -> Callable[[str], None]:
    """Shows ``text`` now and returns a callable that replaces it: in a notebook one output
    line updated in place (through ``workbench.widgets``), elsewhere lines on stderr."""
    if in_notebook():
        from workbench import widgets

        return widgets.status_line(text)
    print(text, file=sys.stderr, flush=True)
    return lambda done: print(done, file=sys.stderr, flush=True)


class _TextStream:
    """``wb.generate(stream=True)`` outside a notebook: the new text written to stdout."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.shown = tokenizer, None

    def __call__(self, tokens: Any) -> None:
        row = [int(t) for t in tokens[0]]
        if self.tokenizer is None:   # token ids: the new id of each row
            print(" ".join(str(int(t)) for t in tokens[:, -1]), flush=True)
            return
        text = self.tokenizer.decode(row)
        if self.shown is None:
            self.shown = self.tokenizer.decode(row[:-1])
            print(self.shown, end="", flush=True)
        new = text[len(self.shown):] if text.startswith(self.shown) else "\n" + text
        print(new, end="", flush=True)
        self.shown = text

    def finish(self) -> None:
        if self.tokenizer is not None:
            print(flush=True)


def text_stream(tokenizer: Any = None) -> Callable[[Any], None]:
    """The sink of ``wb.generate(stream=True)``: in a notebook a live ``GenerationView`` in
    the cell (through ``workbench.widgets``), elsewhere the text on stdout as it comes."""
    if in_notebook():
        from workbench.widgets._generation_view import stream_widget

        return stream_widget(tokenizer)
    return _TextStream(tokenizer)
