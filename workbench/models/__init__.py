"""Model zoo: Flax NNX models that name logical axes only, and their config presets."""
from workbench.models.config import PRESETS, REMAT_POLICIES, GPTConfig
from workbench.models.gpt import GPT, MLP, Attention, Block, RMSNorm, rope
from workbench.models.adapters import ModelSpec, from_nnx
from workbench.models.mlp import MLPClassifier, classifier_loss

__all__ = [
           "GPT",
           "MLP",
           "PRESETS",
           "REMAT_POLICIES",
           "Attention",
           "Block",
           "GPTConfig",
           "MLPClassifier",
           "ModelSpec",
           "RMSNorm",
           "classifier_loss",
           "from_nnx",
           "from_penzai",
           "rope",
]


def __getattr__(name: str) -> object:
    """``from_penzai`` imports penzai on first use only."""
    if name in ("from_penzai", "PENZAI_AXES"):
        from workbench.models import penzai_adapter

        return getattr(penzai_adapter, name)
    raise AttributeError(f"module 'workbench.models' has no attribute {name!r}")
