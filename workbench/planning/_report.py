"""The plan's report: ``PlanReport``, the serialisable record of one planned step (memory,
FLOPs, collectives, lints, the numbers read from the compiled program, the prediction made
when the plan was made: ``with_prediction``) with its text and dict forms. The runnable
handle (``handle.Plan``) holds a report; ``comparison.Comparison`` sets reports side by
side. No display imports here: notebooks draw them through the display hook
(``workbench._display``).

One report, one file: its fields, the numbers derived from them (FLOPs per device, the
replicated compute factor, the fit) and its text (``summary``, ``str``, ``to_dict``) read
the same fields and change together when a field is added; what it is made from (the
compiled program's numbers, ``compiled_numbers``; its JSON, ``serialise``) and what reads
many of them (``comparison``) are beside it."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from workbench._flops import FlopCount
from workbench.hardware import EffectiveSpec, effective_spec
from workbench._sharding.layouts import Layout, format_bytes
from workbench._sharding.mesh import MeshInfo
from workbench.models import GPTConfig
from workbench.models._remat import remat_label, resolve_remat
from workbench.perf._analytic import compute_split, moe_padding_flops
from workbench.perf._attention_cost import kernel_flops
from workbench._compiled.hlo import Collective
from workbench.perf._host import HostTraffic
from workbench.planning._compiled_numbers import CompiledNumbers
from workbench.planning._lints import Lint
from workbench.perf._prediction import Prediction
from workbench.perf._predict_plan import predict_plan
from workbench.planning._serialise import report_fields, report_to_json
from workbench._sharding.rules import Rules

MEMORY_KEYS = ("params", "optimizer", "gradients", "activations", "batch")


def flops_text(x: float | None) -> str:
    """``"1.23 TFLOP"``; ``"-"`` for None."""
    if x is None:
        return "-"
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g} FLOP"


def bytes_text(x: float | None) -> str:
    """``format_bytes(x)``; ``"-"`` for None."""
    return "-" if x is None else format_bytes(x)


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False, eq=False)
class PlanReport:
    """What one train step needs on a mesh, as numbers: the serialisable part of a plan
    (``wb.plan(...).report``; the plan shows the ones the notebooks read as its own).
    Numbers and their text only: no attribute reads a file or changes another.

    ``repr`` is a one-line summary, ``str`` the full report (the plan widget draws the
    ``Plan``, which has the layouts' model too). ``to_json()`` / ``PlanReport.from_json()``
    round-trip it.

    Attributes:
        name: label used by ``compare``.
        cfg: the GPTConfig as given (None for a model factory); its ``dtype="auto"``
            stays so, and ``dtype`` says what the step computes in.
        mesh: the ``MeshInfo``.
        rules: the ``Rules`` used.
        batch, seq: global batch size and sequence length.
        is_estimate: True when nothing was compiled: all numbers by formula.
        source: where memory, FLOPs and collectives come from: ``"tpu-compiler"`` (the TPU
            compiler, for TPU devices or an abstract TPU slice), ``"cpu-compiler"`` /
            ``"gpu-compiler"`` (XLA for the devices at hand) or ``"estimate"`` (formulas).
        source_reason: why that source (the topology compiled for, or why not compiled).
        hbm_bytes_estimate: HBM bytes read + written per device per step, by formula
            (``analytic.hbm_bytes``); the roofline uses the compiler's count when there is one.
        flops: the analytic ``FlopCount`` (formula, breakdown, 6N, remat recompute).
        memory: per-device bytes ``params, optimizer, batch, gradients, temp, activations,
            total, limit`` (compiled when available, plus XLA's ``arguments, outputs,
            aliased``; else ``memory_estimate``).
        memory_estimate: the same keys by formula.
        collectives: ``Collective`` records (compiled HLO, or estimates).
        warnings: ``Lint`` records.
        layouts: ``{path: Layout}`` of every parameter (``params.*``), optimizer leaf
            (``opt_state.*``), the step counter (``step``) and batch input (``batch.*``),
            each with its logical axes.
        logical: ``{parameter path: logical axes}`` (``'blocks.0.attn.q'``, no prefix).
        compile_seconds: compilation time (0 when analytic or cached).
        compile_cached: the executable came from the compile cache (this process's, or the
            plan cache on disk for abstract TPU slices).
        plan_seconds: time ``wb.plan`` took in all.
        pipeline: None, or the pipeline over the ``stage`` axis (``wb.plan(pipeline=)``):
            ``stages, microbatches, schedule, repeats, iterations``, ``bubble_formula``
            (``(S-1)/(R M+S-1)``), ``bubble_schedule`` (idle fraction of the schedule's
            timeline), ``in_flight`` (chunks held per stage), ``stage_memory`` (per-stage
            bytes by formula: params, optimizer, batch, gradients and the stage's
            activations), ``permutes`` (the collective permutes, compiled or estimated).
        compiler_options: the XLA compile options of the step (``wb.plan(overlap=)``: the
            platform's overlap flags by default).
        attention: the attention that runs and why (``"splash: Pallas splash kernel
            (Mosaic)"``); empty for a model factory.
        dtype: the compute dtype and why (``"bfloat16: auto: bfloat16 on tpu"``: a
            GPTConfig's ``dtype="auto"`` resolved for the platform planned for; ``cfg``
            stays the config as given); empty for a model factory.
        compiled_numbers: what was read from the compiled program (``CompiledNumbers``);
            None when nothing was compiled.
        placement: where the mesh and rules came from (``workbench._sharding.placement``): given,
            or the default and why; "" in a report written before it was recorded.
        predicted: the predicted step (``Prediction``: time, MFU, tokens/s, bound,
            breakdown), made once when the plan was made (:func:`with_prediction`:
            ``perf.predict_plan(report, effective_spec(mesh))``, the mesh's hardware entry
            and the calibration stored at that moment) and kept as data: reading it reads
            no file. None when there is none (``prediction_error`` says why). Another
            chip, overlap or calibration: ``perf.predict_plan(report, spec)``.
        prediction_error: why there is no prediction ("" when there is one).
    """

    name: str
    cfg: GPTConfig | None
    mesh: MeshInfo
    rules: Rules
    batch: int
    seq: int
    is_estimate: bool
    source: str
    source_reason: str
    hbm_bytes_estimate: int
    flops: FlopCount
    memory: dict[str, int | None]
    memory_estimate: dict[str, int | None]
    collectives: list[Collective]
    warnings: list[Lint]
    layouts: dict[str, Layout]
    logical: dict[str, tuple[str | None, ...]]
    compile_seconds: float
    compile_cached: bool
    plan_seconds: float
    pipeline: dict[str, Any] | None = None
    compiler_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    attention: str = ""
    dtype: str = ""
    compiled_numbers: CompiledNumbers | None = None
    placement: str = ""
    predicted: Prediction | None = None
    prediction_error: str = ""

    # -- numbers -----------------------------------------------------------------------

    @property
    def model_flops(self) -> float:
        """Analytic model FLOPs of one step, all devices (no remat; MaxText convention)."""
        return self.flops.total

    @property
    def loops(self) -> dict[str, int]:
        """``{loop body: trip count}`` of the compiled program's while loops (scanned
        layers); empty when analytic or unrolled."""
        return {} if self.compiled_numbers is None else self.compiled_numbers.loops

    @property
    def host_traffic(self) -> HostTraffic:
        """What one step moves between device and host memory (``HostTraffic``: bytes
        each way, the transfers, their schedule), read from the TPU-compiled HLO; empty
        when nothing is offloaded or the plan was not TPU-compiled."""
        if self.compiled_numbers is None or self.source != "tpu-compiler":
            return HostTraffic()
        return self.compiled_numbers.host

    @property
    def compiler_cycles(self) -> tuple[int, int]:
        """``(cycles, instructions)``: the TPU compiler's own cycle estimates of every
        fusion, copy and matmul it scheduled, summed over one step with loop trip counts
        (``hlo.compiler_cycles``); (0, 0) unless TPU-compiled."""
        if self.compiled_numbers is None or self.source != "tpu-compiler":
            return 0, 0
        return self.compiled_numbers.cycles

    @property
    def compiled_flops_per_device(self) -> float | None:
        """FLOPs per device from ``compiled.cost_analysis()``; None when analytic, or when
        the program loops (scanned layers): XLA's cost analysis counts a loop body once."""
        if self.compiled_numbers is None or self.loops:
            return None
        flops = self.compiled_numbers.cost.get("flops")
        return None if flops is None or flops <= 0 else float(flops)

    @property
    def cost(self) -> dict[str, float]:
        """The compiler's per-device cost analysis (``flops``, ``bytes accessed``, on TPU
        ``optimal_seconds``); empty when nothing was compiled."""
        return {} if self.compiled_numbers is None else self.compiled_numbers.cost

    @property
    def kernel_flops(self) -> float:
        """FLOPs of the fused attention kernel in one step, all devices, by formula
        (``workbench.perf._attention_cost.kernel_flops``); 0 for XLA attention."""
        impl = self.attention.split(":")[0]
        if self.cfg is None or impl in ("", "xla"):
            return 0.0
        platform = "tpu" if self.source == "tpu-compiler" or self.mesh.platform == "tpu" \
            else self.mesh.platform
        cfg = self.cfg
        return kernel_flops(
            cfg.attention, platform, batch=self.batch, seq=self.seq, n_heads=cfg.n_heads,
            head_dim=cfg.head_dim, n_layers=cfg.n_layers,
            block_sizes=cfg.attention_block_sizes,
            recompute_forward=cfg.remat != "none" and "context" not in _kept(cfg.remat))

    @property
    def compute_split(self) -> int:
        """Into how many parts the mesh divides the step's compute (``analytic.compute_split``)."""
        params = {k[len("params."):]: v for k, v in self.layouts.items()
                  if k.startswith("params.")}
        return compute_split(self.rules, self.mesh, params)

    @property
    def padding_flops(self) -> float:
        """FLOPs a mixture of experts spends on empty expert slots (dropless or capacity
        padding), all devices, by formula (``analytic.moe_padding_flops``); 0 when dense."""
        if self.cfg is None or not self.cfg.n_experts:
            return 0.0
        return moe_padding_flops(self.cfg, self.batch, self.seq, self.rules, self.mesh)

    @property
    def flops_per_device(self) -> float:
        """Compiled per-device FLOPs, or (estimate) model FLOPs plus remat's recompute and
        the experts' empty slots, divided by ``compute_split``."""
        if self.compiled_flops_per_device is not None:
            return self.compiled_flops_per_device
        return (self.model_flops + self.flops.recompute + self.padding_flops) \
            / self.compute_split * self.pipeline_factor

    @property
    def pipeline_factor(self) -> float:
        """Work per device over its share of the model's: every stage computes all
        ``R M + S - 1`` pipeline iterations, ``R M`` of them useful: ``1 / (1 - bubble)``
        (1 without a pipeline)."""
        if not self.pipeline:
            return 1.0
        return 1.0 / (1.0 - self.pipeline["bubble_formula"])

    @property
    def replicated_compute_factor(self) -> float:
        """``model_flops / (devices × per-device FLOPs)``: 1 when devices split the work
        exactly; below 1 when devices repeat each other's work (or rematerialise)."""
        return self.model_flops / (self.mesh.size * self.flops_per_device)

    @property
    def comm_bytes_per_device(self) -> float:
        """Bytes each device sends per step over all collectives (ring model)."""
        return float(sum(c.total_wire_bytes for c in self.collectives))

    @property
    def fits(self) -> bool | None:
        """Whether ``memory['total'] <= memory['limit']`` (None when the limit is unknown)."""
        limit = self.memory.get("limit")
        return None if not limit else self.memory["total"] <= limit

    # -- text ------------------------------------------------------------------------------

    def memory_rows(self) -> list[dict[str, Any]]:
        """One row per memory component: compiled (or estimate) and estimate bytes."""
        mem, est = self.memory, self.memory_estimate
        keys = [k for k in (*MEMORY_KEYS, "temp", "total", "limit") if k in mem or k in est]
        return [{"key": k, "bytes": mem.get(k), "estimate": est.get(k)} for k in keys]

    def summary(self) -> str:
        """A few lines: where, how much memory, FLOPs, communication, lints."""
        label = "ESTIMATE (analytic, nothing compiled)" if self.is_estimate else \
            (f"{self.source}, from the compile cache" if self.compile_cached
             else f"{self.source}, compiled in {self.compile_seconds:.1f} s")
        lines = [
            (f"Plan {self.name!r}: batch {self.batch} x seq {self.seq} on {self.mesh.describe()}"
            f" — {label}"),
            f"  rules: {self.rules!r}",
            "  " + self._memory_line(),
            (f"  model FLOPs/step {flops_text(self.model_flops)} "
             f"(6N: {flops_text(self.flops.six_n)}); per device "
             f"{flops_text(self.flops_per_device)}"
             f"{'' if self.compiled_flops_per_device is not None else ' (estimate)'}; "
             f"replicated compute factor {self.replicated_compute_factor:.3g}"),
            (f"  communication/device/step {bytes_text(self.comm_bytes_per_device)} in "
             f"{sum(c.count for c in self.collectives)} collective(s)"
             f"{' (estimate)' if self.is_estimate else ''}"
             + ("" if self.is_estimate else
                f", {sum(c.count for c in self.collectives if c.overlapped)} overlapped "
                "(async)")),
            (f"  attention {self.attention or 'n/a'}; dtype "
             f"{self.dtype.partition(': ')[2] or self.dtype or 'n/a'}; remat "
             f"{remat_label(self.cfg.remat) if self.cfg is not None else 'n/a'}; overlap flags: "
             f"{len(self.compiler_options)}"
             + (f" ({', '.join(sorted(self.compiler_options))})"
                if self.compiler_options else " (none)")),
            f"  source: {self.source} — {self.source_reason}",
            "  " + self._predicted_line(),
            *([f"  placement: {self.placement}"] if self.placement else []),
            *([f"  {_pipeline_line(self.pipeline)}"] if self.pipeline else []),
            *([f"  {_lints_line(self.warnings)}"] if self.warnings else []),
        ]
        return "\n".join(lines)

    def _memory_line(self) -> str:
        """``memory/device: total ... of ... (fits): params ..., optimizer ..., temp ...``."""
        mem, b = self.memory, bytes_text
        fits = {True: "fits", False: "DOES NOT FIT", None: "limit unknown"}[self.fits]
        return (f"memory/device: total {b(mem['total'])} of {b(mem.get('limit'))} ({fits}): "
                f"params {b(mem['params'])}, optimizer {b(mem['optimizer'])}, "
                f"temp {b(mem['temp'])} (gradients {b(mem.get('gradients'))})")

    def _predicted_line(self) -> str:
        p = self.predicted
        if p is None:   # a hardware table without the numbers
            return f"predicted: unavailable ({self.prediction_error})"
        text = (f"predicted: {p.step_seconds * 1e3:.4g} ms/step ({p.bound}-bound)"
                + (f", {p.mfu_text()}" if p.mfu is not None else "")
                + (f", {p.tokens_per_s:,.0f} tokens/s" if p.tokens_per_s else ""))
        if p.compiler_seconds is not None:
            text += f"; TPU compiler's estimate {p.compiler_seconds * 1e3:.4g} ms"
        return text + (f"\n  {_band_line(p)}" if p.band is not None else "")

    def __str__(self) -> str:
        lines = [self.summary(), "", "memory per device (bytes)  compiled/estimate"]
        for row in self.memory_rows():
            lines.append(f"  {row['key']:<12} {bytes_text(row['bytes']):>12} "
                         f"{bytes_text(row['estimate']):>12}")
        lines += ["", f"FLOPs: {self.flops}"]
        if self.collectives:
            lines += ["", "collectives (per device):"]
            for c in self.collectives[:12]:
                lines.append(f"  {c.kind:<18} over {','.join(c.axes) or '-':<12} x{c.count:<4} "
                             f"{bytes_text(c.bytes):>10} each, sends "
                             f"{bytes_text(c.total_wire_bytes)}  "
                             f"{' '.join(c.shapes[:2])}")
                if c.sources or c.rule:
                    lines.append(f"      {c.tensors[0] if c.tensors else ''}"
                                 f"{' at ' + c.sources[0] if c.sources else ''}"
                                 f"{'; ' + c.rule if c.rule else ''}")
            if len(self.collectives) > 12:
                lines.append(f"  ... {len(self.collectives) - 12} more")
        for w in self.warnings:
            lines += ["", str(w)]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Plan {self.name!r}: {self.summary().splitlines()[2].strip()}>"

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly summary (for run.json and the compare table)."""
        return {
            "name": self.name, "is_estimate": self.is_estimate, "batch": self.batch,
            "seq": self.seq, "mesh": self.mesh.shape, "rules": self.rules.to_dict(),
            "memory": dict(self.memory), "memory_estimate": dict(self.memory_estimate),
            "model_flops": self.model_flops, "six_n": self.flops.six_n,
            "flops_formula": self.flops.formula,
            "compiled_flops_per_device": self.compiled_flops_per_device,
            "flops_per_device": self.flops_per_device,
            "replicated_compute_factor": self.replicated_compute_factor,
            "comm_bytes_per_device": self.comm_bytes_per_device, "fits": self.fits,
            "collectives": [c.to_dict() for c in self.collectives],
            "warnings": [w.to_dict() for w in self.warnings],
            "compile_seconds": self.compile_seconds,
            "source": self.source, "source_reason": self.source_reason,
            "predicted": None if self.predicted is None else self.predicted.to_dict(),
            **({"pipeline": self.pipeline} if self.pipeline else {}),
            "compiler_options": dict(self.compiler_options), "attention": self.attention,
            "dtype": self.dtype, "placement": self.placement,
        }

    def to_json(self) -> dict[str, Any]:
        """Every field as JSON-friendly data; ``PlanReport.from_json`` reads it back with
        the same summary, dict form and prediction (``planning.serialise``)."""
        return report_to_json(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PlanReport:
        """The report of ``to_json()``'s data (after ``json.dumps`` / ``json.loads``).

        A plan of real devices reads back on the abstract mesh of the same devices (the
        report has nothing to run on); everything else is as it was.

        Raises:
            ValueError: ``data`` is not a plan report of this format.
        """
        fields = report_fields(data)
        cn = fields.pop("compiled_numbers")
        return cls(**fields, compiled_numbers=None if cn is None else CompiledNumbers(
            tpu=fields["source"] == "tpu-compiler", values=cn))


def with_prediction(report: PlanReport, spec: EffectiveSpec | None = None) -> PlanReport:
    """``report`` with its prediction made now and stored (``PlanReport.predicted``):
    ``perf.predict_plan(report, spec)``, by default with ``effective_spec(report.mesh)``
    (the mesh's hardware entry, the CPU measured here, and the calibration stored for the
    device kind at this moment). ``wb.plan`` calls it once, when the plan is made. A
    prediction that breaks a physical bound (``Prediction.implausible``) adds the error
    lint ``implausible_prediction`` to the new report's ``warnings``; a hardware table
    without the numbers leaves ``predicted`` None and says why (``prediction_error``)."""
    try:
        spec = effective_spec(report.mesh) if spec is None else spec
        pred = predict_plan(report, spec)
    except (ValueError, OSError) as err:   # no entry, or an entry without the numbers
        return dataclasses.replace(report, predicted=None, prediction_error=str(err))
    warnings = list(report.warnings)
    if pred.implausible and not any(w.kind == "implausible_prediction" for w in warnings):
        warnings.append(Lint(
            kind="implausible_prediction", severity="error", path="predicted",
            message="the predicted step breaks a physical bound: " + "; ".join(pred.implausible),
            fix="do not trust this plan's step time or MFU (wb.search does not rank it); "
                "compile it for the target (compile=True) or check the model's FLOPs and the "
                "hardware table", value=pred.step_seconds))
    return dataclasses.replace(report, predicted=pred, prediction_error="", warnings=warnings)


def _band_line(p: Prediction) -> str:
    """How sure the prediction is: ``band: 38.1-45.3 ms/step, MFU 11.2-13.4%, 5,640-6,720
    tokens/s (from 3 calibration layouts ...)``, or ``band: none (why)``."""
    band = p.band
    if not band.known:
        return f"band: none ({band.source})"
    lo, hi = band.seconds(p.step_seconds)
    mfu, rate = band.rate(p.mfu), band.rate(p.tokens_per_s)
    fp8 = band.rate(p.mfu_fp8) if p.mfu_fp8 is not None else None
    return (f"band: {lo * 1e3:.4g}-{hi * 1e3:.4g} ms/step"
            + (f", MFU {mfu[0]:.1%}-{mfu[1]:.1%}" if mfu else "")
            + (f" of the bf16 peak, {fp8[0]:.1%}-{fp8[1]:.1%} of the fp8 peak" if fp8 else "")
            + (f", {rate[0]:,.0f}-{rate[1]:,.0f} tokens/s" if rate else "")
            + f" ({band.summary()})")


def _pipeline_line(pp: Mapping[str, Any]) -> str:
    """The pipeline's stages, schedule, bubble, stage memory and permutes, on one line."""
    return (f"pipeline: {pp['stages']} stages x {pp['microbatches']} micro-batches, "
            f"{pp['schedule']}" + (f" x{pp['repeats']}" if pp['repeats'] > 1 else "")
            + f"; bubble {pp['bubble_formula']:.1%} (formula), "
            f"{pp['bubble_schedule']:.1%} (schedule); stage memory "
            + "/".join(bytes_text(m) for m in pp["stage_memory"])
            + f"; {sum(c['count'] for c in pp['permutes'])} collective permute(s)")


def _lints_line(warnings: list[Lint]) -> str:
    """``lints: 1 error, 2 warning``: how many of each severity, in order of appearance."""
    counts: dict[str, int] = {}
    for w in warnings:
        counts[w.severity] = counts.get(w.severity, 0) + 1
    return "lints: " + ", ".join(f"{n} {s}" for s, n in counts.items())


def _kept(remat: Any) -> set[str]:
    """Checkpoint names a remat policy saves or offloads."""
    p = resolve_remat(remat)
    return set(p.saved) | set(p.offloaded)
