"""TrainConfig: the frozen, JSON-round-trippable description of one training experiment.

One record, one file: the fields and what each means (the class docstring, a sixth of
the file), the checks made when a config is made (each value, then what the fields say of
each other), ``check`` of the files it names, and its JSON form (``to_dict``,
``from_dict``, ``hash``, ``diff``). Each check reads several fields and sets their one
form on the frozen record; moved apart, the record and its rules would be read in two
places."""
from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from workbench._hf_format.config import check_matches
from workbench._hub import CONFIG_FILES, resolve
from workbench._validate import check_int, check_path, check_revision, check_steps, is_hub_id
from workbench.data._corpus import TextData, corpus_files
from workbench.data._dataset import Dataset
from workbench.data._files import list_files
from workbench.data._pipeline import DataSpec, SyntheticData, as_spec
from workbench.data._tokenizer import check_vocab
from workbench.models._config import PRESETS, GPTConfig
from workbench.models._context import check_layout
from workbench.models._pipeline import Pipeline, check_pipeline
from workbench._sharding.rules import PRESETS as rules_presets
from workbench._sharding.rules import STAGE_AXIS, Rules
from workbench._runs import config_hash
from workbench.models._lora import LoRA
from workbench._optimizer import DEFAULT_STEPS, AdamW
from workbench.train._trackers import check_trackers

#: Fields that may change when an existing run is continued: they do not change the
#: numbers a step computes (checkpoint cadence, retention, the mesh layout).
RUN_CONTROL_FIELDS: tuple[str, ...] = ("checkpoint_every", "keep", "mesh", "rules",
                                        "pipeline", "eval_every", "eval_batches", "trackers")


#: Names accepted by ``TrainConfig.rules`` (``wb.Rules.preset``).
RULES_PRESETS: tuple[str, ...] = rules_presets

_FIXES = {"steps": "steps is the number of updates to train to, e.g. steps=200",
          "keep": "keep at least the newest checkpoint, keep=1"}

#: The largest seed: Grain's shuffle takes seeds from 0 to 2**32 - 1.
MAX_SEED = 2 ** 32 - 1


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
      mesh: mesh axes and sizes for ``wb.make_mesh`` (one size may be -1); default
        ``{"data": -1}``, every device on one axis (``workbench._sharding.placement``'s default).
      rules: a ``wb.Rules`` preset name ("dp", "fsdp", "tp", "fsdp_tp"), a ``Rules``
        or a mapping logical axis -> mesh axes (made a ``Rules``); default None:
        ``workbench._sharding.placement``'s default for the mesh, "fsdp_tp" with one model axis
        larger than 1, else "fsdp" (the run records which in ``run.json``'s
        ``placement``). A config stored with "fsdp" before this default keeps "fsdp".
      optimizer: the optimizer spec (``wb.train.AdamW``).
      data: "text" (the Python standard library's sources, byte-level), "synthetic",
        a ``wb.data.TextData`` / ``wb.data.SyntheticData``, or a ``wb.data.Dataset`` (your
        own files, tokenized and packed; its tokenizer's vocabulary must fit the model's).
      batch: global batch size (sequences per update, all processes together).
      seq: tokens per sequence. Longer than the model's ``seq_len`` is allowed with a
        warning naming both: the model computes at any length (RoPE has no position
        table; ``seq_len`` is only the model's default length), so refusing would block
        a legitimate experiment, but silently training at another length than the model
        config says is a surprise; ``model_overrides={"seq_len": seq}`` states it.
      steps: updates that ``Trainer.run()`` trains to (at least 1).
      checkpoint_every: save a checkpoint every this many steps (also at the end).
      keep: keep the newest ``keep`` checkpoints.
      seed: seeds parameter init, dropout keys and the data shuffle: an integer from 0
        to ``MAX_SEED`` (2**32 - 1, what Grain's shuffle takes).
      pipeline: None, or pipeline parallelism over the mesh's ``stage`` axis:
        ``{"microbatches": M, "schedule": "gpipe" | "circular", "repeats": R}``
        (``wb.models.Pipeline``); needs ``model_overrides={"scan_layers": True}``
        (stacked layers), ``n_layers`` divisible by stages x R and ``batch`` by M. The
        same numbers as without it, up to float rounding: it may change when a run is
        continued (like ``mesh``).
      eval_every: evaluate on the held-out split after every ``eval_every``-th update
        (0: never); needs a ``wb.data.Dataset`` with ``eval_fraction`` or ``eval_files``.
        ``eval_loss`` and ``eval_perplexity`` join that step's metrics. May change when a
        run is continued.
      eval_batches: batches of held-out rows each evaluation reads (the same ones every
        time).
      init: None (initialise from ``seed``), or a Hugging Face model whose weights start
        the run (``wb.hf.from_hf``'s loader, straight into this run's sharding): a local
        folder, or a Hub id ``"org/name"`` (an existing local path wins over an id).
        ``model`` must be its architecture: ``wb.hf.hf_config(init)`` (runtime fields such
        as ``scan_layers`` or ``remat`` may differ). A folder is stored as an absolute path;
        an id as given. ``run.json`` records the folder, and for an id the commit it
        resolved to, so a resumed run loads the same weights. A resumed run restores its
        checkpoints as usual and needs a local folder no more (nor does exporting it), so
        the same config is accepted once the folder has moved away.
      init_revision: the Hub repo's branch, tag or commit hash for an ``init`` id (None:
        "main", or the commit the run recorded when it started).
      lora: None, or LoRA fine-tuning (``wb.train.LoRA`` or a dict of its fields:
        ``{"rank": 16, "alpha": 32, "targets": ("q", "k", "v", "o")}``, optionally
        ``"base_dtype": "bfloat16"``): adapters on those projections train, the base
        (``init``'s weights, or the seed's) stays frozen; the optimizer state and the
        checkpoints hold the adapters only (``run.json`` records ``init``, the pointer to
        the base). ``model_config()`` carries it.
      trackers: where the step metrics go besides ``metrics.jsonl`` and the lab panel: a
        list of "tensorboard" (``<run_dir>/tensorboard``), "wandb" (Weights & Biases) and
        "mlflow", each needing its library (``workbench.train._trackers``). Each gets loss,
        eval loss, MFU, tokens/s, the config and the plan's summary from a thread of its
        own, so none slows a step and a failing one is a warning; a resumed run continues
        the same tracker run (its id in ``run.json``). May change when a run is continued.

    Every value is checked when the config is made, and nothing is read from disk:
    integers must be integers (not bools, strings or floats) in range, and the model
    preset and overrides must make a valid ``GPTConfig``; errors name the value, the
    constraint and the fix. The files the config names (the ``init`` folder, the data
    files) are checked by :meth:`check`, which ``wb.launch`` and the ``Trainer`` call
    before any process starts or anything is written.
    """

    model: str | Any = "tiny"
    model_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    mesh: Mapping[str, int] = dataclasses.field(default_factory=lambda: {"data": -1})
    rules: str | Any = None
    optimizer: AdamW = dataclasses.field(default_factory=AdamW)
    data: str | DataSpec = "text"
    batch: int = 8
    seq: int = 128
    steps: int = DEFAULT_STEPS
    checkpoint_every: int = 20
    keep: int = 3
    seed: int = 0
    pipeline: Any = None
    eval_every: int = 0
    eval_batches: int = 1
    init: str | None = None
    init_revision: str | None = None
    lora: Any = None
    trackers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        """Values only, in order: each field's own form and type, the numbers, then what
        fields say of each other (files are read by :meth:`check`)."""
        self._normalise()
        self._check_numbers()
        self._check_together()

    def _normalise(self) -> None:
        """Each field in its one form: mappings frozen, dicts made into their specs."""
        set_ = object.__setattr__
        set_(self, "lora", LoRA.of(self.lora))
        set_(self, "trackers", check_trackers(self.trackers))
        if self.pipeline is not None:
            set_(self, "pipeline", Pipeline.of(self.pipeline))
        if not isinstance(self.model_overrides, Mapping):
            raise TypeError(f"TrainConfig.model_overrides={self.model_overrides!r:.80} is a "
                            f"{type(self.model_overrides).__name__}; give a dict of GPTConfig "
                            "fields, e.g. model_overrides={'n_layers': 4}")
        set_(self, "model_overrides", _frozen_mapping(self.model_overrides))
        if isinstance(self.mesh, Mapping):
            set_(self, "mesh", _frozen_mapping(self.mesh))
        set_(self, "data", as_spec(self.data))
        if isinstance(self.optimizer, Mapping):
            set_(self, "optimizer", AdamW.from_dict(dict(self.optimizer)))
        if isinstance(self.rules, Mapping) and not hasattr(self.rules, "to_dict"):
            set_(self, "rules", Rules.from_dict({k: v for k, v in self.rules.items()
                                                 if k != "kind"}))
        elif self.rules is not None and not isinstance(self.rules, str) \
                and not hasattr(self.rules, "to_dict"):
            raise TypeError(f"TrainConfig.rules must be a preset name, a wb.Rules, a mapping "
                            f"or None (the default for the mesh); got {self.rules!r}")
        elif isinstance(self.rules, str) and self.rules not in RULES_PRESETS:
            raise ValueError(f"TrainConfig.rules={self.rules!r} is not a rules preset; choose "
                             f"one of {', '.join(RULES_PRESETS)}, or give a wb.Rules")

    def _check_numbers(self) -> None:
        """The integer fields and the mesh's sizes, each error naming the field."""
        set_ = object.__setattr__
        if not isinstance(self.optimizer, AdamW):
            raise TypeError(f"TrainConfig.optimizer={self.optimizer!r} must be a "
                            "wb.train.AdamW (or a dict of its fields)")
        if not isinstance(self.mesh, Mapping):
            raise TypeError(f"TrainConfig.mesh={self.mesh!r} must map axis names to sizes, "
                            "e.g. {'data': 8} or {'data': -1, 'model': 2}")
        for name in ("batch", "seq", "steps", "checkpoint_every", "keep"):
            set_(self, name, check_int(getattr(self, name), f"TrainConfig.{name}",
                                       fix=_FIXES.get(name, "")))
        check_steps(self.steps, "TrainConfig.steps")
        set_(self, "eval_every", check_int(self.eval_every, "TrainConfig.eval_every",
                                           minimum=0, fix="0 turns evaluation off"))
        set_(self, "eval_batches", check_int(self.eval_batches, "TrainConfig.eval_batches"))
        if self.eval_every and not getattr(self.data, "has_eval", False):
            raise ValueError(
                f"TrainConfig.eval_every={self.eval_every} needs held-out data; data="
                f"{self.data.to_dict().get('kind')!r} has none. Use data=wb.data.Dataset(..., "
                "eval_fraction=0.05) (or eval_files=...), or eval_every=0")
        set_(self, "seed", check_int(self.seed, "TrainConfig.seed", minimum=0,
                                     maximum=MAX_SEED,
                                     fix="Grain's shuffle takes 32-bit seeds; use seed % 2**32"))
        if not self.mesh or not all(isinstance(k, str) for k in self.mesh):
            raise ValueError(f"TrainConfig.mesh={dict(self.mesh)!r} must map axis names to "
                             "sizes, e.g. {'data': 8} or {'data': -1, 'model': 2}")
        set_(self, "mesh", _frozen_mapping({
            k: check_int(v, f"TrainConfig.mesh[{k!r}]", allow=(-1,))
            for k, v in self.mesh.items()}))

    def _check_together(self) -> None:
        """What the fields say of each other: accumulation divides the batch, LoRA needs a
        GPT, the tokenizer fits the model, seq against the model and the mesh, the
        pipeline, init and its revision."""
        acc = self.optimizer.accumulate
        if self.batch % acc:
            raise ValueError(f"batch={self.batch} is not divisible by optimizer.accumulate="
                             f"{acc} micro-batches; use a batch that is a multiple of {acc}")
        if self.lora is not None and getattr(self.model, "is_model_spec", False):
            raise ValueError("TrainConfig.lora adds adapters to a wb GPT's projections; "
                             f"model={self.model!r:.60} is your own nnx model: use a GPT "
                             "(a preset, a GPTConfig or init='org/name'), or lora=None")
        model = self._checked_model()
        if isinstance(self.data, Dataset) and hasattr(model, "vocab_size"):
            # the tokenizer the Dataset loaded, against the model (no file is read here)
            check_vocab(self.data.tokenizer, model.vocab_size)
        if self.seq > model.seq_len:
            warnings.warn(
                f"TrainConfig.seq={self.seq} is longer than the model's seq_len="
                f"{model.seq_len}. The model trains at {self.seq} tokens (RoPE has no length "
                "limit), at quadratic attention cost; if that is what you want, say so with "
                f"model_overrides={{'seq_len': {self.seq}}}, which also silences this warning",
                UserWarning, stacklevel=3)
        if self.rules is not None:   # (the default rules, fsdp or fsdp_tp, never split seq)
            check_layout(self.seq, dict(self.mesh), self.rules,   # context axes divide seq
                         zigzag=bool(getattr(self.model_config(), "context_zigzag", False)))
        if self.pipeline is not None:
            self._check_pipeline()
        if self.init is not None:
            self._check_init()
        if self.init_revision is not None:
            check_revision(self.init_revision, "TrainConfig", arg="init_revision")
            if not is_hub_id(self.init):
                raise ValueError(f"TrainConfig.init_revision={self.init_revision!r} picks a "
                                 f"revision of a Hub id; init={self.init!r} is "
                                 f"{'None' if self.init is None else 'a local path'}: drop "
                                 "init_revision, or give init='org/name'")

    def _check_init(self) -> None:
        """The init path, made absolute, or a Hub id as given (the folder or Hub repo is
        read by :meth:`check`)."""
        if not isinstance(self.init, (str, os.PathLike)) or not os.fspath(self.init).strip():
            raise TypeError(f"TrainConfig.init={self.init!r} must be a path to a Hugging Face "
                            "model folder, a Hub id ('org/name'), or None")
        check_path(self.init, "init", where="TrainConfig.")
        if is_hub_id(self.init):
            return
        # absolute: the run records it, and a job or an export may start in another folder
        object.__setattr__(self, "init", os.path.abspath(os.path.expanduser(
            os.fspath(self.init))))

    def check(self) -> TrainConfig:
        """Checks the files this config names; ``wb.launch`` and the ``Trainer`` call it
        before any process starts or anything is written.

        - ``init``: where the folder exists, its ``config.json`` must describe this
          config's model. A folder that is gone is no error here: a run with a checkpoint
          resumes and exports without it, and the Trainer raises, naming the path, when a
          run without checkpoints needs its weights. A Hub id: its ``config.json`` (only) is
          downloaded into the Hugging Face cache, or read there, and checked the same way.
        - ``data``: every glob of a ``wb.data.Dataset`` (``files``, ``eval_files``) matches
          a file, and a ``wb.data.TextData`` folder holds files of its patterns. (A
          Dataset's tokenizer file was read when the Dataset was made.)

        Returns:
          This config, so that ``cfg = wb.TrainConfig(...).check()`` reads as one step.

        Raises:
          ValueError: the ``init`` folder holds another architecture (the fields named),
            or its ``config.json`` cannot be read as a Hugging Face config.
          HubError: (an ``OSError``) the ``init`` id is not on the Hub, gated, or not
            cached with ``HF_HUB_OFFLINE=1``.
          FileNotFoundError: (``wb.data.DataError``'s ``DataFileNotFound``) a data glob
            matches no file, or a ``TextData`` folder is missing or holds none.
        """
        if self.init is not None and is_hub_id(self.init):
            hub = resolve(self.init, revision=self.init_revision, files=CONFIG_FILES,
                          where="TrainConfig", arg="init")
            check_matches(hub.path, self.model_config())
        elif self.init is not None and os.path.exists(self.init):
            check_matches(self.init, self.model_config())
        if isinstance(self.data, Dataset):
            for patterns in (self.data.files, self.data.eval_files):
                if patterns:
                    list_files(patterns)
        elif isinstance(self.data, TextData):
            corpus_files(self.data)
        return self

    def _checked_model(self) -> Any:
        """The resolved ``GPTConfig``; raises for a bad preset, override or model."""
        if getattr(self.model, "is_model_spec", False):  # wb.any_model.from_nnx / from_penzai
            return self.model.replace(**dict(self.model_overrides))
        if not isinstance(self.model, (str, GPTConfig)):
            raise TypeError(f"TrainConfig.model={self.model!r} must be a preset name "
                            f"({', '.join(PRESETS)}) or a wb.models.GPTConfig")
        known = {f.name for f in dataclasses.fields(GPTConfig)}
        unknown = sorted(set(self.model_overrides) - known)
        if unknown:
            raise ValueError(f"TrainConfig.model_overrides has unknown GPTConfig fields "
                             f"{unknown}; known: {sorted(known)}")
        return self.model_config()

    def _check_pipeline(self) -> None:
        """Pipeline errors that the config alone decides (before any mesh is built)."""
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
        if isinstance(self.model, str):
            cfg = GPTConfig.preset(self.model, **dict(self.model_overrides))
        else:
            cfg = self.model.replace(**dict(self.model_overrides)) if self.model_overrides \
                else self.model
        if self.lora is None or not isinstance(cfg, GPTConfig):
            return cfg
        dtype = {"param_dtype": self.lora.base_dtype} if self.lora.base_dtype else {}
        return cfg.replace(lora=self.lora, **dtype)

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
        rules = self.rules if self.rules is None or isinstance(self.rules, str) else \
            {"kind": "rules", **self.rules.to_dict()}
        return {
            "model": model, "model_overrides": dict(self.model_overrides),
            "mesh": dict(self.mesh), "rules": rules, "optimizer": self.optimizer.to_dict(),
            "data": self.data.to_dict(), "batch": self.batch, "seq": self.seq,
            "steps": self.steps, "checkpoint_every": self.checkpoint_every,
            "keep": self.keep, "seed": self.seed,
            # only when set: configs without a pipeline keep their hash
            **({"pipeline": self.pipeline.to_dict()} if self.pipeline is not None else {}),
            **({"eval_every": self.eval_every, "eval_batches": self.eval_batches}
               if self.eval_every else {}),
            **({"init": self.init} if self.init is not None else {}),
            **({"init_revision": self.init_revision} if self.init_revision is not None
               else {}),
            **({"lora": self.lora.to_dict()} if self.lora is not None else {}),
            **({"trackers": list(self.trackers)} if self.trackers else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrainConfig:
        """Builds a config from :meth:`to_dict` output (unknown keys are an error)."""
        if not isinstance(d, Mapping):
            raise TypeError(f"TrainConfig.from_dict: {d!r:.80} is a {type(d).__name__}, not "
                            "an object of TrainConfig fields; give TrainConfig.to_dict() "
                            "output (or to_json() text), e.g. {'model': 'tiny', 'steps': 200}")
        fields = dict(d)
        unknown = set(fields) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown TrainConfig fields {sorted(unknown)}; known: "
                             f"{[f.name for f in dataclasses.fields(cls)]}")
        if isinstance(fields.get("model"), Mapping) and fields["model"].get("kind") == "model":
            from workbench.any_model._spec import ModelRecord

            fields["model"] = ModelRecord(dict(fields["model"]))
        elif isinstance(fields.get("model"), Mapping):
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
        """Stable 12-hex-digit hash of the JSON form (``workbench._runs.config_hash``: the
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
