"""The one step resolver: model, mesh, rules, batch, seq and optimizer -> the checked inputs
of the train step that ``wb.plan`` compiles and the Trainer runs (``StepInputs``).

Both call :func:`resolve_step`, so the defaults (the placement, the dtype "auto", the
optimizer: ``wb.train.AdamW()`` over ``DEFAULT_STEPS`` updates) and the checks made before
anything is traced (placement, batch against the data-parallel devices, loss chunks, the
remat policy, the attention kernel for the dtype, the pipeline, context-parallel and MoE
layouts) exist once::

    inputs = resolve_step(cfg, mesh={"data": 8}, rules=None, batch=8, seq=128,
                          where="TrainConfig")
    inputs.optimizer, inputs.rules, inputs.attention, inputs.compile_options
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import optax

from workbench._optimizer import DEFAULT_STEPS, AdamW
from workbench._sharding.mesh import MeshInfo, mesh_info
from workbench._sharding.placement import Placement, resolve_placement
from workbench._sharding.rules import Rules
from workbench._step import check_loss_chunks
from workbench._train_state import (ModelFactory, abstract_param_state, logical_axes, model_factory,
                                    require_auto_axes)
from workbench._validate import nearest_multiples
from workbench.any_model._spec import ModelSpec, resolve_rules
from workbench.models import GPTConfig
from workbench.models import _attention_choice as attention_choice
from workbench.models import _moe_choice as moe_choice
from workbench.models._config import resolve_dtype
from workbench.models._pipeline import Pipeline, check_pipeline, check_rules, stages_of
from workbench.models._remat import remat_policy
from workbench.planning import _parallel_lints as lints
from workbench.planning._flags import compile_options
from workbench.planning._lints import Lint

__all__ = ["StepInputs", "resolve_step"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepInputs:
    """The inputs of one train step, resolved and checked (:func:`resolve_step`).

    Attributes:
        model: the GPTConfig with its dtype concrete for the platform, else the factory.
        cfg: that GPTConfig, or None for a model factory.
        factory: ``rngs -> model`` of ``model``.
        abstract: ``(graphdef, param state)`` of a factory (its annotations picked the
            rules), else None.
        info: the mesh (``MeshInfo``: real devices or an abstract slice).
        placement: the mesh and rules given or chosen by default, and why.
        rules: the rules the step shards by.
        batch: sequences per update; ``micro_batch``: per compiled step (``batch`` over the
            optimizer's accumulation).
        seq: tokens per sequence.
        optimizer: the optax transformation; ``schedule``: its learning rate by update
            (None for a transformation given as such).
        accumulate: micro-batches per update (1 unless an ``AdamW`` spec says more).
        pipeline: the pipeline stages, or None.
        dtype: the compute dtype and why ("float32: auto: float32 on cpu"; "" for a factory).
        attention: which attention runs and why ("" for a factory).
        compile_options: the XLA compile options (``planning._flags``).
        early_lints: the context-parallel and MoE lints known before tracing.
    """

    model: GPTConfig | ModelFactory
    cfg: GPTConfig | None
    factory: ModelFactory
    abstract: Any
    info: MeshInfo
    placement: Placement
    rules: Rules
    batch: int
    micro_batch: int
    seq: int
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule | None
    accumulate: int
    pipeline: Pipeline | None
    dtype: str
    attention: str
    compile_options: dict[str, Any]
    early_lints: list[Lint]


def resolve_step(model: GPTConfig | ModelFactory, *, mesh: Any, rules: Rules | str | None,
                 batch: int, seq: int, optimizer: Any = None, steps: int = DEFAULT_STEPS,
                 where: str, pipeline: Pipeline | Mapping[str, Any] | None = None,
                 overlap: bool | Mapping[str, Any] = True, compile: bool = True,
                 model_arg: str = "model") -> StepInputs:
    """The step's inputs, checked before anything is traced.

    Args:
        model: a ``GPTConfig`` (its dtype "auto" made concrete for the mesh's platform) or a
            callable ``rngs -> nnx.Module`` (its annotations pick rules when none are given).
        mesh, rules: as ``workbench._sharding.placement.resolve_placement`` takes them.
        batch: sequences per update (ints checked by the caller); the compiled step takes
            ``batch / accumulate`` of them.
        seq: tokens per sequence.
        optimizer: an optax transformation, a ``wb.train.AdamW`` spec (built for ``steps``
            updates), or None: ``AdamW()``, the Trainer's default.
        where: who asks ("wb.plan", "TrainConfig"), for the messages.
        model_arg: the name ``model`` was given under there (``wb.plan``'s
            "cfg_or_factory"), for the messages.
        pipeline: ``wb.models.Pipeline`` or its dict.
        overlap: the compile options' overlap flags (``planning._flags.compile_options``).
        compile: whether the step is compiled (not only estimated): a pipeline must then be
            trainable, and on real devices a layout error raises rather than being a lint.

    Raises:
        TypeError: a model or optimizer of the wrong kind.
        ValueError: a batch the data-parallel devices (or the accumulation) do not divide,
            and the errors of the checks above, each naming the value and the fix.
    """
    placement = resolve_placement(mesh, rules, where=where)
    info = mesh_info(placement.mesh)
    if info.jax_mesh is not None:
        require_auto_axes(info.jax_mesh)
    tx, schedule, accumulate = _optimizer(optimizer, steps, where)
    cfg, dtype = _model(model, info, f"{where}: {model_arg}")
    factory = model_factory(cfg if cfg is not None else model)
    abstract, step_rules = None, placement.rules
    if cfg is None:   # any NNX module: its annotations name mesh axes or logical axes
        abstract = abstract_param_state(factory)
        step_rules = resolve_rules(logical_axes(abstract[1]), rules, info,
                                   spec=factory if isinstance(factory, ModelSpec) else None)
        step_rules.check_mesh(info)
        if rules is None:
            placement = placement.from_annotations()
    micro = _micro_batch(batch, accumulate, step_rules, info, placement, rules, where)
    pipe = Pipeline.of(pipeline)
    attention, early = _check_model(cfg, step_rules, info, micro, seq, pipe, compile)
    return StepInputs(
        model=cfg if cfg is not None else model, cfg=cfg, factory=factory, abstract=abstract,
        info=info, placement=placement, rules=step_rules, batch=batch, micro_batch=micro,
        seq=seq, optimizer=tx, schedule=schedule, accumulate=accumulate, pipeline=pipe,
        dtype=dtype, attention=attention, early_lints=early,
        compile_options=compile_options(info.platform, overlap,
                                        device=info.hardware or info.device_kind))


def _optimizer(optimizer: Any, steps: int, where: str
               ) -> tuple[optax.GradientTransformation, optax.Schedule | None, int]:
    """``(transformation, schedule, accumulate)`` of an optax transformation, an ``AdamW``
    spec, or None (``AdamW()``)."""
    spec = AdamW() if optimizer is None else optimizer
    if isinstance(spec, AdamW):
        return spec.build(steps), spec.schedule(steps), spec.accumulate
    if callable(getattr(spec, "init", None)) and callable(getattr(spec, "update", None)):
        return spec, None, 1
    raise TypeError(f"{where}: optimizer={optimizer!r:.80} is a {type(optimizer).__name__}, "
                    "not an optax transformation (with init and update) nor a "
                    "wb.train.AdamW; give e.g. optimizer=wb.train.AdamW(lr=1e-3) or "
                    "optax.adamw(3e-4), or leave it out for AdamW(), the Trainer's default")


def _model(model: Any, info: MeshInfo, named: str) -> tuple[GPTConfig | None, str]:
    """``(GPTConfig with a concrete dtype, "dtype: why")``, or ``(None, "")`` for a
    factory; anything else is refused (``named``: "wb.plan: cfg_or_factory")."""
    if isinstance(model, GPTConfig):
        concrete, why = resolve_dtype(model.dtype, info.platform)
        return model.replace(dtype=concrete), f"{concrete}: {why}"
    if not callable(model):
        raise TypeError(f"{named}={model!r:.80} is a {type(model).__name__}; give a "
                        "GPTConfig (e.g. wb.models.GPTConfig.preset('tiny')) or a callable "
                        "rngs -> nnx.Module (wb.any_model.from_nnx(...))")
    return None, ""


def _micro_batch(batch: int, accumulate: int, rules: Rules, info: MeshInfo,
                 placement: Placement, given: Any, where: str) -> int:
    """The compiled step's batch, ``batch / accumulate``, refused unless the accumulation
    and the data-parallel devices divide it (JAX could not lay it out, nor split it into
    micro-batches), naming the nearest batches that work."""
    if batch % accumulate:
        raise ValueError(f"{where}: batch={batch} is not divisible by optimizer.accumulate="
                         f"{accumulate} micro-batches; use a batch that is a multiple of "
                         f"{accumulate}")
    micro = batch // accumulate
    axes = tuple(a for a in rules.axes("batch") if a in info.shape)
    shards = math.prod(info.shape[a] for a in axes)
    if micro % shards == 0:
        return micro
    what = f"batch={batch}" if accumulate == 1 else \
        f"the micro-batch batch/accumulate={batch}/{accumulate}={micro}"
    near = " or ".join(f"batch={b}" for b in nearest_multiples(batch, shards * accumulate))
    how = f"rules {given!r}" if isinstance(given, str) else "the rules" if given is not None \
        else f"the default rules {placement.preset!r}" if placement.preset else \
        "the default rules"
    raise ValueError(
        f"{where}: {what} is not divisible by the {shards} devices that split the batch dim "
        f"(the data-parallel size): {how} split the batch over mesh axes {axes} of mesh "
        f"{' x '.join(f'{n}={s}' for n, s in info.shape.items())}; use {near} (a multiple "
        f"of {shards * accumulate}), or rules/mesh axes whose sizes divide {micro}")


def _check_model(cfg: GPTConfig | None, rules: Rules, info: MeshInfo, batch: int, seq: int,
                 pipe: Pipeline | None, compile: bool) -> tuple[str, list[Lint]]:
    """What a GPT and the mesh decide together, before tracing: loss chunks, the remat
    policy and the attention kernel (for the compute dtype) on the platform, the pipeline,
    MoE and context-parallel layouts. Returns which attention runs and why, and the early
    lints (on real devices that compile, an error raises)."""
    if pipe is not None:
        _check_pipeline(pipe, cfg, rules, info, batch, train=compile)
    if cfg is None:
        return "", []
    check_loss_chunks(cfg.loss_chunks, seq)
    remat_policy(cfg.remat, info.platform)
    problem = attention_choice.splash_layout_problem(
        (batch, seq, cfg.n_heads, cfg.head_dim), cfg.n_kv_heads, rules=rules,
        mesh=info) if cfg.attention == "auto" else None
    r = attention_choice.check(cfg.attention, info.platform, seq=seq, head_dim=cfg.head_dim,
                               n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                               block_sizes=cfg.attention_block_sizes, layout_problem=problem,
                               dtype=cfg.dtype)
    real = compile and info.jax_mesh is not None
    if real:
        moe_choice.check_layout(cfg, rules, info)   # experts vs the expert axis
    early = (lints.context_parallel(cfg, rules, info, seq, batch)
             + lints.moe(cfg, rules, info, batch, seq))
    error = next((w for w in early if w.severity == "error"), None)
    if error is not None and real:
        raise ValueError(f"{error.message}; {error.fix}")
    return f"{r.impl}: {r.reason}", early


def _check_pipeline(pipe: Pipeline, cfg: GPTConfig | None, rules: Rules, info: MeshInfo,
                    batch: int, *, train: bool) -> None:
    """The pipeline's errors: stacked layers, the stage axis in the rules, layers and
    micro-batches against the stages and the batch axes."""
    if cfg is None or not cfg.scan_layers:
        raise ValueError(
            f"pipeline={pipe.to_dict()} splits stacked layers into stages: give a GPTConfig "
            f"with scan_layers=True (cfg.replace(scan_layers=True))")
    check_rules(pipe, rules, info)
    shards = math.prod(info.shape[a] for a in rules.axes("batch") if a in info.shape)
    check_pipeline(pipe, n_layers=cfg.n_layers, stages=stages_of(info), batch=batch,
                   batch_shards=shards, train=train)
