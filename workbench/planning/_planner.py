"""Plan before you allocate: abstract init + AOT-compiled train step -> memory, FLOPs,
collectives and layout lints per device; ``materialize()`` builds the sharded model.

::

    plan = wb.plan(cfg, mesh=mesh, rules="fsdp_tp", batch=8, seq=128)
    plan.memory              # per-device bytes: params, optimizer, temp, total, limit, ...
    plan.model_flops         # analytic, whole step, all devices
    plan.flops_per_device, plan.collectives, plan.warnings, plan.shardings
    model = plan.materialize(seed=0)   # sharded init; no device ever holds the whole model

``plan()`` runs the stages of ``workbench.planning._stages`` in order (resolve the inputs,
choose the compile target, build the abstract step, measure, lint) and assembles the
``PlanReport`` (predicted when it is made) inside the runnable ``Plan``.

On a mesh larger than the machine (``wb.abstract_mesh("v5p-1024", data=-1, model=4)``)
the plan is analytic: memory by formula, FLOPs, and collectives estimated from layouts,
all labelled as estimates.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax

from workbench._display import status_line
from workbench._optimizer import AdamW
from workbench._validate import check_bool, check_int
from workbench.models import GPTConfig
from workbench.perf import _analytic as analytic
from workbench.planning._handle import Plan
from workbench.planning._comparison import Comparison
from workbench.planning._compiled_numbers import CompiledNumbers
from workbench.planning._report import PlanReport, with_prediction
from workbench.planning import _background as background
from workbench.planning._measure import CompileOutcome, Measured, compile_outcome, measure
from workbench.planning._options import DEFAULT_REPLICATED_THRESHOLD, PlanOptions
from workbench.planning._stages import (AbstractStep, Inputs, Setup, build_step,
                                       choose_target, lint, resolve)
from workbench._sharding.rules import Rules
from workbench._step import LossFn
from workbench._train_state import ModelFactory

__all__ = ["compare", "plan"]


def plan(cfg_or_factory: GPTConfig | ModelFactory, *, mesh: Any = None,
         rules: Rules | str | None = None, batch: int, seq: int | None = None,
         optimizer: optax.GradientTransformation | AdamW | None = None,
         dtype: str | None = None,
         name: str | None = None, compile: bool | None = None,
         memory_limit: int | None = None,
         replicated_threshold: int = DEFAULT_REPLICATED_THRESHOLD,
         loss_fn: LossFn | None = None,
         example_batch: Mapping[str, jax.ShapeDtypeStruct] | None = None,
         progress: bool = True, pipeline: Mapping[str, Any] | None = None,
         overlap: bool | Mapping[str, Any] = True, wait: bool = True) -> Plan:
    """Plan one train step of a model on a mesh without allocating it.

    The state, its shardings, the batch shardings and the step are built by the functions
    of :mod:`workbench._step` that the Trainer uses, so the plan compiles the Trainer's
    program: batch entries are sharded by the rules for ``step.batch_logical_axes`` (dim 0
    ``batch``; dim 1 of integer token arrays ``seq``).

    Args:
        cfg_or_factory: a ``GPTConfig`` or a callable ``rngs -> nnx.Module``.
        mesh: ``wb.make_mesh(...)`` (compiled plan) or ``wb.abstract_mesh(...)`` (analytic),
            a dict of axis sizes (``wb.make_mesh``'s), or None: every device on one
            ``data`` axis (``workbench._sharding.placement``, the default everywhere).
        rules: ``Rules`` or a preset name ("dp", "fsdp", "tp", "fsdp_tp"); default
            ``workbench._sharding.placement``'s: "fsdp_tp" on a mesh with one model axis larger
            than 1, else "fsdp". ``plan.report.placement`` says which and why.
        batch: global batch size (sequences per step): a positive int divisible by the
            data-parallel size (the product of the mesh axes the rules map ``batch`` to);
            otherwise a ValueError names the nearest batches that are.
        seq: sequence length, a positive int (default ``cfg.seq_len``). Longer than the
            model's ``seq_len`` is planned with a warning naming both: the model computes
            at any length (RoPE has no position table), so it is a legitimate experiment,
            but one the config does not state; ``cfg.replace(seq_len=seq)`` states it.
        optimizer: the optax transformation, or a ``wb.train.AdamW`` spec, whose state is
            planned (default ``wb.train.AdamW()``: the Trainer's).
        dtype: compute dtype override for a GPTConfig ("bfloat16", "auto", ...); "auto" is
            resolved for the mesh's platform (``plan.dtype`` says which).
        name: label for ``wb.compare`` (default: the rules' preset name).
        compile: force (True) or skip (False) compilation; default: compile when the mesh
            has real devices.
        memory_limit: bytes per device to check against (default: the device's memory).
        replicated_threshold: parameters at least this large (elements) must not be
            replicated (a lint says so).
        loss_fn: ``(model, batch) -> loss`` of a model factory (default next-token
            cross-entropy).
        example_batch: ShapeDtypeStructs of a factory model's batch (dim 0 is "batch").
        progress: say when compilation starts and how long it took.
        pipeline: ``{"microbatches": M, "schedule": ..., "repeats": R}`` of pipeline stages
            over the mesh's ``stage`` axis; adds ``plan.pipeline``.
        overlap: compile with the platform's flags that overlap collectives with compute
            (``workbench.planning._flags.OVERLAP_FLAGS``); False: without; a dict: exactly
            these XLA compile options (``Plan.compiler_options`` shows them).
        wait: True (the default, what scripts get): return when the step is compiled.
            False: return at once with the formula's numbers (``plan.source`` "estimate",
            ``plan.compile_state`` "queued" or "compiling") while a worker process
            compiles the step (``planning._background``; up to one per core at once); the
            same plan, and its widget, turn into the compiler's numbers when they land
            (``plan.changes`` says what changed, ``plan.formula`` keeps the formula's
            report). ``plan.ready``, ``plan.wait()`` (Ctrl-C there cancels), and
            ``plan.cancel()``. A plan with nothing to compile is whole at once.

    Raises:
        TypeError: a flag that is not a bool, a ``loss_fn`` that is not callable, an
            ``example_batch`` that is not names -> shapes (an unknown keyword: Python's
            own TypeError naming it).

    Example::

        plan = wb.plan(cfg, mesh=mesh, rules="fsdp", batch=8, seq=128,
                       optimizer=optax.adamw(3e-4), progress=False)
    """
    t0 = time.perf_counter()
    wait = check_bool(wait, "wait", where="wb.plan: ")
    opts = PlanOptions(optimizer=optimizer, dtype=dtype, name=name, compile=compile,
                       memory_limit=memory_limit, replicated_threshold=replicated_threshold,
                       loss_fn=loss_fn, example_batch=example_batch, progress=progress,
                       pipeline=pipeline, overlap=overlap)
    replicated_threshold = check_int(opts.replicated_threshold, "replicated_threshold",
                                     minimum=0, where="wb.plan: ",
                                     fix="a parameter count, e.g. 2**24")
    inp = resolve(cfg_or_factory, mesh=mesh, rules=rules, batch=batch, seq=seq,
                  optimizer=opts.optimizer, dtype=opts.dtype, name=opts.name,
                  compile=opts.compile, memory_limit=opts.memory_limit, loss_fn=opts.loss,
                  example_batch=opts.example_batch, pipeline=opts.pipeline,
                  overlap=opts.overlap)
    setup = choose_target(inp)
    step = build_step(inp, setup)
    if not wait and setup.target.compile:
        return _in_background(inp, setup, step, opts, replicated_threshold, t0)
    measured = measure(inp, setup, step, progress=opts.progress)
    warnings = lint(inp, setup, step, measured, replicated_threshold)
    return _assemble(inp, setup, step, measured, warnings, seconds=time.perf_counter() - t0)


def _in_background(inp: Inputs, setup: Setup, step: AbstractStep, opts: PlanOptions,
                   replicated_threshold: int, t0: float) -> Plan:
    """The formula's plan now; the step compiled by a worker process (devices of another
    platform at hand: a thread of this one), swapped into the same plan when it lands."""
    target = setup.target
    cpu_or_abstract = _in_worker(inp.info)
    where = "a background worker process" if cpu_or_abstract else "a background thread"
    compiler = target.source.replace("-", " ")
    shown = inp.name or inp.rules_name or inp.preset or "plan"
    formula = _measured(inp, setup, step, replicated_threshold, t0, CompileOutcome(
        target=target.estimate(f"the formulas' numbers while the {compiler} compiles the "
                               f"step in {where} ({target.reason}); plan.wait() for its "
                               "numbers")))
    bg = background.Background(f"wb.plan({shown!r})")
    request = background.Request(model=inp.asked if inp.cfg is not None else inp.factory,
                                 resolve=_resolve_arguments(inp, opts))
    if cpu_or_abstract:
        def run(b: background.Background) -> CompileOutcome:
            return b.in_worker(request, target)
    else:
        def run(b: background.Background) -> CompileOutcome:
            return b.in_thread(lambda: compile_outcome(inp, setup, step, progress=False))
    if opts.progress:
        formula._watch(_progress(bg, f"the formula's numbers now; the {compiler} compiles "
                                     f"the step in {where} (plan.wait() for its numbers)"))
    formula._start(bg, run, lambda out: formula._land(_measured(
        inp, setup, step, replicated_threshold, t0, out)))
    return formula


def _progress(bg: background.Background, text: str) -> Callable[[], None]:
    """A status line saying ``text`` now, replaced once by how the compile ended."""
    update, said = status_line(f"{bg.label}: {text}"), []

    def changed() -> None:
        if bg.state in ("compiled", "failed", "cancelled") and not said:
            said.append(bg.state)
            how = {"compiled": f"the compiler's numbers are in ({bg.seconds:.1f} s)",
                   "failed": "the background compile failed (plan.wait() raises why)",
                   "cancelled": "the background compile was cancelled"}[bg.state]
            update(f"{bg.label}: {how}")
    return changed


def _in_worker(info: Any) -> bool:
    """Whether a worker process can compile for the mesh ``info``: an abstract slice or
    CPU devices (a second process cannot open the GPU or TPU the kernel holds)."""
    return info.jax_mesh is None or info.platform == "cpu"


def _measured(inp: Inputs, setup: Setup, step: AbstractStep, replicated_threshold: int,
              t0: float, outcome: CompileOutcome) -> Plan:
    """The plan of the step measured with ``outcome`` (compiled elsewhere, or none)."""
    m = measure(inp, setup, step, progress=False, outcome=outcome)
    return _assemble(inp, setup, step, m, lint(inp, setup, step, m, replicated_threshold),
                     seconds=time.perf_counter() - t0)


def _resolve_arguments(inp: Inputs, opts: PlanOptions) -> dict[str, Any]:
    """``stages.resolve``'s arguments that rebuild ``inp`` in a worker process: the mesh
    resolved (its devices travel as platform and id), the rest as ``wb.plan`` got them."""
    return {"mesh": inp.info.jax_mesh if inp.info.jax_mesh is not None else inp.info,
            "rules": inp.rules, "batch": inp.batch,
            "seq": inp.seq, "optimizer": inp.optimizer, "dtype": None, "name": inp.name,
            "compile": inp.compile, "memory_limit": inp.memory_limit,
            "loss_fn": inp.loss_fn, "example_batch": inp.example_batch,
            "pipeline": opts.pipeline, "overlap": inp.overlap}


def _assemble(inp: Inputs, setup: Setup, step: AbstractStep, m: Measured, warnings: list,
              *, seconds: float) -> Plan:
    """The report of the stages' records, predicted now (``with_prediction``), in its
    runnable handle."""
    compiled, target, st = m.compiled, m.target, step.state
    report = with_prediction(PlanReport(
        name=inp.name or inp.rules_name or "plan", cfg=inp.asked, mesh=inp.info,
        rules=inp.rules, batch=inp.batch, seq=inp.seq, is_estimate=compiled is None,
        flops=step.flops, source=target.source if compiled is not None else "estimate",
        source_reason=target.reason,
        hbm_bytes_estimate=analytic.hbm_bytes(step.estimate, step.layouts_of(
            "params.", strip=True), inp.rules, inp.info, cfg=inp.cfg, batch=inp.batch,
            seq=inp.seq),
        memory=m.memory, memory_estimate=step.estimate, collectives=m.collectives,
        warnings=warnings, layouts=step.layouts, logical=step.logical,
        compile_seconds=m.outcome.seconds, compile_cached=m.outcome.cached,
        plan_seconds=seconds, pipeline=m.pipeline,
        compiler_options={**setup.options, **m.outcome.extra_options},
        attention=setup.attention, dtype=inp.dtype, placement=inp.placement,
        compiled_numbers=None if compiled is None else CompiledNumbers(
            compiled, tpu=target.source == "tpu-compiler")))
    return Plan(report=report, optimizer=inp.optimizer, graphdef=st.graphdef,
                param_state=st.param_state, abstract_state=st.state,
                shardings=st.shardings, abstract_batch=step.batch,
                batch_shardings=step.batch_shardings, compiled=compiled,
                factory=inp.factory, loss_fn=inp.loss_fn, jitted=step.jitted,
                reshards=m.reshards)


def compare(plans: list[Plan]) -> Comparison:
    """Plans side by side: memory per device, FLOPs per device, bytes communicated per
    step, replicated compute factor, fits. Shows a table and a chart in a notebook."""
    if isinstance(plans, Plan):
        plans = [plans]
    if not isinstance(plans, (list, tuple)):
        raise TypeError(f"wb.compare: plans={plans!r} is a {type(plans).__name__}; give a list of "
                        "plans, e.g. wb.compare([plan_dp, plan_tp])")
    if not plans:
        raise ValueError("wb.compare: plans is empty; compare needs at least one plan, e.g. "
                         "wb.compare([plan_dp, plan_tp])")
    bad = [p for p in plans if not isinstance(p, Plan)]
    if bad:
        raise TypeError(f"wb.compare: plans holds {bad[0]!r} ({type(bad[0]).__name__}), not a "
                        "Plan; give what wb.plan(...) returns")
    return Comparison(list(plans))
