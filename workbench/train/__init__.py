"""Resumable training: TrainConfig, the optimizer spec, the Trainer and its checkpoints."""
from workbench.train._config import RUN_CONTROL_FIELDS, TrainConfig
from workbench.models._lora import LoRA
from workbench._optimizer import AdamW

__all__ = ["RUN_CONTROL_FIELDS", "AdamW", "LoRA", "TrainConfig", "Trainer"]


def __getattr__(name: str):  # the Trainer pulls in orbax and the step: load on first use
    if name == "Trainer":
        from workbench.train._trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'workbench.train' has no attribute {name!r}")
