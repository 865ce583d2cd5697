"""Which module reads a Hugging Face folder for ``TrainConfig.init``, named by the root.

``workbench.hf`` sits above ``workbench.train`` (``export_run`` restores a run's checkpoint),
so ``train`` never imports it: the root package, above both, names the reader once
(:func:`read_with`) and the Trainer and ``TrainConfig.check`` ask for it (:func:`reader`).
This module imports nothing (the Jupyter server imports the root).
"""
from __future__ import annotations

import importlib
from types import ModuleType

_READER: dict[str, str | None] = {"module": None}


def read_with(module: str) -> None:
    """Names the module (``check_matches``, ``check_weights``, ``load_params``) that reads a
    Hugging Face folder into a run: the root package's one call."""
    _READER["module"] = module


def reader() -> ModuleType:
    """The module named by :func:`read_with`, imported now."""
    if _READER["module"] is None:
        raise RuntimeError("no reader of Hugging Face folders is named: the root package "
                           "(workbench/__init__.py) names it with _hf_reader.read_with")
    return importlib.import_module(_READER["module"])
