"""Stage 4 of a plan, measure: the step compiled (by XLA for the devices at hand, or the
TPU compiler for an abstract slice) and read for memory and collectives, or, where nothing
compiles, the formulas' estimate with the reason. The compiler's refusals that are facts
about the step (it does not fit; the installed libtpu fails on it) become estimates that
say why; anything the user gave wrong is raised."""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import jax

from workbench._display import status_line
from workbench._notebook import in_notebook
from workbench._sharding.layouts import format_bytes
from workbench.perf._analytic_collectives import analytic_collectives, pipeline_permutes
from workbench.planning._activations import explain_collectives
from workbench.planning._compile import compile_lowered
from workbench.planning._flags import retry_options
from workbench._compiled.hlo import Collective, parse_collectives, parse_reshards

__all__ = ["CompileOutcome", "Measured", "Target", "compile_outcome", "compile_step", "measure",
           "say_once"]


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the plan's step is compiled: ``mesh`` (None: estimate only), whether to
    compile, the ``source`` label, the TPU topology and why."""

    mesh: Any
    compile: bool
    source: str
    topology: str | None
    reason: str

    def estimate(self, reason: str) -> Target:
        """This target turned into the formulas' estimate, saying ``reason``."""
        return dataclasses.replace(self, compile=False, source="estimate", reason=reason)


@dataclasses.dataclass(frozen=True)
class CompileOutcome:
    """What compiling the step gave: the executable and its memory and collectives, or
    (``compiled`` None) the target turned into an estimate, with the compiler's memory
    verdict when it refused the step for memory."""

    target: Target
    compiled: Any = None
    seconds: float = 0.0
    cached: bool = False
    memory: dict[str, Any] | None = None
    collectives: list[Collective] | None = None
    retried: str = ""
    extra_options: dict[str, Any] = dataclasses.field(default_factory=dict)


def _first_line(err: BaseException) -> str:
    return next((ln for ln in str(err).splitlines() if ln.strip()), "")[:300]


def compile_step(jitted: Any, args: tuple[Any, ...], info: Any, target: Target,
                 estimate: Mapping[str, Any], limit: int | None, *, label: str,
                 progress: bool) -> CompileOutcome:
    """Lower and compile the step for ``target``. On an abstract TPU slice, a layout JAX
    cannot lower (indivisible dims) or a step the compiler refuses for memory becomes an
    estimate that says why; a compiler failure that an option avoids
    (``flags.RETRY_FLAGS``) is compiled once more with it, and the outcome says so
    (``retried``); any other error is raised."""
    where = info.describe() + (f" ({target.topology})" if target.topology else "")
    compiler = target.source.replace("-", " ")
    try:
        lowered = jitted.lower(*args)
    except ValueError as err:  # jax's IndivisibleError: a dim its mesh axes don't divide
        if info.jax_mesh is not None or "evenly divide" not in str(err):
            raise
        return CompileOutcome(target=target.estimate(
            f"the {compiler} cannot take this layout (a tensor dimension is not "
            f"divisible by its mesh axes: {str(err).splitlines()[0][:200]}); see the "
            "'uneven' lint for which tensor and the fix"))
    compile_only = info.jax_mesh is None and target.source == "tpu-compiler"
    run = lambda extra: compile_lowered(  # noqa: E731
        lowered, list(target.mesh.devices.flat), what=f"{label}: the train step for {where}"
        + (f" with {extra}" if extra else ""), status=status_line if progress else None,
        in_place=in_notebook(), persist=info.jax_mesh is None,
        options=getattr(jitted, "_workbench_options", None), extra=extra)
    retried, extra, tried = "", {}, ""
    try:
        try:
            result = run(None)
        except jax.errors.JaxRuntimeError as err:
            fix = retry_options(str(err)) if compile_only else None
            if fix is None:
                raise
            extra = fix[1]
            retried = (f"compiled with {', '.join(f'{k}={v}' for k, v in extra.items())} "
                       f"after the {compiler} failed without: {_first_line(err)}")
            tried = f"; retried with {extra}, which failed too"
            result = run(extra)
    except Exception as err:  # noqa: BLE001 - only the compiler's OOM verdict is kept
        oom = _compiler_oom(err)
        if oom is None and info.jax_mesh is None and target.source == "tpu-compiler" \
                and isinstance(err, jax.errors.JaxRuntimeError) \
                and str(err).lstrip().startswith(_COMPILER_FAULTS):
            # a compile-only TPU target: the compiler's own failure (an internal error of
            # the installed libtpu) leaves the formulas, said in the plan; what the user
            # gave wrong (an unknown compile option: INVALID_ARGUMENT) is raised
            return CompileOutcome(target=target.estimate(
                f"the {compiler} failed on this step ({_first_line(err)}{tried}); the "
                "numbers are the formulas' estimates"))
        if oom is None and "No such compile option" in str(err):
            raise ValueError(
                f"wb.plan: overlap={getattr(jitted, '_workbench_options', None)!r:.200}: the "
                f"{compiler} refused it ({_first_line(err)}); give compile options it knows "
                "(workbench.planning._flags.OVERLAP_FLAGS lists the platforms'), or "
                "overlap=True / False") from None
        if oom is None:
            raise
        need, free = oom
        return CompileOutcome(
            target=target.estimate(
                f"the {compiler} rejected this step: it needs {format_bytes(need)} of "
                f"temporaries per device where {format_bytes(free)} are free, so it does "
                "not fit; memory 'temp' is the compiler's, the rest are estimates"
                + (f" ({retried.replace('compiled with', 'retried with', 1)})"
                   if retried else "")),
            memory=dict(estimate, temp=need, activations=need - int(estimate["gradients"]),
                        total=int(estimate["total"]) - int(estimate["temp"]) + need,
                        compiler_required_temp=need, compiler_available=free))
    compiled = result.compiled
    return CompileOutcome(
        target=dataclasses.replace(target, reason=f"{target.reason}; {retried}")
        if retried else target, compiled=compiled, seconds=result.seconds,
        cached=result.cached, memory=_compiled_memory(compiled, estimate, limit),
        collectives=parse_collectives(compiled.as_text(), info.axis_names, info.axis_sizes),
        retried=retried, extra_options=extra)


#: Status codes of the TPU compiler's own failures (not of what it was given).
_COMPILER_FAULTS = ("FAILED_PRECONDITION", "INTERNAL", "UNIMPLEMENTED")

_SAID: set[str] = set()


def say_once(reason: str) -> None:
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


# -- the stage ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class Measured:
    """The step's numbers: compiled (the executable, its memory, its collectives explained
    by the rules, the reshards the compiler inserted) or the formulas' estimate; the
    target as it ended (a refused compile is an estimate that says why)."""

    outcome: CompileOutcome
    memory: dict[str, Any]
    collectives: list[Collective]
    reshards: list[Any]
    pipeline: dict[str, Any] | None

    @property
    def target(self) -> Target:
        return self.outcome.target

    @property
    def compiled(self) -> Any:
        return self.outcome.compiled


def compile_outcome(inp: Any, setup: Any, step: Any, *, progress: bool) -> CompileOutcome:
    """The step compiled for the setup's target (``compile_step``), or the target as it
    is when it does not compile."""
    if not setup.target.compile:
        return CompileOutcome(target=setup.target)
    shown = inp.name or inp.rules_name or (inp.preset if inp.cfg is not None and inp.preset
                                            else "plan")
    return compile_step(step.jitted, (step.state.state, step.batch), inp.info, setup.target,
                        step.estimate, step.limit, label=f"wb.plan({shown!r})",
                        progress=progress)


def measure(inp: Any, setup: Any, step: Any, *, progress: bool,
            outcome: CompileOutcome | None = None) -> Measured:
    """Compile the step for the target and read it, or estimate it by formula (memory,
    collectives from the layouts, pipeline permutes); collectives of a compiled program
    are explained by the rule that made them.

    Args:
        inp, setup, step: the records of the earlier stages (``stages.Inputs``,
            ``stages.Setup``, ``stages.AbstractStep``; this module is below them).
        progress: say when compiling starts and ends, and why a plan is an estimate.
        outcome: the compile's outcome when it was compiled elsewhere (a background
            worker, ``planning._background``), or the target turned into an estimate;
            default: compiled here (``compile_outcome``).
    """
    info, rules, cfg, pipe = inp.info, inp.rules, inp.cfg, inp.pipe
    out = outcome if outcome is not None else compile_outcome(inp, setup, step,
                                                              progress=progress)
    memory, collectives = out.memory, out.collectives
    p_lay = step.layouts_of("params.", strip=True)
    if out.compiled is None:
        if memory is None:
            memory = dict(step.estimate)
            if progress:
                say_once(out.target.reason)
        collectives = analytic_collectives(p_lay, rules, info, cfg, inp.batch, inp.seq)
        if pipe is not None and cfg is not None:
            collectives = collectives + pipeline_permutes(
                cfg, inp.batch, inp.seq, rules, info, step.pipeline["iterations"],
                pipe.microbatches)
    pipe_info = None
    if step.pipeline is not None:
        per_stage = [memory[k] or 0 for k in ("params", "optimizer", "batch", "gradients")]
        pipe_info = {**step.pipeline,
                     "permutes": [c.to_dict() for c in collectives
                                  if c.kind == "collective-permute" and "stage" in c.axes],
                     "stage_memory": [sum(per_stage) + a for a in step.pipeline["stage_memory"]]}
    reshards: list[Any] = []
    if out.compiled is not None:  # which rule made each collective; layout conflicts
        collectives = explain_collectives(collectives, step.logical, step.layouts, rules, info)
        reshards = parse_reshards(out.compiled.as_text(), info.axis_names, info.axis_sizes)
    return Measured(outcome=out, memory=memory, collectives=collectives, reshards=reshards,
                    pipeline=pipe_info)
