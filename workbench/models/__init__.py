"""Model zoo: Flax NNX models that name logical axes only, and their config presets."""
from workbench.models._config import PRESETS, REMAT_POLICIES, GPTConfig
from workbench.models._gpt import GPT, MLP, Attention, Block, RMSNorm, rope
from workbench.models._adapters import ModelSpec, from_nnx
from workbench.models._mlp import MLPClassifier, classifier_loss
from workbench.models._penzai_adapter import PENZAI_AXES, from_penzai   # penzai: when called
from workbench.models._pipeline import Pipeline
from workbench.models._context import blocks_per_device, zigzag_order
from workbench._rules import constrain, penzai_rules

__all__ = [
           "GPT",
           "MLP",
           "PENZAI_AXES",
           "PRESETS",
           "REMAT_POLICIES",
           "Attention",
           "Block",
           "GPTConfig",
           "MLPClassifier",
           "ModelSpec",
           "Pipeline",
           "RMSNorm",
           "blocks_per_device",
           "classifier_loss",
           "constrain",
           "from_hf",
           "from_nnx",
           "from_penzai",
           "hf_config",
           "penzai_rules",
           "rope",
           "to_hf",
           "zigzag_order",
]

#: Aliases of :mod:`workbench.hf` (``wb.hf``), which sits above ``models`` (it builds their
#: GPTs from Hugging Face folders): resolved on first use, so ``models`` never imports it.
_HF_ALIASES = ("from_hf", "hf_config", "to_hf")


def __getattr__(name: str) -> object:
    """``wb.models.from_hf`` / ``hf_config`` / ``to_hf``: the functions of ``wb.hf``."""
    if name in _HF_ALIASES:
        import importlib

        return getattr(importlib.import_module("workbench.hf"), name)
    raise AttributeError(f"module 'workbench.models' has no attribute {name!r}")
