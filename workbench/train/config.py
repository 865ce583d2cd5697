"""TrainConfig: the frozen, JSON-round-trippable description of one training experiment."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from workbench.data.corpus import TextData
from workbench.data.pipeline import DataSpec, SyntheticData, data_spec
from workbench.runs import config_hash
from workbench.train.optim import AdamW

#: Fields that may change when an existing run is continued: they do not change the
#: numbers a step computes (checkpoint cadence, retention, the mesh layout).
RUN_CONTROL_FIELDS: tuple[str, ...] = ("checkpoint_every", "keep", "mesh", "rules",
                                        "pipeline")


def _frozen_mapping(value: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(value or {}))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training experiment; every field has a default.

    Example::

        cfg = wb.TrainConfig(model="tiny", mesh={"data": 8}, rules="fsdp", batch=8,
                             seq=128, steps=200, checkpoint_every=20, keep=3, seed=0,
                             data="text")
        cfg.replace(steps=400).to_json()

    Attributes:
      model: a preset name of ``wb.models.GPTConfig`` ("tiny", "small", ...) or a
        ``GPTConfig``.
      model_overrides: fields changed on top of the preset (``{"n_layers": 4}``).
      mesh: mesh axes and sizes for ``wb.make_mesh`` (one size may be -1).
      rules: a ``wb.Rules`` preset name ("dp", "fsdp", "tp", "fsdp_tp"), a ``Rules``
        or a mapping logical axis -> mesh axes (made a ``Rules``).
      optimizer: the optimizer spec (``wb.train.AdamW``).
      data: "text" (the Python standard library's sources, byte-level), "synthetic",
        or a ``wb.data.TextData`` / ``wb.data.SyntheticData``.
      batch: global batch size (sequences per update, all processes together).
      seq: tokens per sequence.
      steps: updates that ``Trainer.run()`` trains to.
      checkpoint_every: save a checkpoint every this many steps (also at the end).
      keep: keep the newest ``keep`` checkpoints.
      seed: seeds parameter init, dropout keys and the data shuffle.
      pipeline: None, or pipeline parallelism over the mesh's ``stage`` axis:
        ``{"microbatches": M, "schedule": "gpipe" | "circular", "repeats": R}``
        (``wb.models.pipeline.Pipeline``); needs ``model_overrides={"scan_layers": True}``
        (stacked layers), ``n_layers`` divisible by stages x R and ``batch`` by M. The
        same numbers as without it, up to float rounding: it may change when a run is
        continued (like ``mesh``).
    """

    model: str | Any = "tiny"
    model_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    mesh: Mapping[str, int] = dataclasses.field(default_factory=lambda: {"data": -1})
    rules: str | Any = "fsdp"
    optimizer: AdamW = dataclasses.field(default_factory=AdamW)
    data: str | DataSpec = "text"
    batch: int = 8
    seq: int = 128
    steps: int = 200
    checkpoint_every: int = 20
    keep: int = 3
    seed: int = 0
    pipeline: Any = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if self.pipeline is not None:
            from workbench.models.pipeline import Pipeline

            set_(self, "pipeline", Pipeline.of(self.pipeline))
        set_(self, "model_overrides", _frozen_mapping(self.model_overrides))
        set_(self, "mesh", _frozen_mapping(self.mesh))
        set_(self, "data", data_spec(self.data))
        if isinstance(self.optimizer, Mapping):
            set_(self, "optimizer", AdamW.from_dict(dict(self.optimizer)))
        if isinstance(self.rules, Mapping) and not hasattr(self.rules, "to_dict"):
            from workbench.rules import Rules

            set_(self, "rules", Rules.from_dict({k: v for k, v in self.rules.items()
                                                 if k != "kind"}))
        elif not isinstance(self.rules, str) and not hasattr(self.rules, "to_dict"):
            raise TypeError(f"TrainConfig.rules must be a preset name, a wb.Rules or a mapping; "
                            f"got {self.rules!r}")
        for name in ("batch", "seq", "checkpoint_every", "keep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TrainConfig.{name}={value!r} must be a positive integer")
        if not isinstance(self.steps, int) or self.steps < 0:
            raise ValueError(f"TrainConfig.steps={self.steps!r} must be an integer >= 0")
        if not self.mesh or not all(isinstance(k, str) and isinstance(v, int)
                                    for k, v in self.mesh.items()):
            raise ValueError(f"TrainConfig.mesh={dict(self.mesh)!r} must map axis names to "
                             "sizes, e.g. {'data': 8} or {'data': -1, 'model': 2}")
        acc = self.optimizer.accumulate
        if self.batch % acc:
            raise ValueError(f"batch={self.batch} is not divisible by optimizer.accumulate="
                             f"{acc} micro-batches; use a batch that is a multiple of {acc}")
        if isinstance(self.model, str):
            from workbench.models.config import GPTConfig

            GPTConfig.preset(self.model, **dict(self.model_overrides))  # validates early
        from workbench.models.context import check_layout  # context axis divides seq

        check_layout(self.seq, dict(self.mesh), self.rules,
                     zigzag=bool(getattr(self.model_config(), "context_zigzag", False)))
        if self.pipeline is not None:
            self._check_pipeline()

    def _check_pipeline(self) -> None:
        """Pipeline errors that the config alone decides (before any mesh is built)."""
        from workbench.models.config import GPTConfig
        from workbench.models.pipeline import check_pipeline
        from workbench.rules import STAGE_AXIS

        cfg = self.model_config()
        if not isinstance(cfg, GPTConfig) or not cfg.scan_layers:
            raise ValueError(
                f"pipeline={self.pipeline.to_dict()} splits stacked layers into stages; the "
                f"model has scan_layers=False. Add model_overrides={{'scan_layers': True, "
                f"...}} (stack_blocks converts unrolled parameters)")
        stages = self.mesh.get(STAGE_AXIS)
        if stages is None:
            raise ValueError(
                f"pipeline={self.pipeline.to_dict()} needs a {STAGE_AXIS!r} mesh axis; mesh="
                f"{dict(self.mesh)}. Use e.g. mesh={{'stage': 4, 'data': -1}}")
        if stages > 0:
            check_pipeline(self.pipeline, n_layers=cfg.n_layers, stages=stages,
                           batch=self.micro_batch)

    def __hash__(self) -> int:
        return hash(self.to_json())

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        return (TrainConfig.from_dict, (self.to_dict(),))

    # ------------------------------------------------------------------ derived
    def model_config(self) -> Any:
        """The resolved ``GPTConfig`` (preset or given config, plus overrides)."""
        from workbench.models.config import GPTConfig

        if isinstance(self.model, str):
            return GPTConfig.preset(self.model, **dict(self.model_overrides))
        return self.model.replace(**dict(self.model_overrides)) if self.model_overrides \
            else self.model

    @property
    def micro_batch(self) -> int:
        """Sequences per train-step call: ``batch / optimizer.accumulate``."""
        return self.batch // self.optimizer.accumulate

    @property
    def tokens_per_step(self) -> int:
        """Tokens consumed by one update."""
        return self.batch * self.seq

    # ------------------------------------------------------------------ JSON
    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict; ``TrainConfig.from_dict`` inverts it."""
        model = self.model if isinstance(self.model, str) else self.model.to_dict()
        rules = self.rules if isinstance(self.rules, str) else \
            {"kind": "rules", **self.rules.to_dict()}
        return {
            "model": model, "model_overrides": dict(self.model_overrides),
            "mesh": dict(self.mesh), "rules": rules, "optimizer": self.optimizer.to_dict(),
            "data": self.data.to_dict(), "batch": self.batch, "seq": self.seq,
            "steps": self.steps, "checkpoint_every": self.checkpoint_every,
            "keep": self.keep, "seed": self.seed,
            # only when set: configs without a pipeline keep their hash
            **({"pipeline": self.pipeline.to_dict()} if self.pipeline is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrainConfig:
        """Builds a config from :meth:`to_dict` output (unknown keys are an error)."""
        fields = dict(d)
        unknown = set(fields) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown TrainConfig fields {sorted(unknown)}; known: "
                             f"{[f.name for f in dataclasses.fields(cls)]}")
        if isinstance(fields.get("model"), Mapping):
            from workbench.models.config import GPTConfig

            fields["model"] = GPTConfig(**fields["model"])
        if isinstance(fields.get("optimizer"), Mapping):
            fields["optimizer"] = AdamW.from_dict(dict(fields["optimizer"]))
        return cls(**fields)

    def to_json(self, indent: int | None = None) -> str:
        """The config as JSON text, in ``to_dict()`` order: not key-sorted, since the order
        of ``mesh`` axes is the mesh's major-to-minor layout (``{"data": 2, "context": 4}``
        puts each context group inside a process). ``hash()`` sorts keys itself."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str | Mapping[str, Any]) -> TrainConfig:
        """Inverse of :meth:`to_json` (also accepts the parsed dict)."""
        return cls.from_dict(json.loads(text) if isinstance(text, str) else text)

    def hash(self, *, exclude: tuple[str, ...] = ()) -> str:
        """Stable 12-hex-digit hash of the JSON form (``workbench.runs.config_hash``: the
        ``config_hash`` a run directory's ``run.json`` stores for ``to_dict()``).

        Args:
          exclude: fields left out (``RUN_CONTROL_FIELDS`` gives the hash of what the
            numbers depend on).
        """
        return config_hash({k: v for k, v in self.to_dict().items() if k not in exclude})

    def diff(self, other: TrainConfig | Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
        """Fields that differ, flattened with dots: ``{"optimizer.lr": (3e-3, 1e-3)}``."""
        mine = _flatten(self.to_dict())
        theirs = _flatten(other.to_dict() if isinstance(other, TrainConfig) else dict(other))
        return {k: (mine.get(k), theirs.get(k)) for k in sorted(set(mine) | set(theirs))
                if mine.get(k) != theirs.get(k)}


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


__all__ = ["RUN_CONTROL_FIELDS", "SyntheticData", "TextData", "TrainConfig"]
