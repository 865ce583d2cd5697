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

#: Names resolved on first use: ``name -> module`` (safetensors loads only when used).
_LAZY = {"from_hf": "hf", "hf_config": "hf", "to_hf": "hf_export"}


def __getattr__(name: str) -> object:
    """The Hugging Face functions import on first use only."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"workbench.models.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'workbench.models' has no attribute {name!r}")
