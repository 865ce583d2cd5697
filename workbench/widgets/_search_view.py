"""``wb.search`` view: a sortable table of the candidates (anywidget) above a plotly chart of
memory per device against predicted step time, the fitting region shaded."""
from __future__ import annotations

import math
from typing import Any

import anywidget
import ipywidgets
import traitlets

from workbench.widgets import _assets

__all__ = ["SearchView", "SearchWidget", "search_figure", "search_payload", "search_widget"]

_UNITS = (("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024), ("B", 1))


class SearchWidget(anywidget.AnyWidget):
    """The search's summary, advice, rank changes and a sortable table of every candidate."""

    _esm = _assets.esm("search")
    _css = _assets.css("search")
    payload = traitlets.Dict().tag(sync=True)


def _clean(v: Any) -> Any:
    """JSON-safe: plain ints/floats (no NaN or infinity), dicts and lists of them."""
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, int) or (hasattr(v, "dtype") and getattr(v.dtype, "kind", "") in "iu"):
        return int(v)
    f = float(v)
    return f if math.isfinite(f) else None


def search_payload(result: Any) -> dict[str, Any]:
    """The widget's JSON payload (pure; no front end): every row flagged ``best`` and
    ``pareto``, the skipped candidates, rank changes, advice and notes."""
    pareto = {r["id"] for r in result.pareto}
    best = result.fitting[0]["id"] if result.fitting else None
    rows = [dict(r, best=r["id"] == best, pareto=r["id"] in pareto) for r in result.rows]
    return _clean({
        "kind": "search", "summary": result.summary(), "hardware": result.hardware,
        "devices": result.devices, "batch": result.batch, "seq": result.seq,
        "limit": result.limit, "rows": rows, "skipped": result.skipped,
        "rank_changes": result.rank_changes, "advice": result.advice,
        "notes": result.notes, "seconds": result.seconds,
        "analytic_seconds": result.analytic_seconds, "live": _live(result),
    })


def _live(result: Any) -> dict[str, Any] | None:
    """A ``wb.search(wait=False)``'s exact pass: its state and what it says (the best
    row is the exact best once it is "compiled"); None for a search made whole at once."""
    state = result.compile_state
    if state is None:
        return None
    compiled = sum(r["source"] != "estimate" for r in result.rows)
    text = {"queued": "formula ranking; the exact pass is starting",
            "compiling": f"formula ranking re-ranked by {compiled} compiled so far; the "
                         "exact pass is compiling in background workers",
            "compiled": f"exact pass done: {compiled} compiled; the best is the exact best",
            "cancelled": f"exact pass cancelled after {compiled} compiled",
            "failed": "exact pass failed: " + str(
                result.__dict__["_background"].error).splitlines()[0][:300]}[state]
    return {"state": state, "text": text, "exact_best": state == "compiled"}


def _unit(values: list[float]) -> tuple[str, float]:
    top = max(values) if values else 1
    return next((u, s) for u, s in _UNITS if top >= s or s == 1)


def _fmt(n: float) -> str:
    unit, scale = _unit([n])
    return f"{n / scale:.3g} {unit}"


def search_figure(result: Any) -> Any:
    """Plotly figure: memory per device (x) against predicted step time (y) of every
    candidate with a prediction, one colour per rules preset; what does not fit drawn as
    crosses, the fitting region (up to the device limit) shaded, the Pareto front joined,
    the best starred; hovering a point names its layout."""
    import plotly.graph_objects as go

    rows = [r for r in result.rows if r["step_seconds"] is not None]
    limit = result.limit
    top = max((r["memory_per_device"] for r in rows), default=1)
    unit, scale = _unit([top])
    fig = go.Figure()
    if limit and limit <= 3 * top:  # the limit on the chart, the region left of it shaded
        fig.add_vrect(x0=0, x1=limit / scale, fillcolor="#59a14f", opacity=0.08, line_width=0,
                      annotation_text="fits", annotation_position="top left")
        fig.add_vline(x=limit / scale, line_dash="dash", line_color="#d62728",
                      annotation_text=f"device memory {limit / scale:.3g} {unit}",
                      annotation_position="top right")
    elif limit:  # far beyond every candidate: all of the chart fits
        fig.add_vrect(x0=0, x1=1.1 * top / scale, fillcolor="#59a14f", opacity=0.08,
                      line_width=0, annotation_position="top left",
                      annotation_text=f"fits: device memory {_fmt(limit)} is off the chart")

    def hover(r: dict[str, Any]) -> str:
        fits = "limit unknown" if r["fits"] is None else "fits" if r["fits"] else \
            f"does NOT fit (+{r['over_by'] / scale:.3g} {unit})"
        mfu = "" if r["mfu"] is None else f", MFU {r['mfu']:.1%}" + (
            "" if r.get("mfu_fp8") is None else
            f" of the bf16 peak, {r['mfu_fp8']:.1%} of the fp8 peak")
        ranks = f"rank {r['analytic_rank'] or '-'} analytic / {r['exact_rank'] or '-'} exact"
        return (f"<b>{r['layout']}</b><br>{r['memory_per_device'] / scale:.4g} {unit}/device, "
                f"{fits}<br>{r['step_seconds'] * 1e3:.4g} ms/step{mfu}, {r['bound']}-bound"
                f"<br>{r['source']}; {ranks}" + (f"<br>{r['note']}" if r["note"] else ""))

    for name in dict.fromkeys(r["rules"] for r in rows):
        for fits in (True, False):
            group = [r for r in rows if r["rules"] == name and (r["fits"] is not False) == fits]
            if not group:
                continue
            compiled = [r["source"] not in ("estimate",) for r in group]
            fig.add_trace(go.Scatter(
                x=[r["memory_per_device"] / scale for r in group],
                y=[r["step_seconds"] * 1e3 for r in group], mode="markers",
                name=name if fits else f"{name} (does not fit)", legendgroup=name,
                marker={"symbol": ["diamond" if c else "circle" for c in compiled] if fits
                        else "x", "size": 9, "opacity": 1.0 if fits else 0.55},
                hovertext=[hover(r) for r in group], hoverinfo="text"))
    front = result.pareto
    if front:
        fig.add_trace(go.Scatter(
            x=[r["memory_per_device"] / scale for r in front],
            y=[r["step_seconds"] * 1e3 for r in front], mode="lines", name="Pareto front",
            line={"color": "#777", "dash": "dot", "shape": "hv"}, hoverinfo="skip"))
        b = result.fitting[0]
        fig.add_trace(go.Scatter(
            x=[b["memory_per_device"] / scale], y=[b["step_seconds"] * 1e3], mode="markers",
            name="best", marker={"symbol": "star", "size": 16, "color": "#edc948",
                                 "line": {"width": 1, "color": "#333"}},
            hovertext=[hover(b)], hoverinfo="text"))
    fig.update_layout(
        title=f"wb.search on {result.hardware}: memory per device vs predicted step time",
        xaxis_title=f"memory per device ({unit})", yaxis_title="predicted step (ms)",
        height=420, margin={"t": 50, "b": 40, "l": 60, "r": 10},
        legend={"orientation": "h", "y": -0.2}, xaxis={"rangemode": "tozero"})
    return fig


class SearchView(ipywidgets.VBox):
    """The table (sortable, filterable) above the chart; redrawn as a live search's
    compiles land (``wb.search(wait=False)``)."""

    def __init__(self, result: Any) -> None:
        import plotly.graph_objects as go

        self.result = result
        self.table = SearchWidget(payload=search_payload(result))
        self.figure = go.FigureWidget(search_figure(result))
        super().__init__(children=[self.table, self.figure])
        result._watch(self._refresh)

    def _refresh(self) -> None:
        self.table.payload = search_payload(self.result)
        fresh = search_figure(self.result)
        with self.figure.batch_update():
            self.figure.data = ()
            self.figure.add_traces(list(fresh.data))
            self.figure.layout = fresh.layout


def search_widget(result: Any) -> SearchView:
    """The table (sortable, filterable) above the chart."""
    return SearchView(result)
