"""Plan widget (memory bars per device, FLOPs, lints, collectives, tensor table) and the
``wb.compare`` table + plotly chart."""
from __future__ import annotations

from typing import Any

import anywidget
import ipywidgets
import numpy as np
import traitlets

from workbench._sharding.pytrees import TreeLayouts, bytes_per_device
from workbench.widgets import _assets
from workbench.widgets._payload import mesh_summary
from workbench.widgets._layout_view import LayoutWidget
from workbench.widgets._tree_view import TreeView

__all__ = ["PlanView", "PlanWidget", "compare_figure", "compare_widget", "plan_payload",
           "plan_widget"]

STACK = ("params", "optimizer", "gradients", "activations", "batch")


class PlanWidget(anywidget.AnyWidget):
    """Draws a plan's summary, per-device memory, FLOPs, lints and collectives."""

    _esm = _assets.esm("plan")
    _css = _assets.css("plan")
    payload = traitlets.Dict().tag(sync=True)
    tab = traitlets.Unicode("overview").tag(sync=True)
    selected_collective = traitlets.Int(-1).tag(sync=True)
    collective_note = traitlets.Unicode("").tag(sync=True)


class PlanView(ipywidgets.VBox):
    """The plan above the table of every tensor (params and optimizer state).

    Attributes:
        summary: the ``PlanWidget`` (tabs: overview, activations, collectives).
        tensors: the ``TreeView`` (click a row to draw that tensor's layout).
        before, after: ``LayoutWidget`` s drawing the layouts before and after the
            collective clicked in the collectives tab (hidden until one is clicked).
    """

    def __init__(self, plan: Any) -> None:
        self.plan = plan
        self.summary = PlanWidget(payload=plan_payload(plan))
        self.before = LayoutWidget(placeholder="click a collective to draw its layouts")
        self.after = LayoutWidget(placeholder="")
        self.exchange = ipywidgets.HBox([self.before, self.after])
        self.exchange.layout.display = "none"
        self.summary.observe(self._on_collective, names="selected_collective")
        tree = {"params": plan.param_state, "opt_state": plan.abstract_state.opt_state}
        self.tensors = TreeView(tree, plan_tensors(plan), title=f"plan {plan.name!r}")
        if _is_penzai(plan):  # treescope draws the penzai model itself, its arrays sharded
            self.tensors.table.unobserve(self.tensors._on_treescope, names="want_treescope")
            self.tensors.table.observe(self._on_penzai_treescope, names="want_treescope")
        super().__init__(children=[self.summary, self.exchange, self.tensors])
        plan._watch(self._refresh)   # a background compile landing redraws the summary

    def _refresh(self) -> None:
        """The plan's numbers again (the compiler's, once a background compile is in)."""
        self.summary.payload = plan_payload(self.plan)

    def select_collective(self, index: int) -> None:
        """Draw the layouts before and after ``plan.collectives[index]`` (as a click on
        its row in the collectives tab does)."""
        self.summary.selected_collective = index

    def _on_collective(self, change: dict) -> None:
        index = change["new"]
        if index < 0 or index >= len(self.plan.collectives):
            self.exchange.layout.display = "none"
            return
        from workbench.planning._activations import collective_layouts

        drawn = collective_layouts(self.plan, index)
        self.before.show_layout(drawn.before)
        self.after.show_layout(drawn.after)
        self.summary.collective_note = drawn.note
        self.exchange.layout.display = "flex"

    def penzai_model(self) -> Any:
        """The plan's penzai model with its parameters materialised into the plan's
        shardings (on real devices), else with abstract parameters."""
        from workbench.any_model._penzai import PenzaiModel, penzai_tree

        if self.plan.mesh.jax_mesh is not None:
            return penzai_tree(self.plan.materialize(seed=0))
        from flax import nnx

        model = nnx.merge(self.plan.graphdef, self.plan.abstract_state.params)
        assert isinstance(model, PenzaiModel)
        return penzai_tree(model)

    def _on_penzai_treescope(self, change: dict) -> None:
        if change["new"] and not self.tensors.table.treescope_html:
            self.tensors.tree = self.penzai_model()
            self.tensors._on_treescope(change)

    def __repr__(self) -> str:
        return str(self.plan)


def _is_penzai(plan: Any) -> bool:
    return (getattr(plan.factory, "config", None) or {}).get("family") == "penzai"


def plan_tensors(plan: Any) -> TreeLayouts:
    """The plan's own layouts of the parameters and optimizer state, for the tensor table."""
    lays = {k: v for k, v in plan.layouts.items() if k.startswith(("params.", "opt_state."))}
    return TreeLayouts(mesh=plan.mesh, layouts=lays, notes={}, skipped=())


def _per_device(plan: Any, prefix: str) -> np.ndarray:
    return bytes_per_device([v for k, v in plan.layouts.items() if k.startswith(prefix)],
                            plan.mesh)


def plan_payload(plan: Any) -> dict[str, Any]:
    """The plan widget's JSON payload (pure; no front end)."""
    params = _per_device(plan, "params.")
    mem = plan.memory
    per_device = {
        "params": params.tolist(),
        "optimizer": _per_device(plan, "opt_state.").tolist(),
        "gradients": params.tolist(),
        "activations": [int(mem.get("activations") or 0)] * plan.mesh.size,
        "batch": _per_device(plan, "batch.").tolist(),
    }
    f, r = plan.report.flops, plan.report
    return {
        "kind": "plan",
        "name": plan.name,
        "background": _background(plan),
        "estimate": bool(r.is_estimate),
        "compile_seconds": r.compile_seconds,
        "compile_cached": bool(r.compile_cached),
        "source": plan.source, "source_reason": plan.source_reason,
        "predicted": None if r.predicted is None else r.predicted.to_dict(),
        "mesh": mesh_summary(plan.mesh),
        "mesh_text": plan.mesh.describe(),
        "rules": plan.rules.to_dict(),
        "batch": r.batch, "seq": r.seq,
        "memory": {"rows": plan.memory_rows(), "per_device": per_device, "stack": list(STACK),
                   "limit": mem.get("limit"), "total": mem.get("total"), "fits": plan.fits},
        "flops": {"model": f.total, "six_n": f.six_n, "formula": f.formula,
                  "breakdown": f.breakdown, "per_device": plan.flops_per_device,
                  "compiled_per_device": r.compiled_flops_per_device,
                  "replicated_compute_factor": r.replicated_compute_factor,
                  "tokens": f.tokens},
        "collectives": [{k: v for k, v in c.to_dict().items() if k != "names"}
                        | {"note": c.names[0] if c.names and c.names[0].startswith("estimate")
                           else None, "index": i} for i, c in enumerate(plan.collectives)],
        "activations": _activations(plan),
        "comm_bytes_per_device": r.comm_bytes_per_device,
        "warnings": [w.to_dict() | {"paths": list(w.paths[:20]), "n_paths": len(w.paths)}
                     for w in plan.warnings],
    }


def _background(plan: Any) -> dict[str, Any] | None:
    """A ``wb.plan(wait=False)`` plan's compile: its state, since when, what it says, and
    what the compiler's numbers changed; None for a plan made whole at once."""
    state = plan.compile_state
    if state is None:
        return None
    bg = plan.__dict__["_background"]
    text = {"queued": "the formula's numbers; the compile waits for a free core",
            "compiling": "the formula's numbers; the compiler is running in the background",
            "compiled": f"the compiler's numbers, in after {bg.seconds:.1f} s (they replaced "
                        "the formula's)",
            "cancelled": "the formula's numbers; the compile was cancelled",
            "failed": "the formula's numbers; the compile failed: "
                      + str(bg.error).splitlines()[0][:300]}[state]
    return {"state": state, "text": text, "since": bg.started,
            "changes": [c["text"] for c in plan.changes]}


def _activations(plan: Any) -> dict[str, Any]:
    """The activations tab: rows, or why there are none (a forward that cannot be traced
    again is said, not raised: the rest of the plan still draws)."""
    try:
        acts = plan.activations
    except Exception as err:  # noqa: BLE001 - the plan itself is valid; say what failed
        return {"rows": [], "error": f"{type(err).__name__}: {str(err)[:300]}"}
    return {"rows": [a.to_dict() for a in acts], "error": None,
            "per_device": int(sum(a.bytes_per_device * a.count for a in acts))}


def plan_widget(plan: Any) -> PlanView:
    """The plan widget: summary and lints on top, the tensor table below."""
    return PlanView(plan)


#: Font size (px) of the strategy names, and the widest a name's line may be (characters)
#: before it wraps at a space.
_NAME_FONT, _NAME_CHARS = 12, 28
#: Panel titles, two short lines each: they fit a quarter of a 900 px wide output.
_TITLES = ("memory / device<br>(GiB)", "FLOPs / device<br>(TFLOP)",
           "sent / device / step<br>(GiB)", "replicated<br>compute factor")


def _wrap(name: str, width: int = _NAME_CHARS) -> list[str]:
    """``name`` in lines of at most ``width`` characters, broken at spaces where it can."""
    lines: list[str] = []
    for word in name.split(" "):
        while len(word) > width:                       # one long token: cut it
            if lines and not lines[-1]:
                lines.pop()
            lines += [word[:width]]
            word = word[width:]
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return [ln for ln in lines if ln] or [""]


def _panel_max(fig: Any) -> list[float]:
    """An upper bound of the x values drawn in each of the figure's four panels (stacked
    bars: the sum of their largest values)."""
    out = [0.0] * 4
    for t in fig.data:
        vals = [float(v) for v in (t.x or ()) if v is not None and np.isfinite(v)]
        if vals:
            col = int((t.xaxis or "x")[1:] or 1) - 1
            out[col] = out[col] + max(vals) if t.type == "bar" else max(out[col], *vals)
    return out


def compare_figure(comparison: Any) -> Any:
    """Plotly figure: memory per device stacked by kind (limit marked), FLOPs per device,
    bytes sent per device per step, replicated compute factor.

    One row of plans per strategy, bars horizontal and the panels sharing the names on the
    left: names are never rotated and never overlap, however many or long (a long name
    wraps at spaces; the left margin and the height follow the names drawn)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows = comparison.rows
    wrapped = [_wrap(r["name"] + (" (est.)" if r["estimate"] else "")) for r in rows]
    names = ["<br>".join(w) for w in wrapped]
    longest = max((len(ln) for w in wrapped for ln in w), default=1)
    lines = sum(len(w) for w in wrapped)
    fig = make_subplots(rows=1, cols=4, shared_yaxes=True, horizontal_spacing=0.035,
                        subplot_titles=_TITLES)
    gib = 1024 ** 3

    def bar(name: str, values: list[float], col: int, **kw: Any) -> None:
        fig.add_trace(go.Bar(name=name, y=names, x=values, orientation="h", **kw),
                      row=1, col=col)

    for key in STACK:
        bar(key, [(r["memory"].get(key) or 0) / gib for r in rows], 1)
    limits = [r["limit"] for r in rows]
    if any(limits):
        fig.add_trace(go.Scatter(name="device limit", y=names, mode="markers",
                                 x=[(x or np.nan) / gib for x in limits],
                                 marker={"symbol": "line-ns-open", "size": 18,
                                         "color": "black", "line": {"width": 2}}),
                      row=1, col=1)
    bar("FLOPs/device", [r["flops_per_device"] / 1e12 for r in rows], 2, showlegend=False)
    bar("sent/device", [r["comm_bytes_per_device"] / gib for r in rows], 3, showlegend=False)
    bar("compute factor", [r["replicated_compute_factor"] for r in rows], 4,
        showlegend=False)
    fig.update_annotations(font={"size": 13})
    fig.update_yaxes(autorange="reversed", tickfont={"size": _NAME_FONT}, automargin=True)
    fig.update_xaxes(tickfont={"size": 11}, nticks=4, tickangle=0)
    for col, trace_max in enumerate(_panel_max(fig), 1):   # 4k, not 4000; 0.5, not 500m
        fig.update_xaxes(tickformat="~s" if trace_max >= 1000 else "~g", row=1, col=col)
    top, bottom = 64, 80           # two-line titles above; x ticks and the legend below
    plot = max(120, 22 * lines + 16 * len(rows))
    fig.update_layout(
        barmode="stack", height=top + plot + bottom, bargap=0.3,
        margin={"t": top, "b": bottom, "r": 16,
                "l": min(360, 16 + int(0.55 * _NAME_FONT * longest))},
        legend={"orientation": "h", "x": 0, "xanchor": "left", "y": -40 / plot,
                "yanchor": "top", "font": {"size": 11}, "itemsizing": "constant"})
    return fig


def compare_widget(comparison: Any) -> ipywidgets.VBox:
    """The comparison table (HTML) above its plotly chart."""
    import html

    import plotly.graph_objects as go

    table = ipywidgets.HTML(f"<pre class='wb-compare'>{html.escape(comparison.table())}</pre>")
    return ipywidgets.VBox([table, go.FigureWidget(compare_figure(comparison))])
