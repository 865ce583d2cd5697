"""``Plan``, what ``wb.plan`` returns: the runnable handle (the abstract state and its
shardings, the jitted and compiled step, ``materialize``, ``train_step``) around the
serialisable ``PlanReport`` (memory, FLOPs, collectives, lints, prediction). The plan
shows the report's numbers that the README and notebooks read as its own, each an
explicit property (``plan.memory`` is ``plan.report.memory``); the rest are the report's
alone (``plan.report.loops``). ``Plan.predict`` predicts again (``perf.predict_plan``)."""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import optax

from workbench._display import Displayable
from workbench._sharding.layouts import format_bytes
from workbench.hardware import EffectiveSpec, effective_spec
from workbench.perf._prediction import Prediction
from workbench.perf._predict_plan import predict_plan
from workbench.planning._background import Live
from workbench.planning._compile import StoredExecutable
from workbench.planning._report import PlanReport
from workbench._step import LossFn, sharded_init
from workbench._train_state import ModelFactory, TrainState

__all__ = ["Plan"]

#: Every attribute name of the report: one the plan does not show is ``plan.report.<name>``.
_REPORT_NAMES = frozenset(
    {f.name for f in dataclasses.fields(PlanReport)}
    | {n for n in dir(PlanReport) if not n.startswith("__")})


def _shown(name: str) -> property:
    """A read-only property of the plan that is ``plan.report.<name>`` (documented as the
    report's own attribute is)."""
    attr = getattr(PlanReport, name, None)
    doc = attr.__doc__ if isinstance(attr, property) else None
    summary = (doc or "").strip().split("\n\n")[0]
    return property(lambda self: getattr(self.report, name),
                    doc=f"``plan.report.{name}``" + (f": {summary}" if summary else ""))


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False, eq=False)
class Plan(Live, Displayable):
    """One train step of a model on a mesh, planned before any parameter is allocated
    (``wb.plan``): its ``report`` and what runs it.

    The report's numbers that the README, the notebooks and the docs read are the plan's
    own, each an explicit property (``plan.memory``, ``plan.model_flops``,
    ``plan.collectives``, ``plan.warnings``, ``plan.source``, ``plan.fits``,
    ``plan.layouts``, ``plan.predicted``, ...) or method (``predict``, ``summary``,
    ``memory_rows``); the
    rest of ``PlanReport`` (``batch``, ``seq``, ``memory_estimate``, ``cost``, ``loops``,
    ``compiled_numbers``, ``to_dict``, ``to_json``, ...) is ``plan.report.<name>``.
    ``repr`` is a one-line summary, ``str`` the full report; a notebook shows the plan
    widget.

    Attributes:
        report: the ``PlanReport`` (serialisable: ``plan.report.to_json()``).
        optimizer: the optax transformation whose state is planned.
        graphdef: the model's ``nnx.GraphDef``.
        param_state: ``nnx.State`` of abstract ``nnx.Param`` (logical axes in metadata).
        abstract_state: ``TrainState`` of ShapeDtypeStruct carrying the shardings.
        shardings: ``TrainState`` of ``NamedSharding`` matching the model state.
        abstract_batch: ``{name: ShapeDtypeStruct}`` of the batch, carrying its shardings.
        batch_shardings: ``{name: NamedSharding}`` of the batch (``step.batch_shardings``).
        compiled: the ``jax.stages.Compiled`` step (None when analytic).
        factory: ``rngs -> nnx.Module`` that builds the model (for ``materialize``).
        loss_fn: ``(model, batch) -> loss`` of the step.
        jitted: the jitted step ``(state, batch) -> (state, metrics)`` before AOT
            compilation (None on an abstract mesh).
        reshards: layout changes the compiler inserted between two ops (``hlo.Reshard``:
            the collective, the producing and consuming ops and their source lines);
            empty when nothing was compiled.
    """

    report: PlanReport
    optimizer: optax.GradientTransformation
    graphdef: Any
    param_state: Any
    abstract_state: TrainState
    shardings: TrainState
    abstract_batch: dict[str, jax.ShapeDtypeStruct]
    batch_shardings: dict[str, jax.sharding.NamedSharding]
    compiled: Any | None
    factory: ModelFactory
    loss_fn: LossFn
    jitted: Callable[..., Any] | None
    reshards: list[Any] = dataclasses.field(default_factory=list)

    def __getattr__(self, name: str) -> Any:
        # only called for names the plan lacks: says where a report attribute is, never
        # forwards to it
        if not name.startswith("_") and name in _REPORT_NAMES:
            raise AttributeError(f"'Plan' object has no attribute {name!r}: it is the "
                                 f"report's, plan.report.{name}")
        raise AttributeError(f"'Plan' object has no attribute {name!r}")

    # the report's numbers the README, the notebooks and docs/*.md read off a plan (and
    # DESIGN.md's model_flops, warnings); PlanReport documents each
    name = _shown("name")
    cfg = _shown("cfg")
    mesh = _shown("mesh")
    rules = _shown("rules")
    dtype = _shown("dtype")
    attention = _shown("attention")
    source = _shown("source")
    source_reason = _shown("source_reason")
    compiler_options = _shown("compiler_options")
    memory = _shown("memory")
    fits = _shown("fits")
    layouts = _shown("layouts")
    pipeline = _shown("pipeline")
    model_flops = _shown("model_flops")
    flops_per_device = _shown("flops_per_device")
    kernel_flops = _shown("kernel_flops")
    collectives = _shown("collectives")
    warnings = _shown("warnings")
    predicted = _shown("predicted")

    def predict(self, *, hardware: Any = None, overlap: float | None = None,
                calibration: Any = None) -> Prediction:
        """A prediction of this plan's step made now: ``perf.predict_plan(plan.report,
        spec)`` with the spec resolved here (``wb.hardware.effective_spec(plan.mesh,
        hardware=, calibration=)``). ``plan.predicted`` is the one made with the defaults
        when the plan was made.

        Args:
          hardware: a ``HardwareSpec`` or device kind ("TPU v5p", "H100") to predict for
            another chip with the same program; default the mesh's device kind (measured
            for CPU devices); or an ``EffectiveSpec`` resolved by the caller, used as it is.
          overlap: fraction of communication hidden behind compute (default by platform,
            or the calibration's measured one).
          calibration: None: the calibration stored for the device kind (``wb.calibrate``)
            now, if any; False: the hardware table alone; or a ``Calibration``.

        Raises:
          ValueError: ``calibration`` given with an ``EffectiveSpec`` (it has its own), or
            no hardware entry for the device kind.
        """
        if isinstance(hardware, EffectiveSpec):
            if calibration is not None:
                raise ValueError("plan.predict: hardware is an EffectiveSpec, which has its "
                                 "calibration already; pass calibration= to effective_spec")
            spec = hardware
        else:
            spec = effective_spec(self.report.mesh, hardware=hardware, calibration=calibration)
        return predict_plan(self.report, spec, overlap=overlap)

    def summary(self) -> str:
        """``PlanReport.summary``: a few lines."""
        return self.report.summary()

    def memory_rows(self) -> list[dict[str, Any]]:
        """``PlanReport.memory_rows``: one row per memory component."""
        return self.report.memory_rows()

    # -- a background compile (wb.plan(wait=False); ``planning._background.Live``) ----------

    def wait(self, timeout: float | None = None) -> Plan:
        """Wait for the background compile (``wb.plan(wait=False)``); returns this plan,
        its numbers now the compiler's. Ctrl-C (a kernel interrupt) cancels the compile.

        Args:
            timeout: seconds to wait at most (None: until it is in); past it a
                ``TimeoutError`` says so and the compile goes on.

        Raises:
            RuntimeError: the worker died (killed, out of memory) or the compile failed
                or was cancelled; the plan keeps the formula's numbers.
            TimeoutError: ``timeout`` passed first.
        """
        self._wait(timeout, "plan.wait")
        return self

    @property
    def formula(self) -> PlanReport | None:
        """The formula's report a background plan was returned with (None for a plan made
        whole at once); ``report`` is the compiler's once it is in."""
        return self.__dict__.get("_formula")

    @property
    def changes(self) -> list[dict[str, Any]]:
        """What the compiler's numbers changed against the formula's (a background plan
        whose compile is in): ``{"what", "formula", "compiled", "text"}`` for the total
        memory per device, the fit and the predicted step; empty otherwise."""
        formula = self.formula
        if formula is None or self.report is formula:
            return []
        return _changes(formula, self.report)

    def _start(self, bg: Any, run: Callable[[Any], Any], land: Callable[[Any], None]) -> None:
        """Run ``bg`` (``planning._background.Background``) for this plan."""
        object.__setattr__(self, "_formula", self.report)
        super()._start(bg, run, land)

    def _land(self, other: Plan) -> None:
        """Take ``other``'s numbers and step (the same plan, compiled): this plan, and its
        widget, become the compiler's."""
        # both plans hold the same step's objects (graphdef, shardings, loss), so what was
        # traced from them already (activations, the jitted init) still holds
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, getattr(other, f.name))

    def __str__(self) -> str:
        return str(self.report)

    def __repr__(self) -> str:
        return repr(self.report)

    @functools.cached_property
    def activations(self) -> list[Any]:
        """The step's activations (``planning.activations.Activation``): every tensor the
        model constrains (per layer: q/k/v, attention output, residual, MLP hidden; the
        logits), and the attention scores found in the traced program, with shape,
        sharding and bytes per device. Traced on first use."""
        from workbench.planning._activations import trace_activations

        sh = next(iter(self.batch_shardings.values()), None)
        mesh = sh.mesh if sh is not None else self.report.mesh.abstract
        cfg = self.report.cfg
        scanned = cfg.n_layers if cfg is not None and cfg.scan_layers else None
        return trace_activations(self.graphdef, self.loss_fn, self.abstract_state.params,
                                 self.abstract_batch, self.report.rules, mesh,
                                 scanned_layers=scanned)

    # -- the model and the step -----------------------------------------------------------

    def init_state(self, seed: int = 0) -> TrainState:
        """Params and optimizer state created directly into the plan's shardings."""
        self._require_devices("init_state")
        return self._init(jax.random.key(seed))

    @functools.cached_property
    def _init(self) -> Callable[..., TrainState]:
        """The jitted init, compiled once per plan (not once per ``init_state`` call)."""
        return sharded_init(self.factory, self.optimizer, self.shardings)

    def materialize(self, seed: int = 0) -> Any:
        """The sharded ``nnx.Module``: parameters are created by a function jitted with the
        plan's output shardings, so no device ever holds the full parameters."""
        from flax import nnx

        self._require_devices("materialize")
        params = sharded_init(self.factory, None, self.shardings.params)(jax.random.key(seed))
        return nnx.merge(self.graphdef, params)

    def train_step(self) -> Callable[..., Any]:
        """The step this plan compiled, ``(state, batch) -> (state, metrics)``: the AOT
        executable (donates ``state``), or the jitted function when nothing was compiled
        here (a background plan's worker compiled it: it compiles on its first call)."""
        self._require_devices("train_step")
        runnable = self.compiled is not None and not isinstance(self.compiled, StoredExecutable)
        return self.compiled if runnable else self.jitted

    def _require_devices(self, what: str) -> None:
        if self.report.mesh.jax_mesh is None:
            raise RuntimeError(
                f"plan.{what}() needs real devices, but this plan is on "
                f"{self.report.mesh.describe()}; plan on wb.make_mesh(...) to build the model")


def _changes(formula: PlanReport, compiled: PlanReport) -> list[dict[str, Any]]:
    """Memory per device, fit and predicted step: the formula's and the compiler's."""
    def step(r: PlanReport) -> float | None:
        return None if r.predicted is None else r.predicted.step_seconds

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.4g} ms"

    def fits(x: bool | None) -> str:
        return {True: "fits", False: "does not fit", None: "fit unknown"}[x]

    rows = [("memory", formula.memory.get("total"), compiled.memory.get("total"),
             lambda v: "-" if v is None else format_bytes(v)),
            ("fits", formula.fits, compiled.fits, fits),
            ("step", step(formula), step(compiled), ms)]
    out = []
    for what, a, b, text in rows:
        rel = (f" ({b / a - 1:+.0%})" if isinstance(a, (int, float)) and not isinstance(a, bool)
               and a and b is not None else "")
        out.append({"what": what, "formula": a, "compiled": b,
                    "text": f"{what}: {text(a)} -> {text(b)}{rel}" if a != b
                    else f"{what}: {text(b)} (unchanged)"})
    return out
