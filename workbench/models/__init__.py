"""Model zoo: Flax NNX models that name logical axes only, and their config presets."""
from workbench.models.config import PRESETS, REMAT_POLICIES, GPTConfig
from workbench.models.gpt import GPT, MLP, Attention, Block, RMSNorm, rope
from workbench.models.adapters import ModelSpec, from_nnx
from workbench.models.mlp import MLPClassifier, classifier_loss
from workbench.models.penzai_adapter import PENZAI_AXES, from_penzai   # penzai: when called

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
           "RMSNorm",
           "classifier_loss",
           "from_hf",
           "from_nnx",
           "from_penzai",
           "hf_config",
           "rope",
           "to_hf",
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
