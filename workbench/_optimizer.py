"""The optimizer spec: AdamW with warmup-cosine, clipping and accumulation, built with optax
(below both ``wb.plan`` and the Trainer, whose default step it is)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import optax

from workbench._validate import check_int

#: The updates a run trains to by default (``TrainConfig.steps``); the schedule of the default
#: optimizer spans them, so ``wb.plan``'s default step is the Trainer's.
DEFAULT_STEPS = 200


def _decay_mask(params: Any) -> Any:
    """Weight decay on matrices only (rank >= 2): not on norm scales or biases."""
    import jax
    import numpy as np

    return jax.tree.map(lambda p: np.ndim(p) >= 2, params)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdamW:
    """AdamW with linear warmup, cosine decay, global-norm clipping and accumulation.

    ``build(total_steps)`` returns ``optax.MultiSteps(chain(clip_by_global_norm, adamw))``
    when ``accumulate > 1`` (the gradient of ``accumulate`` micro-batches is averaged
    before one update) and ``chain(clip_by_global_norm, adamw)`` otherwise.

    Attributes:
      lr: peak learning rate (reached after ``warmup_steps`` updates).
      warmup_steps: linear warmup from ``lr * init_ratio``.
      decay_steps: updates from 0 to the end of the cosine (warmup included);
        ``None`` uses the run's ``steps``.
      init_ratio: learning rate at step 0 as a fraction of ``lr``.
      end_ratio: learning rate at the end of the decay as a fraction of ``lr``.
      b1, b2, eps: Adam moments.
      weight_decay: decoupled weight decay, applied to rank >= 2 parameters only.
      clip_norm: clip gradients to this global norm (``None``: no clipping).
      accumulate: micro-batches per update (``optax.MultiSteps``); divides the batch.
    """

    lr: float = 3e-3
    warmup_steps: int = 10
    decay_steps: int | None = None
    init_ratio: float = 0.0
    end_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float | None = 1.0
    accumulate: int = 1

    def __post_init__(self) -> None:
        for name in ("lr", "init_ratio", "end_ratio", "b1", "b2", "eps", "weight_decay",
                     "clip_norm"):
            value = getattr(self, name)
            if value is None and name == "clip_norm":
                continue
            if isinstance(value, (bool, np.bool_)) or not isinstance(
                    value, (int, float, np.integer, np.floating)) or not math.isfinite(value):
                raise TypeError(f"AdamW.{name}={value!r} must be a finite number")
        for name in ("warmup_steps", "decay_steps", "accumulate"):
            if getattr(self, name) is not None or name != "decay_steps":
                check_int(getattr(self, name), f"AdamW.{name}", minimum=None)
        if self.lr <= 0:
            raise ValueError(f"AdamW.lr={self.lr} must be positive")
        if self.warmup_steps < 0:
            raise ValueError(f"AdamW.warmup_steps={self.warmup_steps} must be >= 0")
        if self.accumulate < 1:
            raise ValueError(f"AdamW.accumulate={self.accumulate} must be >= 1 micro-batches")
        if self.clip_norm is not None and self.clip_norm <= 0:
            raise ValueError(f"AdamW.clip_norm={self.clip_norm} must be positive or None")

    def replace(self, **changes: Any) -> AdamW:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form with ``"kind": "adamw"``."""
        return {"kind": "adamw", **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AdamW:
        """Inverse of :meth:`to_dict`."""
        fields = {k: v for k, v in d.items() if k != "kind"}
        if d.get("kind", "adamw") != "adamw":
            raise ValueError(f"unknown optimizer kind {d.get('kind')!r}; only 'adamw' exists")
        return cls(**fields)

    def schedule(self, total_steps: int) -> optax.Schedule:
        """Learning rate as a function of the update count (0-based)."""
        decay = self.decay_steps if self.decay_steps is not None else total_steps
        decay = max(decay, self.warmup_steps + 1)
        return optax.warmup_cosine_decay_schedule(
            init_value=self.lr * self.init_ratio, peak_value=self.lr,
            warmup_steps=self.warmup_steps, decay_steps=decay,
            end_value=self.lr * self.end_ratio)

    def build(self, total_steps: int) -> optax.GradientTransformation:
        """The optax transformation for a run of ``total_steps`` updates."""
        parts = [optax.clip_by_global_norm(self.clip_norm)] if self.clip_norm else []
        parts.append(optax.adamw(self.schedule(total_steps), b1=self.b1, b2=self.b2,
                                 eps=self.eps, weight_decay=self.weight_decay,
                                 mask=_decay_mask))
        tx = optax.chain(*parts)
        if self.accumulate > 1:
            return optax.MultiSteps(tx, every_k_schedule=self.accumulate).gradient_transformation()
        return tx

