"""Plan before you allocate: abstract init + AOT-compiled train step -> memory, FLOPs,
collectives and layout lints per device; ``materialize()`` builds the sharded model.

::

    plan = wb.plan(cfg, mesh=mesh, rules="fsdp_tp", batch=8, seq=128)
    plan.memory              # per-device bytes: params, optimizer, temp, total, limit, ...
    plan.model_flops         # analytic, whole step, all devices
    plan.compiled_flops_per_device, plan.collectives, plan.warnings, plan.shardings
    model = plan.materialize(seed=0)   # sharded init; no device ever holds the whole model

On a mesh larger than the machine (``wb.abstract_mesh("v5p-1024", data=-1, model=4)``)
the plan is analytic: memory by formula, FLOPs, and collectives estimated from layouts,
all labelled as estimates.
"""
from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Mapping
from typing import Any
from warnings import warn

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from workbench._display import status_line
from workbench._notebook import in_notebook
from workbench._validate import check_int, nearest_multiples
from workbench.flops import gpt_flops, jaxpr_step_flops
from workbench.layouts import format_bytes
from workbench.mesh import MeshInfo, mesh_info
from workbench.models.pipeline import (TRAINABLE_SCHEDULES, Pipeline, check_pipeline,
                                       check_rules, stages_of)
from workbench.planning.schedule import in_flight, schedule_bubble, timeline
from workbench.models import GPTConfig
from workbench.models.adapters import ModelSpec, resolve_rules
from workbench.planning import analytic, lints
from workbench.models import attention as attention_impl
from workbench.models.config import remat_policy
from workbench.planning.compile import compile_lowered
from workbench.planning.activations import explain_collectives
from workbench.planning.flags import compile_options
from workbench.planning.hlo import Collective, parse_collectives, parse_reshards
from workbench.planning.lints import Lint
from workbench.planning.report import Comparison, Plan
from workbench.pytrees import tree_layouts
from workbench.rules import Rules
from workbench.topology import tpu_target
from workbench.step import (
    LossFn,
    ModelFactory,
    abstract_batch,
    abstract_param_state,
    abstract_train_state,
    batch_logical_axes,
    jit_train_step,
    lm_loss,
    logical_axes,
    make_train_step,
    model_factory,
    require_auto_axes,
)

__all__ = ["Collective", "Comparison", "Lint", "Plan", "compare", "plan"]

DEFAULT_REPLICATED_THRESHOLD = 16 * 1024 ** 2


def plan(cfg_or_factory: GPTConfig | ModelFactory, *, mesh: Any,
         rules: Rules | str | None = None, batch: int, seq: int | None = None,
         optimizer: optax.GradientTransformation | None = None, dtype: str | None = None,
         name: str | None = None, compile: bool | None = None,
         memory_limit: int | None = None,
         replicated_threshold: int = DEFAULT_REPLICATED_THRESHOLD,
         loss_fn: LossFn = lm_loss,
         example_batch: Mapping[str, jax.ShapeDtypeStruct] | None = None,
         progress: bool = True,
         pipeline: Pipeline | Mapping[str, Any] | None = None,
         overlap: bool | Mapping[str, Any] = True) -> Plan:
    """Plan one train step of a model on a mesh without allocating it.

    The state, its shardings, the batch shardings and the step are built by the functions
    of :mod:`workbench.step` that the Trainer uses, so the plan compiles the Trainer's
    program: batch entries are sharded by the rules for ``step.batch_logical_axes`` (dim 0
    ``batch``; dim 1 of integer token arrays ``seq``).

    Args:
        cfg_or_factory: a ``GPTConfig`` or a callable ``rngs -> nnx.Module``.
        mesh: ``wb.make_mesh(...)`` (compiled plan) or ``wb.abstract_mesh(...)`` (analytic).
        rules: ``Rules`` or a preset name ("dp", "fsdp", "tp", "fsdp_tp"); default "fsdp".
        batch: global batch size (sequences per step): a positive int divisible by the
            data-parallel size (the product of the mesh axes the rules map ``batch`` to);
            otherwise a ValueError names the nearest batches that are.
        seq: sequence length, a positive int (default ``cfg.seq_len``). Longer than the
            model's ``seq_len`` is planned with a warning naming both: the model computes
            at any length (RoPE has no position table), so it is a legitimate experiment,
            but one the config does not state; ``cfg.replace(seq_len=seq)`` states it.
        optimizer: optax transformation (default ``optax.adamw(3e-4)``).
        dtype: compute dtype override for a GPTConfig ("bfloat16", ...).
        name: label for ``compare`` (default: the preset name).
        compile: force (True) or skip (False) compilation; default: compile when the mesh
            has real devices.
        memory_limit: bytes per device to check against (default: the device's memory).
        replicated_threshold: parameters at least this large must not be replicated.
        loss_fn: ``(model, batch) -> loss`` (default next-token cross-entropy).
        example_batch: ShapeDtypeStructs of a factory model's batch (dim 0 is "batch");
            default ``{"inputs", "targets"}`` int32 ``(batch, seq)``.
        progress: say when compilation starts and how long it took (it can take minutes
            for a large model on many devices).
        overlap: compile with the platform's flags that overlap collectives with compute
            (``workbench.planning.flags.OVERLAP_FLAGS``: async collective fusion on TPU,
            the latency-hiding scheduler on GPU); False: without; a dict: exactly these
            XLA compile options. ``Plan.compiler_options`` shows them and
            ``Collective.overlapped`` what the compiled program runs asynchronously.
        pipeline: ``{"microbatches": M, "schedule": "gpipe" | "circular" | "1f1b",
            "repeats": R}``: pipeline stages over the mesh's ``stage`` axis (a GPTConfig with
            ``scan_layers=True``); the plan adds ``plan.pipeline`` (bubble, per-stage
            memory, collective permutes). "1f1b" is planned by formula only (not compiled).
    """
    t0 = time.perf_counter()
    batch = check_int(batch, "batch", where="wb.plan: ",
                      fix="batch is the global number of sequences per step, e.g. batch=8")
    if seq is not None:
        seq = check_int(seq, "seq", where="wb.plan: ",
                        fix="seq is tokens per sequence; leave it out for the model's seq_len")
    given_rules = rules
    info = mesh_info(mesh)
    rules_name = rules if isinstance(rules, str) else None
    rules = Rules.preset(rules or "fsdp", info) if rules is None or isinstance(rules, str) \
        else rules
    rules.check_mesh(info)
    if info.jax_mesh is not None:
        require_auto_axes(info.jax_mesh)
    cfg = cfg_or_factory if isinstance(cfg_or_factory, GPTConfig) else None
    if dtype is not None:
        if cfg is None:
            raise ValueError(f"dtype={dtype!r} applies to a GPTConfig; a model factory sets "
                             "its own dtypes")
        cfg = cfg.replace(dtype=dtype)
    factory = model_factory(cfg if cfg is not None else cfg_or_factory)
    abstract = None
    if cfg is None:  # any NNX module: its annotations name mesh axes or logical axes
        spec = factory if isinstance(factory, ModelSpec) else None
        abstract = abstract_param_state(factory)
        rules = resolve_rules(logical_axes(abstract[1]), given_rules, info, spec=spec)
        rules.check_mesh(info)
        if spec is not None:
            loss_fn = spec.loss_fn if spec.loss_fn is not None and loss_fn is lm_loss \
                else loss_fn
            if example_batch is None and spec.example_batch is not None:
                example_batch = spec.batch(batch, int(seq or 1))
    _check_batch_divides(batch, rules, info, rules_name, given_rules)
    if seq is None:
        seq = cfg.seq_len if cfg else 1
    elif cfg is not None and seq > cfg.seq_len:
        warn(
            f"wb.plan: seq={seq} is longer than the model's seq_len={cfg.seq_len}; the plan is "
            f"for {seq} tokens (RoPE has no length limit, attention costs grow as seq**2). "
            f"Plan cfg.replace(seq_len={seq}) to say so and silence this warning",
            UserWarning, stacklevel=2)
    optimizer = optimizer if optimizer is not None else optax.adamw(3e-4)
    pipe = Pipeline.of(pipeline)
    if pipe is not None and compile is None and pipe.schedule not in TRAINABLE_SCHEDULES:
        compile = False   # planned by formula: the step has no 1F1B program
    target = _compile_target(info, compile)
    platform = "tpu" if target.source == "tpu-compiler" else info.platform
    options = compile_options(platform, overlap)
    attention = _check_kernels(cfg, platform, seq)   # before anything is traced
    if pipe is not None:
        _check_pipeline_plan(pipe, cfg, rules, info, batch, train=target.compile)
    cp_lints = ((lints.context_parallel(cfg, rules, info, seq, batch) if cfg is not None
                 else []) + lints.moe(cfg, rules, info, batch, seq))   # errors: before tracing
    cp_error = next((w for w in cp_lints if w.severity == "error"), None)
    if cp_error is not None and target.compile:   # before anything is traced
        if info.jax_mesh is not None:
            raise ValueError(f"{cp_error.message}; {cp_error.fix}")
        target = dataclasses.replace(target, compile=False, source="estimate",
                                     reason=f"analytic estimate: {cp_error.message}")
    jmesh = target.mesh if target.mesh is not None else info.abstract

    st = abstract_train_state(cfg if cfg is not None else factory, optimizer, rules, jmesh,
                              strict=False, abstract=abstract)
    example = dict(example_batch) if example_batch is not None else {
        k: jax.ShapeDtypeStruct((batch, seq), jnp.int32) for k in ("inputs", "targets")}
    batch_abs = abstract_batch(example, rules, jmesh)
    layouts = {**tree_layouts(st.state, info, logical=st.logical).layouts,
               **tree_layouts({"batch": batch_abs}, info, logical={
                   f"batch.{k}": batch_logical_axes(v) for k, v in example.items()}).layouts}
    p_lay = {k[len("params."):]: v for k, v in layouts.items() if k.startswith("params.")}
    o_lay = {k: v for k, v in layouts.items() if k.startswith("opt_state.")}
    b_lay = {k: v for k, v in layouts.items() if k.startswith("batch.")}
    params = nnx.to_pure_dict(st.param_state)
    flops = gpt_flops(cfg, batch, seq) if cfg is not None else _model_flops(
        st.graphdef, loss_fn, params, example, batch, rules, jmesh)
    act = analytic.activation_bytes(cfg, batch, seq, rules, info) if cfg else None
    pipe_info = _pipeline_info(pipe, cfg, batch, seq, rules, info) if pipe else None
    if pipe_info is not None:
        act = max(pipe_info.pop("stage_activations"))
    limit = memory_limit if memory_limit is not None else info.memory_per_device
    estimate = analytic.analytic_memory(p_lay, o_lay, b_lay, act, limit)

    batch_sh = {k: v.sharding for k, v in batch_abs.items()}
    jitted = None
    if target.mesh is not None:
        step = make_train_step(st.graphdef, optimizer, loss_fn=loss_fn, rules=rules,
                               mesh=target.mesh,
                               pipeline=pipe if target.compile or pipe is None or
                               pipe.schedule in TRAINABLE_SCHEDULES else None)
        jitted = jit_train_step(step, st.shardings, batch_sh, compiler_options=options)
    out = _CompileOutcome(target=target)
    if target.compile:
        shown = name or rules_name or ("fsdp" if cfg is not None else "plan")  # own axes
        out = _compile_step(jitted, (st.state, batch_abs), info, target, estimate, limit,
                            label=f"wb.plan({shown!r})", progress=progress)
    target, compiled, memory = out.target, out.compiled, out.memory
    collectives = out.collectives
    if compiled is None:
        if memory is None:
            memory = dict(estimate)
            if progress:
                _say_once(target.reason)
        collectives = analytic.analytic_collectives(p_lay, rules, info, cfg, batch, seq)
        if pipe is not None and cfg is not None:
            collectives = collectives + analytic.pipeline_permutes(
                cfg, batch, seq, rules, info, pipe_info["iterations"], pipe.microbatches)
    if pipe_info is not None:
        pipe_info["permutes"] = [c.to_dict() for c in collectives
                                 if c.kind == "collective-permute" and "stage" in c.axes]
        per_stage = [memory[k] or 0 for k in ("params", "optimizer", "batch", "gradients")]
        pipe_info["stage_memory"] = [sum(per_stage) + a for a in pipe_info["stage_memory"]]
    reshards = []
    if compiled is not None:  # which rule made each collective; layout conflicts
        collectives = explain_collectives(
            collectives, {k[len("params."):]: v for k, v in st.logical.items()
                          if k.startswith("params.")}, layouts, rules, info)
        reshards = parse_reshards(compiled.as_text(), info.axis_names, info.axis_sizes)

    warnings = (lints.over_memory(memory, "compiled" if compiled else "estimate",
                                  chunk_savings=_loss_chunk_savings(cfg, batch, seq, rules,
                                                                    info))
                + lints.unmapped(st.unmapped) + lints.uneven({**p_lay, **b_lay})
                + lints.redundant_compute(rules, info, p_lay)
                + lints.replicated(p_lay, replicated_threshold)
                + lints.fsdp_gathers(p_lay, rules, info, collectives, compiled is not None)
                + cp_lints
                + (lints.unannotated(st.logical, p_lay) if cfg is None else [])
                + lints.reshards(reshards))
    return Plan(
        name=name or rules_name or "plan", cfg=cfg, mesh=info, rules=rules, batch=batch,
        seq=seq, optimizer=optimizer, is_estimate=compiled is None, flops=flops,
        source=target.source if compiled is not None else "estimate",
        source_reason=target.reason,
        hbm_bytes_estimate=analytic.hbm_bytes(estimate, p_lay, rules, info, cfg=cfg,
                                              batch=batch, seq=seq),
        memory=memory, memory_estimate=estimate, collectives=collectives, warnings=warnings,
        layouts=layouts, logical={k[len("params."):]: v for k, v in st.logical.items()
                                  if k.startswith("params.")},
        graphdef=st.graphdef, param_state=st.param_state, abstract_state=st.state,
        shardings=st.shardings, abstract_batch=batch_abs, batch_shardings=batch_sh,
        compiled=compiled, compile_seconds=out.seconds, compile_cached=out.cached,
        plan_seconds=time.perf_counter() - t0, factory=factory, loss_fn=loss_fn,
        jitted=jitted, pipeline=pipe_info, compiler_options=options, attention=attention)


def _check_kernels(cfg: GPTConfig | None, platform: str, seq: int) -> str:
    """The attention kernel and remat policy checked for ``platform`` before tracing
    (splash off TPU/CPU, blocks that don't divide ``seq``, host offload without host
    memory raise); returns which attention runs and why."""
    if cfg is None:
        return ""
    remat_policy(cfg.remat, platform)
    r = attention_impl.check(cfg.attention, platform, seq=seq, head_dim=cfg.head_dim,
                             n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                             block_sizes=cfg.attention_block_sizes)
    return f"{r.impl}: {r.reason}"


def _check_pipeline_plan(pipe: Pipeline, cfg: GPTConfig | None, rules: Rules, info: Any,
                         batch: int, *, train: bool) -> None:
    """The pipeline's errors, before anything is traced or compiled."""
    if cfg is None or not cfg.scan_layers:
        raise ValueError(
            f"pipeline={pipe.to_dict()} splits stacked layers into stages: plan a GPTConfig "
            f"with scan_layers=True (cfg.replace(scan_layers=True))")
    check_rules(pipe, rules, info)
    shards = analytic.axes_size(info, [a for a in analytic.rule_axes(rules, "batch")
                                       if a in info.shape])
    check_pipeline(pipe, n_layers=cfg.n_layers, stages=stages_of(info), batch=batch,
                   batch_shards=shards, train=train)


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
            "wb.models.from_nnx(..., example_batch=..., loss_fn=...))") from err


def _check_batch_divides(batch: int, rules: Rules, info: Any, rules_name: str | None,
                         given: Any) -> None:
    """Refuses a batch its data-parallel devices do not divide, naming the nearest ones
    that work (JAX cannot lay out the batch otherwise, and the Trainer refuses it too)."""
    axes = rules.mesh_axes("batch") if "batch" in rules else ()
    shards = math.prod(info.shape[a] for a in axes)
    if batch % shards == 0:
        return
    near = " or ".join(f"batch={b}" for b in nearest_multiples(batch, shards))
    how = f"rules {rules_name!r}" if rules_name else \
        "the rules" if given is not None else "the default rules 'fsdp'"
    raise ValueError(
        f"wb.plan: batch={batch} is not divisible by the data-parallel size {shards}: "
        f"{how} split the batch over mesh axes {axes} of mesh "
        f"{' x '.join(f'{n}={s}' for n, s in info.shape.items())}; use {near} (a multiple "
        f"of {shards}), or rules/mesh axes whose sizes divide {batch}")


@dataclasses.dataclass(frozen=True)
class _Target:
    """Where the plan's step is compiled: ``mesh`` (None: estimate only), whether to
    compile, the ``source`` label, the TPU topology and why."""

    mesh: Any
    compile: bool
    source: str
    topology: str | None
    reason: str


def _compile_target(info: Any, compile: bool | None) -> _Target:
    """Real devices compile on themselves; an abstract TPU preset compiles for its
    topology with the TPU compiler when it is installed; anything else is estimated."""
    if compile is not None and not isinstance(compile, bool):
        raise TypeError(f"compile must be True, False or None, got {compile!r}")
    if info.jax_mesh is not None:
        platform = info.platform
        return _Target(mesh=info.jax_mesh, compile=compile is not False,
                       source=f"{platform}-compiler", topology=None,
                       reason=f"compiled by XLA for the {platform.upper()} devices at hand")
    if compile is False:
        return _Target(mesh=None, compile=False, source="estimate", topology=None,
                       reason="compile=False: analytic estimate")
    tgt = tpu_target(info)
    if tgt.mesh is None:
        if compile:
            raise ValueError(f"compile=True cannot compile for {info.describe()}: "
                             f"{tgt.reason}")
        return _Target(mesh=None, compile=False, source="estimate", topology=tgt.topology,
                       reason=f"analytic estimate: {tgt.reason}")
    return _Target(mesh=tgt.mesh, compile=True, source="tpu-compiler", topology=tgt.topology,
                   reason=tgt.reason)


@dataclasses.dataclass(frozen=True)
class _CompileOutcome:
    """What compiling the step gave: the executable and its memory and collectives, or
    (``compiled`` None) the target turned into an estimate, with the compiler's memory
    verdict when it refused the step for memory."""

    target: _Target
    compiled: Any = None
    seconds: float = 0.0
    cached: bool = False
    memory: dict[str, Any] | None = None
    collectives: list[Collective] | None = None


def _compile_step(jitted: Any, args: tuple[Any, ...], info: Any, target: _Target,
                  estimate: Mapping[str, Any], limit: int | None, *, label: str,
                  progress: bool) -> _CompileOutcome:
    """Lower and compile the step for ``target``. On an abstract TPU slice, a layout JAX
    cannot lower (indivisible dims) or a step the compiler refuses for memory becomes an
    estimate that says why; any other error is raised."""
    where = info.describe() + (f" ({target.topology})" if target.topology else "")
    compiler = target.source.replace("-", " ")
    try:
        lowered = jitted.lower(*args)
    except ValueError as err:  # jax's IndivisibleError: a dim its mesh axes don't divide
        if info.jax_mesh is not None or "evenly divide" not in str(err):
            raise
        return _CompileOutcome(target=dataclasses.replace(
            target, compile=False, source="estimate", reason=(
                f"the {compiler} cannot take this layout (a tensor dimension is not "
                f"divisible by its mesh axes: {str(err).splitlines()[0][:200]}); see the "
                "'uneven' lint for which tensor and the fix")))
    try:
        result = compile_lowered(lowered, list(target.mesh.devices.flat),
                                 what=f"{label}: the train step for {where}",
                                 status=status_line if progress else None,
                                 in_place=in_notebook(), persist=info.jax_mesh is None,
                                 options=getattr(jitted, "_workbench_options", None))
    except Exception as err:  # noqa: BLE001 - only the compiler's OOM verdict is kept
        oom = _compiler_oom(err)
        if oom is None and info.jax_mesh is None and target.source == "tpu-compiler" \
                and isinstance(err, jax.errors.JaxRuntimeError) \
                and str(err).lstrip().startswith(_COMPILER_FAULTS):
            # a compile-only TPU target: the compiler's own failure (an internal error of
            # the installed libtpu) leaves the formulas, said in the plan; what the user
            # gave wrong (an unknown compile option: INVALID_ARGUMENT) is raised
            first = next((ln for ln in str(err).splitlines() if ln.strip()), "")[:300]
            return _CompileOutcome(target=dataclasses.replace(
                target, compile=False, source="estimate", reason=(
                    f"the {compiler} failed on this step ({first}); the numbers are the "
                    "formulas' estimates")))
        if oom is None:
            raise
        need, free = oom
        return _CompileOutcome(
            target=dataclasses.replace(target, compile=False, source="estimate", reason=(
                f"the {compiler} rejected this step: it needs {format_bytes(need)} of "
                f"temporaries per device where {format_bytes(free)} are free, so it does "
                "not fit; memory 'temp' is the compiler's, the rest are estimates")),
            memory=dict(estimate, temp=need, activations=need - int(estimate["gradients"]),
                        total=int(estimate["total"]) - int(estimate["temp"]) + need,
                        compiler_required_temp=need, compiler_available=free))
    compiled = result.compiled
    return _CompileOutcome(
        target=target, compiled=compiled, seconds=result.seconds, cached=result.cached,
        memory=_compiled_memory(compiled, estimate, limit),
        collectives=parse_collectives(compiled.as_text(), info.axis_names, info.axis_sizes))


#: Status codes of the TPU compiler's own failures (not of what it was given).
_COMPILER_FAULTS = ("FAILED_PRECONDITION", "INTERNAL", "UNIMPLEMENTED")

_SAID: set[str] = set()


def _say_once(reason: str) -> None:
    """Why a plan is an estimate, said once per process and reason (the TPU compiler
    missing, a topology it does not know)."""
    if "compile=False" in reason or "not a TPU slice" in reason or reason in _SAID:
        return
    _SAID.add(reason)
    status_line(f"wb.plan: {reason}")


_OOM = re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT]?)\) exceeds available HBM "
                  r"\(([\d.]+)([KMGT]?)\)")


def _compiler_oom(err: Exception) -> tuple[int, int] | None:
    """(bytes of temporaries needed, bytes available) from the TPU compiler's
    RESOURCE_EXHAUSTED error, or None for any other error."""
    m = _OOM.search(str(err))
    if m is None:
        return None
    scale = {"": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3, "T": 1024 ** 4}
    return (int(float(m.group(1)) * scale[m.group(2)]),
            int(float(m.group(3)) * scale[m.group(4)]))


def _compiled_memory(compiled: Any, estimate: Mapping[str, Any],
                     limit: int | None) -> dict[str, int | None]:
    """Per-device bytes from ``memory_analysis()``; params/optimizer/batch are the exact
    argument shards, XLA's temp is split into gradients (their shards) and the rest."""
    ma = compiled.memory_analysis()
    if ma is None:
        return dict(estimate)
    temp = int(ma.temp_size_in_bytes)
    grads = min(int(estimate["gradients"]), temp)
    total = int(ma.argument_size_in_bytes + ma.output_size_in_bytes
                - ma.alias_size_in_bytes + temp)
    return {"params": estimate["params"], "optimizer": estimate["optimizer"],
            "batch": estimate["batch"], "gradients": grads, "temp": temp,
            "activations": temp - grads, "total": total, "limit": limit,
            "arguments": int(ma.argument_size_in_bytes),
            "outputs": int(ma.output_size_in_bytes), "aliased": int(ma.alias_size_in_bytes)}


def compare(plans: list[Plan]) -> Comparison:
    """Plans side by side: memory per device, FLOPs per device, bytes communicated per
    step, replicated compute factor, fits. Shows a table and a chart in a notebook."""
    if not plans:
        raise ValueError("compare needs at least one plan, e.g. wb.compare([plan_dp, plan_tp])")
    return Comparison(list(plans))


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
