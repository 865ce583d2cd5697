"""Old module paths that keep working: a module that moved leaves a shim behind that warns
(``DeprecationWarning``, naming the new path) when it is imported and forwards every
attribute to the new module on first use (PEP 562), so the shim imports nothing itself."""
from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def forward(old: str, new: str) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of the shim module ``old``, which moved to ``new``.

    Example (the whole of ``workbench/models/hf.py``)::

        from workbench._moved import forward

        __getattr__, __dir__ = forward(__name__, "workbench.hf.load")
    """
    warnings.warn(f"{old} moved to {new}; import it from there (the old path will go)",
                  DeprecationWarning, stacklevel=3)

    def __getattr__(name: str) -> Any:
        try:
            return getattr(importlib.import_module(new), name)
        except AttributeError:
            raise AttributeError(f"module {old!r} (now {new!r}) has no attribute {name!r}"
                                 ) from None

    def __dir__() -> list[str]:
        return dir(importlib.import_module(new))

    return __getattr__, __dir__
