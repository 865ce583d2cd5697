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
           "from_nnx",
           "from_penzai",
           "rope",
]

