"""Widget front-end assets: each view's ESM and CSS, with the shared helpers inlined.

anywidget loads one ES module per widget from a string (a blob URL in the browser), so
a relative ``import ... from "./common.js"`` cannot be resolved there. The view files
in ``static/`` keep that import (node and editors resolve it; the files stay separately
checkable); this module inlines ``common.js`` in its place: the helpers file holds only
top-level ``export function`` / ``export const`` declarations, whose ``export`` keyword
is dropped, and the view's import line is removed.
"""
from __future__ import annotations

import functools
import pathlib
import re

STATIC = pathlib.Path(__file__).parent / "static"

_IMPORT_COMMON = re.compile(r'^import\s*\{[^}]*\}\s*from\s*"\./common\.js";\s*$', re.MULTILINE | re.DOTALL)
_EXPORT_DECL = re.compile(r"^export (?=(?:async )?function |const )", re.MULTILINE)


def views() -> list[str]:
    """The views that have a front end in ``static/`` (``<view>.js``)."""
    return sorted(p.stem for p in STATIC.glob("*.js") if p.stem != "common")


def _check(view: str, ext: str) -> None:
    if not re.fullmatch(r"[a-z][a-z0-9_]*", view) or not (STATIC / f"{view}.{ext}").is_file():
        raise ValueError(f"no widget front end static/{view}.{ext}; views: {views()}")


@functools.cache
def esm(view: str) -> str:
    """The self-contained ES module for ``view`` (``static/<view>.js``)."""
    _check(view, "js")
    source = (STATIC / f"{view}.js").read_text()
    body, n = _IMPORT_COMMON.subn("", source)
    if n == 0:
        return source  # a self-contained view
    if n > 1:
        raise RuntimeError(f"static/{view}.js imports ./common.js {n} times; import it once")
    common = (STATIC / "common.js").read_text()
    if re.search(r"^(import|export (?!(?:async )?function |const ))", common, re.MULTILINE):
        raise RuntimeError("static/common.js may hold only 'export function'/'export const' "
                           "declarations; it is inlined into every widget")
    return f"// --- common.js (inlined) ---\n{_EXPORT_DECL.sub('', common)}\n// --- {view}.js ---\n{body}"


@functools.cache
def css(view: str) -> str:
    """The stylesheet for ``view``: the shared rules, then the view's own."""
    _check(view, "css")
    return (STATIC / "common.css").read_text() + "\n" + (STATIC / f"{view}.css").read_text()
