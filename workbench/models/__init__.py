"""Model zoo: Flax NNX models that name logical axes only, and their config presets; your own
models (``from_nnx``, ``from_penzai``: :mod:`workbench.any_model`) and Hugging Face folders
(``from_hf``: :mod:`workbench.hf`) by the same names, resolved on first use."""
from workbench.models._config import PRESETS, GPTConfig
from workbench.models._remat import REMAT_POLICIES
from workbench.models._gpt import GPT, MLP, Attention, Block, RMSNorm, rope
from workbench.models._pipeline import Pipeline
from workbench.models._context import blocks_per_device, zigzag_order
from workbench._sharding.rules import constrain, penzai_rules

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

#: Aliases of :mod:`workbench.hf` (``wb.hf``) and :mod:`workbench.any_model`, which sit above
#: ``models`` (they build models from folders, or wrap your own around its layers):
#: resolved on first use, so ``models`` never imports them.
_ALIASES = {"from_hf": "workbench.hf", "hf_config": "workbench.hf", "to_hf": "workbench.hf",
            "ModelSpec": "workbench.any_model", "from_nnx": "workbench.any_model",
            "MLPClassifier": "workbench.any_model", "classifier_loss": "workbench.any_model",
            "PENZAI_AXES": "workbench.any_model", "from_penzai": "workbench.any_model"}


def __getattr__(name: str) -> object:
    """``wb.models.from_hf`` / ``hf_config`` / ``to_hf`` (``wb.hf``'s) and ``from_nnx`` /
    ``from_penzai`` / ``ModelSpec`` / ``MLPClassifier`` / ``classifier_loss`` /
    ``PENZAI_AXES`` (``workbench.any_model``'s)."""
    if name in _ALIASES:
        import importlib

        value = getattr(importlib.import_module(_ALIASES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'workbench.models' has no attribute {name!r}")
