"""Predicted vs measured, term by term: a plan's prediction lined up against a profile.

One row per term of ``plan.predicted.breakdown`` with the measured time of the same term
(:class:`workbench.perf._trace.StepProfile`): compute (matmul ops), memory (the other
ops), each collective (matched by kind and mesh axes), the overlap (predicted hidden
communication vs ops measured running beside others), and what the prediction leaves out
(idle and host time). The largest disagreement is named in words. For XLA:CPU's simulated
devices the measured side is the host's time (``StepProfile.shared``): the prediction
models them as sharing the host's cores, and their ops' own durations are stretched by
however many other devices' ops ran beside them.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

from workbench._display import Displayable
from workbench.perf._trace import StepProfile

__all__ = ["ProfileReport", "Term", "profile_report"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Term:
    """One row: a term of the prediction and its measured time, seconds per step.

    Attributes:
      name: "compute", "memory", "all-reduce over data", "overlap (hidden)",
        "idle + host", "step".
      predicted, measured: seconds per step (overlap rows are time subtracted).
      kind, axes: for a collective row, its kind and mesh axes; else "" and ().
      count: instructions per step (collective rows: the compiled HLO's count).
      note: how the measured side is counted.
      wait: of ``measured``, time waiting for the group's other devices to arrive (a
        collective row on XLA:CPU; 0 elsewhere).
      latencies: collective rows: the latencies per step the prediction charges, in
        units of the hardware entry's latency (``CollectiveTime.latencies``).
    """

    name: str
    predicted: float
    measured: float
    kind: str = ""
    axes: tuple[str, ...] = ()
    count: int = 0
    note: str = ""
    wait: float = 0.0
    latencies: float = 0.0

    @property
    def ratio(self) -> float | None:
        """measured / predicted (None when nothing was predicted)."""
        return self.measured / self.predicted if self.predicted > 0 else None

    @property
    def error(self) -> float:
        """measured - predicted, seconds per step."""
        return self.measured - self.predicted


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class ProfileReport(Displayable):
    """A profile of real steps beside the plan's prediction (``trainer.profile()``).

    Attributes:
      terms: one ``Term`` per term of the prediction, then "idle + host" and "step".
      prediction: the prediction's dict (``Prediction.to_dict()``).
      measured: the ``StepProfile`` read from the trace.
      directory: where the trace is (open it in XProf: ``xprof --logdir <run_dir>/profiles``).
      tokens_per_s: ``{"outside": ..., "during": ...}``: throughput of the steps just
        before the profile and of the profiled steps (the profiler's overhead), when known.
      plan_name, mesh: what was profiled (``{"data": 4, "model": 2}``).
      device_kind: the devices' kind (for the calibration).
      processes: the processes of the run (for the calibration: which collectives cross).
      collective_rows: one per merged collective of the step (``hlo.Collective``), its
        predicted and measured seconds per step: ``{"kind", "axes", "bytes", "count",
        "latencies", "predicted", "parts", "measured"}`` (what ``wb.calibrate`` fits
        latency and bandwidth to: sizes and array counts differ between them; ``parts``:
        the prediction's messages and bytes per link, ``CollectiveTime.parts``).
    """

    terms: tuple[Term, ...]
    prediction: dict[str, Any]
    measured: StepProfile
    directory: str
    tokens_per_s: dict[str, float] = dataclasses.field(default_factory=dict)
    plan_name: str = ""
    mesh: dict[str, int] = dataclasses.field(default_factory=dict)
    device_kind: str = ""
    processes: int = 1
    collective_rows: tuple[dict[str, Any], ...] = ()

    def term(self, name: str) -> Term:
        """The row called ``name``."""
        for t in self.terms:
            if t.name == name:
                return t
        raise KeyError(f"no term {name!r}; terms: {[t.name for t in self.terms]}")

    @property
    def own_step_seconds(self) -> float:
        """The measured step less the time other processes took the host's cores (on
        XLA:CPU, the "other processes" row): the step with the machine to itself."""
        others = next((t.measured for t in self.terms if t.name == "other processes"), 0.0)
        return self.term("step").measured - others

    @property
    def largest_disagreement(self) -> Term:
        """The term (not the step) whose measured time is farthest from its prediction."""
        return max((t for t in self.terms if t.name != "step"), key=lambda t: abs(t.error))

    @property
    def overhead(self) -> float | None:
        """tokens/s outside the profile / tokens/s during it, minus 1 (0.05: the profiled
        steps ran 5% slower); None when either is unknown."""
        out, during = self.tokens_per_s.get("outside"), self.tokens_per_s.get("during")
        return out / during - 1.0 if out and during else None

    def verdict(self) -> str:
        """The largest disagreement in words."""
        t, step = self.largest_disagreement, self.term("step")
        if t.predicted > 0:
            how = (f"{t.ratio:.2g}x the predicted {t.predicted * 1e3:.3g} ms"
                   if t.ratio is not None else "")
        else:
            how = "not predicted at all"
        more = "longer" if t.error > 0 else "shorter"
        share = abs(t.error) / step.measured if step.measured > 0 else 0.0
        wait = (f"; {t.wait * 1e3:.3g} ms of it waiting for the other devices of each group "
                "to arrive (they reach the collective at different times: uneven work, or "
                "devices sharing cores)" if t.wait > 0.1 * t.measured else "")
        return (f"largest disagreement: {t.name} took {t.measured * 1e3:.3g} ms per step, "
                f"{how} ({abs(t.error) * 1e3:.3g} ms {more}, {share:.0%} of the measured "
                f"{step.measured * 1e3:.3g} ms step){wait}")

    def rows(self) -> list[dict[str, Any]]:
        """JSON-friendly rows (the widget's data)."""
        return [{"name": t.name, "predicted": t.predicted, "measured": t.measured,
                 "kind": t.kind, "axes": list(t.axes), "count": t.count, "note": t.note,
                 "wait": t.wait, "latencies": t.latencies, "ratio": t.ratio}
                for t in self.terms]

    def table(self) -> str:
        """The terms as text."""
        lines = [f"{'term':<34} {'predicted':>11} {'measured':>11} {'ratio':>7}"]
        for t in self.terms:
            r = f"{t.ratio:.2f}" if t.ratio is not None else "-"
            lines.append(f"{t.name:<34} {t.predicted * 1e3:>8.3f} ms {t.measured * 1e3:>8.3f} ms "
                         f"{r:>7}" + (f"  ({t.wait * 1e3:.3g} ms waiting for peers)"
                                      if t.wait > 0 else ""))
        return "\n".join(lines)

    def __str__(self) -> str:
        head = (f"profile of {self.measured.steps} steps of {self.plan_name or 'the step'} "
                f"on {self.mesh or self.measured.devices} ({self.directory})")
        tail = [self.verdict()]
        if self.overhead is not None:
            tail.append(f"profiler overhead: {self.tokens_per_s['during']:,.0f} tokens/s during "
                        f"the profile vs {self.tokens_per_s['outside']:,.0f} outside "
                        f"({self.overhead:+.0%})")
        return "\n".join([head, self.table(), *tail])

    def __repr__(self) -> str:
        return (f"ProfileReport(step measured {self.term('step').measured * 1e3:.3g} ms, "
                f"predicted {self.term('step').predicted * 1e3:.3g} ms)")

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (stored beside the trace as ``report.json``, which the lab's
        run dashboard shows: ``workbench/server/profiles.py`` reads it without JAX)."""
        return {"directory": self.directory, "plan_name": self.plan_name, "mesh": self.mesh,
                "device_kind": self.device_kind, "processes": self.processes,
                "tokens_per_s": self.tokens_per_s, "overhead": self.overhead,
                "calibrated": "calibration" in self.prediction.get("sources", {}),
                "rows": self.rows(),
                "verdict": self.verdict(), "steps": self.measured.steps,
                "categories": self.measured.categories,
                "collective_rows": list(self.collective_rows),
                "top_ops": [dataclasses.asdict(o) for o in self.measured.top(20)]}


def _axes_name(kind: str, axes: tuple[str, ...]) -> str:
    return f"{kind} over {','.join(axes) or '-'}"


def profile_report(prediction: Any, measured: StepProfile, *, plan_name: str = "",
                   mesh: dict[str, int] | None = None, device_kind: str = "",
                   processes: int = 1,
                   tokens_per_s: dict[str, float] | None = None) -> ProfileReport:
    """Line a prediction up against a profile, term by term.

    The rows of one table in the order of the prediction's breakdown, each predicted term
    beside its measured one: compute and memory, the collectives by kind and axes
    (:func:`_collective_terms`), overlap and idle (:func:`_rest_terms`), the step; and
    each predicted collective beside the measured one it is (:func:`_collective_rows`).

    Args:
      prediction: ``plan.predicted`` (a ``Prediction``) or its dict (``run.json``'s
        ``"prediction"``).
      measured: ``read_trace(...)`` of the same step.
      plan_name, mesh, device_kind, processes: what was profiled (shown, and used by the
        calibration).
      tokens_per_s: ``{"outside": ..., "during": ...}`` throughput around the profile.
    """
    pred = prediction.to_dict() if hasattr(prediction, "to_dict") else dict(prediction)
    b = pred["breakdown"]
    # XLA:CPU: the host's time (the devices share its cores, as the prediction models them)
    host = bool(measured.shared)
    cats = measured.shared if host else measured.categories
    how = " (the host's time: the cores it took, shared with the other devices' ops)" \
        if host else ""
    terms = [Term(name="compute", predicted=float(b["compute"]), measured=cats["compute"],
                  note="ops that are, or fuse, a dot or convolution" + how),
             Term(name="memory", predicted=float(b["memory"]),
                  measured=cats["memory"] + cats["other"],
                  note="every other op: elementwise, reductions, copies, control flow" + how)]
    terms += _collective_terms(b, measured, host)
    terms += _rest_terms(b, measured, sum(t.measured for t in terms), host)
    terms += [Term(name="step", predicted=float(pred["step_seconds"]),
                   measured=measured.step_seconds,
                   note="wall time per step: first op to last op of the traced steps")]
    return ProfileReport(terms=tuple(terms), prediction=pred, measured=measured,
                         collective_rows=tuple(_collective_rows(b, measured, host)),
                         directory=measured.directory, tokens_per_s=dict(tokens_per_s or {}),
                         plan_name=plan_name, mesh=dict(mesh or {}), device_kind=device_kind,
                         processes=processes)


def _collective_terms(b: dict[str, Any], measured: StepProfile, host: bool) -> list[Term]:
    """One term per collective kind and mesh axes: the predicted seconds, count and
    latencies beside the measured seconds and wait (on XLA:CPU the host's time), largest
    measured first."""
    by_key: dict[tuple[str, tuple[str, ...]], list[float]] = defaultdict(
        lambda: [0.0, 0.0, 0, 0.0, 0])
    for c in b.get("collectives", ()):
        rec = by_key[(c["kind"], tuple(c["axes"]))]
        rec[0] += float(c["seconds"])
        rec[2] += int(c["count"])
        rec[4] += float(c.get("latencies") or c["count"])
    shared_out = {(m.kind, tuple(m.axes)) for m in measured.collectives if m.apportioned > 0}
    for m in measured.collectives:
        rec = by_key[(m.kind, tuple(m.axes))]
        secs = m.shared if host and m.shared is not None else m.seconds
        rec[1] += secs
        rec[3] += m.wait * (secs / m.seconds if m.seconds > 0 else 0.0)
        if not any((c["kind"], tuple(c["axes"])) == (m.kind, tuple(m.axes))
                   for c in b.get("collectives", ())):
            rec[2] += m.collective.count
    return [Term(name=_axes_name(k, axes), predicted=p, measured=m, kind=k, axes=axes,
                 count=n, wait=w, latencies=nl,
                 note="collective instructions of this kind and mesh axes" + (
                     " (the host's time: the cores local work left unused while they ran)"
                     if host else "") + (
                     "; includes library kernels with no HLO name (NCCL), shared among "
                     "the step's collectives of their kind by bytes"
                     if (k, axes) in shared_out else ""))
            for (k, axes), (p, m, n, w, nl) in sorted(by_key.items(),
                                                      key=lambda kv: -kv[1][1])]


def _rest_terms(b: dict[str, Any], measured: StepProfile, accounted: float,
                host: bool) -> list[Term]:
    """The overlap (predicted hidden communication) and the time no op of the step ran
    (``accounted``: the measured seconds of the terms before); on XLA:CPU also what other
    processes took of the host's cores."""
    hidden = float(b.get("communication_total", 0.0)) - float(b.get("communication", 0.0))
    if host:
        others = float(measured.shared.get("others", 0.0))
        return [Term(name="overlap (hidden)", predicted=hidden, measured=0.0,
                     note="time subtracted: predicted hidden communication; measured 0: "
                          "the host's time of a collective is only what local work left "
                          "unused, the exposed part"),
                Term(name="idle + host", predicted=0.0,
                     measured=max(0.0, measured.step_seconds - (accounted + others)),
                     note="the step less the host's time of its ops: cores no op used, "
                          "and between steps (data, dispatch, metrics)"),
                Term(name="other processes", predicted=0.0, measured=others,
                     note="the host's cores other processes took while the steps ran "
                          "(/proc/stat less this process's CPU time): a loaded machine")]
    cats = measured.categories
    return [Term(name="overlap (hidden)", predicted=hidden, measured=cats["concurrent"],
                 note="time subtracted: predicted hidden communication; measured op "
                      "time that ran beside other ops of the same device"),
            Term(name="idle + host", predicted=0.0, measured=cats["idle"] + cats["host"],
                 note="no op of the step running: between ops, and between steps "
                      "(data, dispatch, metrics)")]


def _collective_rows(b: dict[str, Any], measured: StepProfile, host: bool
                     ) -> list[dict[str, Any]]:
    """Each predicted collective (kind, axes, bytes, count) beside the measured one it
    is, with the prediction's parts."""
    pending: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for c in b.get("collectives", ()):
        if "bytes" in c:   # a prediction's CollectiveTime (a hand-made dict may lack it)
            pending[(c["kind"], tuple(c["axes"]), int(c["bytes"]), int(c["count"]))].append(c)
    rows = []
    for m in measured.collectives:
        c = m.collective
        match = pending.get((c.kind, tuple(c.axes), int(c.bytes), int(c.count)))
        if not match:
            continue
        p = match.pop(0)
        rows.append({"kind": c.kind, "axes": list(c.axes), "bytes": int(c.bytes),
                     "count": int(c.count),
                     "latencies": float(p.get("latencies") or p["count"]),
                     "predicted": float(p["seconds"]),
                     "parts": [dict(x) for x in p.get("parts") or ()],
                     "measured": m.shared if host and m.shared is not None else m.seconds})
    return rows
