"""Model zoo: Flax NNX models that name logical axes only, and their config presets."""
from workbench.models.config import PRESETS, REMAT_POLICIES, GPTConfig
from workbench.models.gpt import GPT, MLP, Attention, Block, RMSNorm, rope
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
           "RMSNorm",
           "classifier_loss",
           "rope",
]
