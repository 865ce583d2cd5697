"""Expert-load heatmap of a mixture-of-experts run: tokens per expert over steps, inline.

The rows are experts, the columns steps, the colour each expert's share of its layer's
assignments relative to a balanced router (``1.0`` = ``k * tokens / E``); a layer picker
switches between the MoE layers (or their sum). It reads ``moe_tokens_per_expert`` from a
run directory's ``metrics.jsonl`` and, passed to ``Trainer.run(sinks=[...])``, follows a
running training live (``event``/``update``/``finish``: a ``workbench.train._sinks.Sink``).
"""
from __future__ import annotations

import os
import pathlib
import time
from typing import Any

import anywidget
import traitlets

from workbench import _runs as runs
from workbench._notebook import in_notebook
from workbench.widgets import _assets

__all__ = ["ExpertLoad", "expert_load", "expert_load_payload"]

KEY = "moe_tokens_per_expert"


def expert_load_payload(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Step records -> ``{"steps", "load" (step x layer x expert), "dropped", "entropy",
    "layers", "experts"}`` (records without expert loads are skipped)."""
    rows = [r for r in records if isinstance(r.get(KEY), list)]
    load = [r[KEY] for r in rows]
    return {"steps": [r["step"] for r in rows], "load": load,
            "dropped": [r.get("moe_dropped") for r in rows],
            "entropy": [r.get("moe_entropy") for r in rows],
            "layers": len(load[0]) if load else 0,
            "experts": len(load[0][0]) if load and load[0] else 0}


class ExpertLoad(anywidget.AnyWidget):
    """Tokens per expert over steps for one run directory (live when used as a sink).

    Args:
      run_dir: a run directory of a mixture-of-experts model.
      rate: at most this many updates a second are sent to the browser when live.
    """

    _esm = _assets.esm("expert_load")
    _css = _assets.css("expert_load")
    data = traitlets.Dict({}).tag(sync=True)
    name = traitlets.Unicode("").tag(sync=True)

    def __init__(self, run_dir: str | os.PathLike[str], *, rate: float = 4.0,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.run_dir = pathlib.Path(run_dir)
        self.interval = 1.0 / rate
        self._last = 0.0
        self._records = runs.read_metrics(self.run_dir) \
            if (self.run_dir / runs.METRICS).exists() else []
        self.name = self.run_dir.name
        self.data = expert_load_payload(self._records)

    def __repr__(self) -> str:
        """Text form: the newest step's load per layer, relative to balanced."""
        d = self.data
        if not d.get("steps"):
            return f"ExpertLoad {self.name!r}: no expert loads yet"
        last = d["load"][-1]
        lines = [f"ExpertLoad {self.name!r}: step {d['steps'][-1]}, {d['layers']} MoE "
                 f"layer(s) x {d['experts']} experts, dropped {d['dropped'][-1]}"]
        for i, layer in enumerate(last):
            mean = sum(layer) / max(1, len(layer))
            lines.append(f"  layer {i}: max/mean {max(layer) / mean:.2f}" if mean else
                         f"  layer {i}: no tokens")
        return "\n".join(lines)

    def display(self) -> None:
        """Shows the heatmap in the current cell's output (nothing outside a kernel)."""
        from IPython.display import display

        if in_notebook():
            display(self)

    # -- Sink: follow a running Trainer ------------------------------------------------
    def event(self, kind: str, **fields: Any) -> None:
        """Events are not drawn."""

    def update(self, rec: dict[str, Any]) -> None:
        """One step record; the heatmap is re-sent at most ``rate`` times a second."""
        self._records = [r for r in self._records if r["step"] < rec["step"]] + [rec]
        if time.monotonic() - self._last >= self.interval:
            self._push()

    def finish(self, status: str, message: str | None = None) -> None:
        """Sends the last steps."""
        self._push()

    def _push(self) -> None:
        self.data = expert_load_payload(self._records)
        self._last = time.monotonic()


def expert_load(source: Any, **options: Any) -> ExpertLoad:
    """The heatmap of a run directory, a ``Trainer`` or a ``Job`` (their ``run_dir``)."""
    run_dir = getattr(source, "run_dir", source)
    return ExpertLoad(run_dir, **options)
