"""Hugging Face models in and out (``wb.hf``): a model folder straight into a sharded GPT,
a GPT or a run's checkpoint back out as a folder that ``transformers`` reads.

Usage::

    import workbench as wb

    cfg = wb.hf.hf_config("qwen3-folder/")                  # config.json only: plan first
    model = wb.hf.from_hf("qwen3-folder/", mesh=wb.make_mesh(data=8))
    wb.hf.to_hf(model, "exported/")
    wb.hf.export_run("runs/ft", "exported-ft/", step=200)   # a run's checkpoint

One module per concern:

- :mod:`workbench.hf._load`: ``from_hf``, the folder read into a sharded model;
- :mod:`workbench.hf._export_config`: ``GPTConfig`` -> ``config.json``, per family;
- :mod:`workbench.hf._export_folder`: the folder ``to_hf`` writes, and what it may replace;
- :mod:`workbench.hf._save`: ``to_hf``, the folder written tensor by tensor;
- :mod:`workbench.hf._export`: ``export_run``, a run's checkpoint restored, then ``to_hf``;
- :mod:`workbench.hf._peft`: a LoRA model's adapters in PEFT's layout (``to_peft``), merged
  weights for ``to_hf``, and ``export_run`` of a LoRA run.

The package sits above ``workbench.models``, ``workbench._step``, ``data``, ``planning``
and ``train`` (``export_run`` restores a run's checkpoint); nothing below imports it, not
even inside a function. The format it reads and writes sits below ``train``, in the private
package ``workbench._hf_format`` (``config.json`` <-> ``GPTConfig`` per family, which HF
tensors make each parameter, sliced safetensors reads, ``hf_config`` and ``load_params``):
the Trainer's ``init=`` and ``TrainConfig.check`` read a folder through it, and a Hub id
resolves to a snapshot folder in ``workbench._hub``, below both.

Every name is resolved on first use (PEP 562): importing ``workbench.hf`` imports neither
JAX nor safetensors.
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["CheckpointError", "HFConfigError", "HFSource", "HubError", "export_run", "from_hf",
           "hf_config", "to_hf", "to_peft"]

#: public name -> the module that defines it: one of this package (by its name here) or
#: below it (by its full path).
_WHERE = {"CheckpointError": "workbench._hf_format.tensors",
          "HFConfigError": "workbench._hf_format.families",
          "HFSource": "workbench._hf_format.load", "HubError": "workbench._hub",
          "export_run": "_export", "from_hf": "_load",
          "hf_config": "workbench._hf_format.config", "to_hf": "_save", "to_peft": "_peft"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'workbench.hf' has no attribute {name!r}")
    where = _WHERE[name]
    module = where if where.startswith("workbench.") else f"workbench.hf.{where}"
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
