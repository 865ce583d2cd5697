"""The stages of ``wb.plan``, in order: resolve the inputs, choose the compile target,
build the abstract step (the Trainer's own, from ``workbench._step``), measure it (compiler
or formulas: ``workbench.planning._measure``), lint it. ``planner.plan`` runs them and assembles the report; each stage is a
small function of the previous stages' records."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any
from warnings import warn

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from workbench._validate import check_int
from workbench._flops import FlopCount, gpt_flops, jaxpr_step_flops
from workbench._sharding.layouts import Layout
from workbench._sharding.mesh import MeshInfo
from workbench.models import GPTConfig
from workbench.any_model._spec import ModelSpec
from workbench.models._pipeline import TRAINABLE_SCHEDULES, Pipeline, stages_of
from workbench.perf import _analytic as analytic
from workbench.planning import _lints as lints
from workbench.planning._lints import Lint
from workbench.planning._measure import Measured, Target, measure
from workbench.planning._step_inputs import StepInputs, resolve_step
from workbench.models._schedule import in_flight, schedule_bubble, timeline
from workbench._sharding.pytrees import tree_layouts
from workbench._sharding.rules import Rules
from workbench._step import LossFn, jit_train_step, lm_loss, make_train_step
from workbench._train_state import (ModelFactory, abstract_batch, abstract_train_state,
                                    batch_logical_axes)
from workbench._sharding.topology import tpu_target

__all__ = ["AbstractStep", "Inputs", "Setup", "build_step", "choose_target", "lint",
           "resolve"]


# -- 1. resolve the inputs ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class Inputs:
    """What ``wb.plan`` was asked, resolved: the model (``cfg`` for a GPTConfig, else None,
    its ``dtype`` concrete for the mesh's platform; ``factory`` always), the mesh, the
    rules, batch and sequence, the optimizer and loss, the batch's shapes, the pipeline and
    the options that pick the compile target; ``asked``: the GPTConfig as given (with
    ``wb.plan(dtype=)``), which the report keeps; ``dtype``: the compute dtype and why
    ("bfloat16: auto: bfloat16 on tpu"; "" for a model factory); ``batch``: the compiled
    step's (``batch / accumulate`` for an ``AdamW`` spec that accumulates); ``step``: the
    resolver's record, the Trainer's too."""

    cfg: GPTConfig | None
    factory: ModelFactory
    abstract: Any                      # (graphdef, param state) of a factory, else None
    info: MeshInfo
    rules: Rules
    rules_name: str | None
    batch: int
    seq: int
    optimizer: optax.GradientTransformation
    loss_fn: LossFn
    example_batch: Mapping[str, jax.ShapeDtypeStruct] | None
    pipe: Pipeline | None
    compile: bool | None
    name: str | None
    memory_limit: int | None
    overlap: bool | Mapping[str, Any]
    asked: GPTConfig | None = None
    dtype: str = ""
    #: where the mesh and rules came from (``workbench._sharding.placement``: given, or the default)
    placement: str = ""
    #: the rules' preset name, given or chosen by default (None for a given ``Rules``)
    preset: str | None = None
    #: the step's inputs as the Trainer resolves them (``planning._step_inputs``)
    step: StepInputs


def resolve(cfg_or_factory: GPTConfig | ModelFactory, *, mesh: Any, rules: Rules | str | None,
            batch: int, seq: int | None, optimizer: Any, dtype: str | None, name: str | None,
            compile: bool | None, memory_limit: int | None, loss_fn: LossFn,
            example_batch: Mapping[str, jax.ShapeDtypeStruct] | None,
            pipeline: Pipeline | Mapping[str, Any] | None,
            overlap: bool | Mapping[str, Any]) -> Inputs:
    """Check and complete ``wb.plan``'s arguments (before anything is traced): ints, the
    sequence length, the dtype override, then the step's inputs by the resolver the Trainer
    uses too (``planning._step_inputs.resolve_step``: placement, rules, optimizer, batch,
    kernels, pipeline), and a model factory's own loss and example batch."""
    batch = check_int(batch, "batch", where="wb.plan: ",
                      fix="batch is the global number of sequences per step, e.g. batch=8")
    if seq is not None:
        seq = check_int(seq, "seq", where="wb.plan: ",
                        fix="seq is tokens per sequence; leave it out for the model's seq_len")
    if memory_limit is not None:
        memory_limit = check_int(memory_limit, "memory_limit", where="wb.plan: ",
                                 fix="bytes per device, e.g. memory_limit=16 * 2**30")
    if compile is not None and not isinstance(compile, bool):
        raise TypeError(f"compile must be True, False or None, got {compile!r}")
    asked = cfg_or_factory if isinstance(cfg_or_factory, GPTConfig) else None
    if dtype is not None:
        if asked is None:
            raise ValueError(f"dtype={dtype!r} applies to a GPTConfig; a model factory sets "
                             "its own dtypes")
        asked = asked.replace(dtype=dtype)
    seq = _plan_seq(seq, asked)
    pipe = Pipeline.of(pipeline)
    if pipe is not None and compile is None and pipe.schedule not in TRAINABLE_SCHEDULES:
        compile = False   # planned by formula: the step has no 1F1B program
    step = resolve_step(asked if asked is not None else cfg_or_factory, mesh=mesh,
                        rules=rules, batch=batch, seq=seq, optimizer=optimizer,
                        where="wb.plan", pipeline=pipe, overlap=overlap,
                        compile=compile is not False, model_arg="cfg_or_factory")
    spec = step.factory if isinstance(step.factory, ModelSpec) else None
    if spec is not None:   # a wb.any_model.from_nnx model carries its loss and batch
        loss_fn = spec.loss_fn if spec.loss_fn is not None and loss_fn is lm_loss else loss_fn
        if example_batch is None and spec.example_batch is not None:
            example_batch = spec.batch(step.micro_batch, seq)
    return Inputs(cfg=step.cfg, factory=step.factory, abstract=step.abstract, info=step.info,
                  rules=step.rules, rules_name=rules if isinstance(rules, str) else None,
                  batch=step.micro_batch, seq=seq, optimizer=step.optimizer, loss_fn=loss_fn,
                  example_batch=example_batch, pipe=pipe, compile=compile, name=name,
                  memory_limit=memory_limit, overlap=overlap, asked=asked, dtype=step.dtype,
                  placement=step.placement.why, preset=step.placement.preset, step=step)


def _plan_seq(seq: int | None, cfg: GPTConfig | None) -> int:
    """The planned sequence length: ``seq``, else the model's ``seq_len`` (1 for a factory);
    longer than the model's ``seq_len`` is planned with a warning naming both."""
    if seq is None:
        return cfg.seq_len if cfg is not None else 1
    if cfg is not None and seq > cfg.seq_len:
        warn(
            f"wb.plan: seq={seq} is longer than the model's seq_len={cfg.seq_len}; the plan is "
            f"for {seq} tokens (RoPE has no length limit, attention costs grow as seq**2). "
            f"Plan cfg.replace(seq_len={seq}) to say so and silence this warning",
            UserWarning, stacklevel=4)
    return seq


# -- 2. choose the compile target ----------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class Setup:
    """The compile target and what was checked against it before tracing: the XLA
    compile options, the attention that runs (and why), and the lints that are known
    before tracing (context parallelism, MoE)."""

    target: Target
    platform: str
    options: dict[str, Any]
    attention: str
    early_lints: list[Lint]

    @property
    def mesh(self) -> Any:
        """The mesh the step is built on: the target's devices, else the abstract mesh."""
        return self.target.mesh


def choose_target(inp: Inputs) -> Setup:
    """Where the step is compiled (the devices at hand, the TPU compiler for an abstract
    TPU slice, or nowhere: formulas), with what the resolver checked for the mesh's
    platform (attention, compile options, context-parallel and MoE lints). An error lint
    of an abstract mesh turns the target into an estimate that says it."""
    target = _compile_target(inp.info, inp.compile)
    platform = "tpu" if target.source == "tpu-compiler" else inp.info.platform
    early = inp.step.early_lints
    error = next((w for w in early if w.severity == "error"), None)
    if error is not None and target.compile:   # (on real devices the resolver raised)
        target = target.estimate(f"analytic estimate: {error.message}")
    return Setup(target=target, platform=platform, options=inp.step.compile_options,
                 attention=inp.step.attention, early_lints=early)


def _compile_target(info: Any, compile: bool | None) -> Target:
    """Real devices compile on themselves; an abstract TPU preset compiles for its
    topology with the TPU compiler when it is installed; anything else is estimated."""
    if info.jax_mesh is not None:
        platform = info.platform
        return Target(mesh=info.jax_mesh, compile=compile is not False,
                      source=f"{platform}-compiler", topology=None,
                      reason=f"compiled by XLA for the {platform.upper()} devices at hand")
    if compile is False:
        return Target(mesh=None, compile=False, source="estimate", topology=None,
                      reason="compile=False: analytic estimate")
    tgt = tpu_target(info)
    if tgt.mesh is None:
        if compile:
            raise ValueError(f"compile=True cannot compile for {info.describe()}: "
                             f"{tgt.reason}")
        return Target(mesh=None, compile=False, source="estimate", topology=tgt.topology,
                      reason=f"analytic estimate: {tgt.reason}")
    return Target(mesh=tgt.mesh, compile=True, source="tpu-compiler", topology=tgt.topology,
                  reason=tgt.reason)


# -- 3. build the abstract step --------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class AbstractStep:
    """The Trainer's step built without allocating: the abstract state with its shardings
    (``state``: ``step.AbstractTrainState``), the batch, every tensor's layout, the
    analytic FLOPs and memory, the pipeline's formulas, and the jitted step (None on an
    abstract mesh with no compile target)."""

    state: Any
    example: dict[str, jax.ShapeDtypeStruct]
    batch: dict[str, jax.ShapeDtypeStruct]
    batch_shardings: dict[str, Any]
    layouts: dict[str, Layout]
    flops: FlopCount
    activations: int | None
    pipeline: dict[str, Any] | None
    limit: int | None
    estimate: dict[str, Any]
    jitted: Any

    def layouts_of(self, prefix: str, *, strip: bool = False) -> dict[str, Layout]:
        """The layouts whose path starts with ``prefix`` ("params.", "opt_state.",
        "batch."), with the prefix removed when ``strip``."""
        return {(k[len(prefix):] if strip else k): v for k, v in self.layouts.items()
                if k.startswith(prefix)}

    @property
    def logical(self) -> dict[str, tuple[str | None, ...]]:
        """``{parameter path: logical axes}`` without the ``params.`` prefix."""
        return {k[len("params."):]: v for k, v in self.state.logical.items()
                if k.startswith("params.")}


def build_step(inp: Inputs, setup: Setup) -> AbstractStep:
    """The state, shardings, batch and step of ``workbench._step`` (what the Trainer runs)
    on the target's mesh, with every tensor's layout, the model FLOPs, and memory by
    formula; jitted with the target's compile options where there is a target."""
    cfg, info, rules = inp.cfg, inp.info, inp.rules
    jmesh = setup.mesh if setup.mesh is not None else info.abstract
    st = abstract_train_state(cfg if cfg is not None else inp.factory, inp.optimizer, rules,
                              jmesh, strict=False, abstract=inp.abstract)
    example = dict(inp.example_batch) if inp.example_batch is not None else {
        k: jax.ShapeDtypeStruct((inp.batch, inp.seq), jnp.int32) for k in ("inputs", "targets")}
    batch_abs = abstract_batch(example, rules, jmesh)
    layouts = {**tree_layouts(st.state, info, logical=st.logical).layouts,
               **tree_layouts({"batch": batch_abs}, info, logical={
                   f"batch.{k}": batch_logical_axes(v) for k, v in example.items()}).layouts}
    p_lay = {k[len("params."):]: v for k, v in layouts.items() if k.startswith("params.")}
    o_lay = {k: v for k, v in layouts.items() if k.startswith("opt_state.")}
    b_lay = {k: v for k, v in layouts.items() if k.startswith("batch.")}
    flops = gpt_flops(cfg, inp.batch, inp.seq) if cfg is not None else _model_flops(
        st.graphdef, inp.loss_fn, nnx.to_pure_dict(st.param_state), example, inp.batch, rules,
        jmesh)
    act = analytic.activation_bytes(cfg, inp.batch, inp.seq, rules, info) if cfg else None
    pipe, pipe_info = inp.pipe, None
    if pipe is not None:
        pipe_info = _pipeline_info(pipe, cfg, inp.batch, inp.seq, rules, info)
        act = max(pipe_info.pop("stage_activations"))
    limit = inp.memory_limit if inp.memory_limit is not None else info.memory_per_device
    estimate = analytic.analytic_memory(p_lay, o_lay, b_lay, act, limit)
    batch_sh = {k: v.sharding for k, v in batch_abs.items()}
    jitted = None
    if setup.mesh is not None:
        step = make_train_step(st.graphdef, inp.optimizer, loss_fn=inp.loss_fn, rules=rules,
                               mesh=setup.mesh,
                               pipeline=pipe if setup.target.compile or pipe is None or
                               pipe.schedule in TRAINABLE_SCHEDULES else None)
        jitted = jit_train_step(step, st.shardings, batch_sh, compiler_options=setup.options)
    return AbstractStep(state=st, example=example, batch=batch_abs, batch_shardings=batch_sh,
                        layouts=layouts, flops=flops, activations=act, pipeline=pipe_info,
                        limit=limit, estimate=estimate, jitted=jitted)


def _pipeline_info(pipe: Pipeline, cfg: GPTConfig | None, batch: int, seq: int,
                   rules: Rules, info: Any) -> dict[str, Any]:
    """``plan.pipeline`` before the compiled collectives: bubble by formula and from the
    schedule's timeline, chunks in flight and activations per stage."""
    stages = stages_of(info)
    events = timeline(pipe, stages)
    flight = in_flight(events, stages)
    acts = analytic.pipeline_stage_activations(cfg, batch, seq, rules, info, flight,
                                               pipe.repeats * pipe.microbatches)
    return {**pipe.to_dict(), "stages": stages, "iterations": pipe.iterations(stages),
            "bubble_formula": pipe.bubble_fraction(stages),
            "bubble_schedule": schedule_bubble(events, stages), "in_flight": flight,
            "stage_activations": acts, "stage_memory": list(acts)}


def _model_flops(graphdef: Any, loss_fn: LossFn, params: Any,
                 example: Mapping[str, jax.ShapeDtypeStruct], batch: int, rules: Rules,
                 mesh: Any) -> Any:
    """FLOPs of a model factory's step from its jaxpr; a forward that fails on the example
    batch is an error naming the batch it was given."""
    def loss(p: Any, b: Any) -> Any:
        with jax.sharding.use_abstract_mesh(getattr(mesh, "abstract_mesh", mesh)), \
                rules.activate(mesh):
            return loss_fn(nnx.merge(graphdef, p), b)
    tokens = all(jnp.issubdtype(v.dtype, jnp.integer) and len(v.shape) == 2
                 for v in example.values())   # a language model: count tokens, not rows
    n = batch * int(next(iter(example.values())).shape[1]) if tokens and example else batch
    try:
        return jaxpr_step_flops(loss, params, example, n)
    except Exception as err:  # noqa: BLE001 - any failure of the user's forward
        given = ", ".join(f"{k}: {v.dtype}{list(v.shape)}" for k, v in example.items())
        raise ValueError(
            f"the model's loss failed on the example batch {{{given}}}: "
            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}. Pass "
            "example_batch={name: jax.ShapeDtypeStruct(shape, dtype)} with the inputs the "
            "model takes and loss_fn=(model, batch) -> loss that feeds them (or wrap it with "
            "wb.any_model.from_nnx(..., example_batch=..., loss_fn=...))") from err


# -- 4. measure: workbench.planning._measure.measure ---------------------------------------


# -- 5. lint ---------------------------------------------------------------------------------

def lint(inp: Inputs, setup: Setup, step: AbstractStep, m: Measured,
         replicated_threshold: int) -> list[Lint]:
    """The layout mistakes of the step: over memory (with the loss chunks that would save
    it), unmapped or unannotated axes, uneven and replicated tensors, redundant compute,
    FSDP gathers, the early (context-parallel, MoE) lints, and the compiler's reshards."""
    cfg, rules, info = inp.cfg, inp.rules, inp.info
    p_lay, b_lay = step.layouts_of("params.", strip=True), step.layouts_of("batch.")
    compiled = m.compiled is not None
    return (lints.over_memory(m.memory, "compiled" if compiled else "estimate",
                              chunk_savings=_loss_chunk_savings(cfg, inp.batch, inp.seq,
                                                                rules, info))
            + lints.unmapped(step.state.unmapped) + lints.uneven({**p_lay, **b_lay})
            + lints.redundant_compute(rules, info, p_lay)
            + lints.replicated(p_lay, replicated_threshold)
            + lints.fsdp_gathers(p_lay, rules, info, m.collectives, compiled)
            + setup.early_lints
            + (lints.unannotated(step.state.logical, p_lay) if cfg is None else [])
            + lints.reshards(m.reshards)
            + lints.compile_retry(m.outcome.retried, m.outcome.extra_options))


def _loss_chunk_savings(cfg: GPTConfig | None, batch: int, seq: int, rules: Rules,
                        info: MeshInfo) -> dict[int, int]:
    """``{loss_chunks: estimated temp bytes per device it saves}`` for a GPT whose loss is
    whole (``analytic.temp_breakdown``; divisors of ``seq`` up to 64), for the memory
    lint's fix."""
    if cfg is None or cfg.loss_chunks != 1:
        return {}
    base = int(analytic.temp_breakdown(cfg, batch, seq, rules, info)["temp"])
    return {k: base - int(analytic.temp_breakdown(cfg.replace(loss_chunks=k), batch, seq,
                                                  rules, info)["temp"])
            for k in (2, 4, 8, 16, 32, 64) if seq % k == 0}
