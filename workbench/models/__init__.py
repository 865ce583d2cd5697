"""Model zoo: Flax NNX models that name logical axes only, and their config presets. Your own
models are :mod:`workbench.any_model`'s (``from_nnx``, ``from_penzai``) and Hugging Face
folders ``wb.hf``'s (``from_hf``): both sit above ``models``, which never names them."""
from workbench.models._config import PRESETS, GPTConfig
from workbench.models._remat import REMAT_POLICIES
from workbench.models._gpt import GPT, MLP, Attention, Block, RMSNorm, rope
from workbench.models._pipeline import Pipeline
from workbench.models._context import blocks_per_device, zigzag_order
from workbench._sharding.rules import constrain, penzai_rules

__all__ = [
           "GPT",
           "MLP",
           "PRESETS",
           "REMAT_POLICIES",
           "Attention",
           "Block",
           "GPTConfig",
           "Pipeline",
           "RMSNorm",
           "blocks_per_device",
           "constrain",
           "penzai_rules",
           "rope",
           "zigzag_order",
]
