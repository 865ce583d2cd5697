"""LoRA: the frozen description of low-rank adapters (rank, alpha, targets); pure data, beside
GPTConfig (its ``lora`` field). The adapters themselves are ``_lora``."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from workbench._validate import check_int
from workbench.models._dtypes import float_dtype

#: The attention projections an adapter can target (``Attention.q/k/v/o``).
ATTENTION_TARGETS: tuple[str, ...] = ("q", "k", "v", "o")
#: The SwiGLU projections (``MLP.gate/up/down``; dense blocks only).
MLP_TARGETS: tuple[str, ...] = ("gate", "up", "down")
#: Every projection name ``LoRA.targets`` accepts.
PROJECTIONS: tuple[str, ...] = ATTENTION_TARGETS + MLP_TARGETS

_LORA = "LoRA: "


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRA:
    """Low-rank adapters for fine-tuning (``TrainConfig(lora=...)``).

    Example::

        wb.TrainConfig(init="Qwen/Qwen3-0.6B", lora={"rank": 16, "alpha": 32})
        wb.TrainConfig(model="tiny", lora=wb.train.LoRA(rank=8, alpha=16,
                                                        targets=("q", "v")))

    Attributes:
      rank: the adapters' rank r (a positive int, at most the smaller feature size of
        every target).
      alpha: the scale numerator: adapters add ``alpha / rank * B(A(x))`` (> 0).
      targets: the projections that get an adapter, a non-empty subset of
        :data:`PROJECTIONS` ("q", "k", "v", "o", "gate", "up", "down").
      dropout: dropout on the adapters' input; only 0.0 (the train step draws no
        dropout keys yet).
      base_dtype: the frozen base's parameter dtype (None: the model's ``param_dtype``,
        float32 by default; "bfloat16" halves the base's memory). The adapters are
        float32 either way.
    """

    rank: int
    alpha: float
    targets: tuple[str, ...] = ATTENTION_TARGETS
    dropout: float = 0.0
    base_dtype: str | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "rank", check_int(self.rank, "rank", where=_LORA,
                                     fix="the rank is the adapters' inner size, e.g. 16"))
        set_(self, "alpha", _positive(self.alpha, "alpha", "e.g. alpha=2 * rank"))
        set_(self, "targets", _targets(self.targets))
        d = self.dropout
        if isinstance(d, (bool, np.bool_)) or not isinstance(
                d, (int, float, np.integer, np.floating)) or not math.isfinite(d):
            raise TypeError(f"{_LORA}dropout={d!r} must be a number; use 0.0")
        if d != 0:
            raise ValueError(f"{_LORA}dropout={d!r}: adapter dropout is not implemented "
                             "(the train step draws no dropout keys); use dropout=0.0")
        set_(self, "dropout", float(d))
        if self.base_dtype is not None:
            set_(self, "base_dtype", float_dtype(self.base_dtype, "LoRA.base_dtype"))

    @property
    def scale(self) -> float:
        """``alpha / rank``, the factor on ``B(A(x))``."""
        return self.alpha / self.rank

    @classmethod
    def of(cls, value: Any) -> LoRA | None:
        """None, a ``LoRA``, or a mapping of its fields (``{"rank": 16, "alpha": 32}``)."""
        if value is None or isinstance(value, LoRA):
            return value
        if isinstance(value, Mapping):
            known = [f.name for f in dataclasses.fields(cls)]
            unknown = sorted(str(k) for k in value if k not in known)
            if unknown:
                raise ValueError(f"{_LORA}unknown field(s) {unknown}; known: {known}")
            missing = [k for k in ("rank", "alpha") if k not in value]
            if missing:
                raise ValueError(f"{_LORA}{missing} missing; give at least rank and alpha, "
                                 "e.g. {'rank': 16, 'alpha': 32}")
            return cls(**dict(value))
        raise TypeError(f"lora={value!r:.80} is a {type(value).__name__}; give None, a "
                        "wb.train.LoRA or a dict like {'rank': 16, 'alpha': 32, 'targets': "
                        "('q', 'k', 'v', 'o')}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly fields (``LoRA.of`` inverts it)."""
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets),
                "dropout": self.dropout, "base_dtype": self.base_dtype}

    def replace(self, **changes: Any) -> LoRA:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def check_model(self, cfg: Any) -> None:
        """Raise unless every target exists in ``cfg``'s blocks and ``rank`` fits its dims.

        Raises:
          ValueError: an MLP target on a mixture-of-experts model (its experts have no
            adapters), or ``rank`` larger than a target's input or output features.
        """
        if getattr(cfg, "n_experts", 0):
            bad = [t for t in self.targets if t in MLP_TARGETS]
            if bad:
                raise ValueError(f"{_LORA}targets {bad} are MLP projections; this model's "
                                 f"MLPs are mixtures of {cfg.n_experts} experts, which take "
                                 f"no adapters. Use attention targets "
                                 f"{list(ATTENTION_TARGETS)}")
        for t in self.targets:
            fin, fout = lora_features(cfg, t)
            if self.rank > min(fin, fout):
                raise ValueError(
                    f"{_LORA}rank={self.rank} is larger than projection {t!r} ({fin} -> "
                    f"{fout} features): a rank past min(in, out)={min(fin, fout)} adds "
                    f"nothing a full update would not; use rank <= {min(fin, fout)}")


def _positive(value: Any, name: str, example: str) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(
            value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{_LORA}{name}={value!r:.80} is a {type(value).__name__}; give a "
                        f"positive number, {example}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{_LORA}{name}={value!r} must be a positive finite number, "
                         f"{example}")
    return float(value)


def _targets(value: Any) -> tuple[str, ...]:
    choices = ", ".join(repr(p) for p in PROJECTIONS)
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (tuple, list)) or not all(isinstance(t, str) for t in value):
        raise TypeError(f"{_LORA}targets={value!r:.80} must be a tuple of projection names "
                        f"from {choices}")
    if not value:
        raise ValueError(f"{_LORA}targets=() is empty; give at least one of {choices}")
    bad = [t for t in value if t not in PROJECTIONS]
    if bad:
        raise ValueError(f"{_LORA}targets {bad} are not projections of the model; choose "
                         f"from {choices}")
    if len(set(value)) != len(value):
        raise ValueError(f"{_LORA}targets={tuple(value)!r} names a projection twice")
    return tuple(t for t in PROJECTIONS if t in value)   # canonical order


def lora_features(cfg: Any, target: str) -> tuple[int, int]:
    """``(in_features, out_features)`` of projection ``target`` (flattened heads)."""
    d, f = cfg.d_model, cfg.d_ff
    nh, kh = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return {"q": (d, nh), "k": (d, kh), "v": (d, kh), "o": (nh, d),
            "gate": (d, f), "up": (d, f), "down": (f, d)}[target]
