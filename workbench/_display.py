"""The one display hook of core objects: a widget in a notebook, text elsewhere.

No core module names a view or imports the display package. The views register themselves
here from above (:func:`register_view`, :func:`register_sink`: ``workbench.widgets`` does,
when imported), and the root package says once which package holds them
(:func:`views_from`), imported the first time a notebook asks for a view. A class is named
by its path (``workbench.train.Trainer``: the package, or the module defining it, and its
name), so registering imports none of the classes drawn. Outside a notebook an object
prints its text.
"""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

from workbench._notebook import in_notebook

# Packages a view needs that a headless install may lack; any other import error is a bug.
UI_PACKAGES = frozenset({"anywidget", "ipywidgets", "IPython", "plotly", "traitlets", "treescope"})

#: (class path, kind) -> "module:function": "widget" (what a notebook shows), "figure".
_VIEWS: dict[tuple[str, str], str] = {}
#: The notebook's sinks: "status_line", "text_stream" -> "module:function".
_SINKS: dict[str, str] = {}
#: The package whose import registers the views (set by the root package), and whether
#: it was imported.
_SOURCE: dict[str, Any] = {"module": None, "loaded": False}


def views_from(module: str) -> None:
    """Names the package that registers the views when imported (the root's one call)."""
    _SOURCE.update(module=module, loaded=False)


def register_view(cls: str, kind: str, target: str) -> None:
    """``target`` ("module:function") draws the objects of the class at path ``cls`` as
    ``kind`` ("widget" or "figure")."""
    _VIEWS[cls, kind] = target


def register_sink(name: str, target: str) -> None:
    """``target`` ("module:function") is the notebook's ``name`` ("status_line": one output
    line updated in place; "text_stream": the sink of ``wb.generate(stream=True)``)."""
    _SINKS[name] = target


def _load() -> None:
    if not _SOURCE["loaded"] and _SOURCE["module"] is not None:
        importlib.import_module(_SOURCE["module"])
        _SOURCE["loaded"] = True


def resolve(target: str) -> Callable[..., Any]:
    """The function named by ``target`` ("module:function"), imported now."""
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)


def matches(cls: type, path: str) -> bool:
    """Whether ``cls`` is the class at ``path`` ("pkg.mod.Name"), without importing: defined
    in ``pkg.mod`` or a module under it, or bound to that name there."""
    module, _, name = path.rpartition(".")
    if cls.__qualname__ == name and (cls.__module__ == module
                                     or cls.__module__.startswith(module + ".")):
        return True
    loaded = sys.modules.get(module)
    return loaded is not None and getattr(loaded, name, None) is cls


def view_target(obj: Any, kind: str = "widget") -> str | None:
    """The registered "module:function" that draws ``obj`` as ``kind`` (the first class of
    its MRO that has one), or None."""
    _load()
    for cls in type(obj).__mro__:
        for (path, k), target in _VIEWS.items():
            if k == kind and matches(cls, path):
                return target
    return None


def view(obj: Any, kind: str = "widget") -> Callable[..., Any]:
    """The function that draws ``obj`` as ``kind``; TypeError when none is registered."""
    target = view_target(obj, kind)
    if target is None:
        raise TypeError(
            f"no {kind} view is registered for {type(obj).__module__}."
            f"{type(obj).__qualname__}; views register with workbench._display.register_view "
            "when workbench.widgets is imported: add one there")
    return resolve(target)


def _sink(name: str) -> Callable[..., Any]:
    _load()
    if name not in _SINKS:
        raise TypeError(f"no notebook {name!r} is registered; workbench.widgets registers it "
                        "with workbench._display.register_sink")
    return resolve(_SINKS[name])


class Displayable:
    """Mixin: ``_repr_mimebundle_`` through the view registered for the class; ``repr``
    stays the text."""

    def widget(self, **options: Any) -> Any:
        """This object's interactive view (what a notebook shows for it)."""
        return view(self)(self, **options)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> Any:
        if not in_notebook():
            return {"text/plain": repr(self)}
        try:
            shown = self.widget()
        except ModuleNotFoundError as e:  # a headless install: text only
            if (e.name or "").partition(".")[0] not in UI_PACKAGES:
                raise
            return {"text/plain": repr(self)}
        bundle = shown._repr_mimebundle_(include=include, exclude=exclude)
        data, meta = bundle if isinstance(bundle, tuple) else (bundle, {})
        return {**data, "text/plain": repr(self)}, meta


def status_line(text: str) -> Callable[[str], None]:
    """Shows ``text`` now and returns a callable that replaces it: in a notebook one output
    line updated in place (the registered "status_line"), elsewhere lines on stderr."""
    if in_notebook():
        return _sink("status_line")(text)
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
    """The sink of ``wb.generate(stream=True)``: in a notebook the registered "text_stream"
    (a live view in the cell), elsewhere the text on stdout as it comes."""
    if in_notebook():
        return _sink("text_stream")(tokenizer)
    return _TextStream(tokenizer)
