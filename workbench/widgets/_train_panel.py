"""The inline training panel: progress, ETA, live loss (and held-out loss) and MFU, step-time
breakdown.

``Trainer.run`` shows one :class:`TrainPanel` in its cell. The panel's history is read
from the run directory (so after a resume it shows the whole run); live steps are
buffered and sent at most ``rate`` times a second as one message each (no flood of
output, no flicker: the browser updates its nodes in place). It only displays: it is one
of the run loop's sinks (``event``, ``update``, ``finish``; ``workbench.train._sinks``).
"""
from __future__ import annotations

import math
import os
import pathlib
import time
from typing import Any

import anywidget
import traitlets

from workbench import _runs as runs
from workbench._notebook import in_notebook
from workbench.widgets import _assets

__all__ = ["TrainPanel", "earlier_attempts", "history_columns", "train_widget"]

STATIC = pathlib.Path(__file__).parent / "static"
COLUMNS = ("step", "loss", "mfu", "step_time", "data_time", "ckpt_time", "eval_loss")
_LAST = ("loss", "mfu", "mfu_fp8", "hfu", "step_time", "tokens_per_s", "grad_norm", "lr", "eval_loss",
         "eval_perplexity")


def history_columns(records: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Step records -> the panel's columns (non-finite values become None)."""
    def clean(v: Any) -> Any:
        return v if isinstance(v, (int, float)) and math.isfinite(v) else None
    return {c: [clean(r.get(c)) for r in records] for c in COLUMNS}


def earlier_attempts(attempts: dict[int, list[dict[str, Any]]], attempt: int
                     ) -> dict[str, Any]:
    """A restarted run's earlier attempts as the panel draws them (faint, beside the current
    one): ``{"attempt": n, "attempts": [{"attempt", "step", "loss", "mfu"}, ...]}``; nothing
    for a run's first attempt."""
    earlier = []
    for k, records in sorted(attempts.items()):
        if k < attempt:
            cols = history_columns(records)
            earlier.append({"attempt": k, "step": cols["step"], "loss": cols["loss"],
                            "mfu": cols["mfu"]})
    return {"attempt": attempt, "attempts": earlier} if earlier else {}


class TrainPanel(anywidget.AnyWidget):
    """Live view of one run directory while its Trainer runs.

    Args:
      run_dir: the run directory (its metrics so far are the panel's history).
      target: the step the run trains to.
      start: the step the run starts from (history beyond it is not shown).
      rate: at most this many updates a second are sent to the browser.
      prediction: the plan's prediction (``Trainer.prediction``), shown beside the measured
        step time and MFU; default: the one ``run.json`` records, if any.
      attempt: the attempt the run trains (``Trainer.attempt``); a restarted run's earlier
        attempts are drawn faint beside it.
    """

    _esm = _assets.esm("train_panel")
    _css = _assets.css("train_panel")
    info = traitlets.Dict({}).tag(sync=True)
    status = traitlets.Dict({}).tag(sync=True)
    history = traitlets.Dict({}).tag(sync=True)

    def __init__(self, run_dir: str | os.PathLike[str], *, target: int, start: int = 0,
                 rate: float = 10.0, prediction: dict[str, Any] | None = None,
                 attempt: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.run_dir = pathlib.Path(run_dir)
        self.target, self.interval = target, 1.0 / rate
        attempts = runs.read_attempts(self.run_dir) \
            if (self.run_dir / runs.METRICS).exists() else {}
        records = [r for r in attempts.get(attempt, []) if r["step"] <= start]
        meta = runs.read_run(self.run_dir) if (self.run_dir / runs.RUN_JSON).exists() else {}
        self._rows: list[list[Any]] = []
        self._latest = None
        self._last_send = 0.0
        self._times: list[float] = []
        self.messages_sent = 0
        with self.hold_sync():
            self.info = {"name": meta.get("name") or self.run_dir.name,
                         "run_dir": str(self.run_dir), "peak_source": meta.get("peak_source"),
                         "model_flops": meta.get("model_flops_per_step"),
                         "prediction": runs.clean_prediction(
                             meta.get("prediction") if prediction is None else prediction)}
            self.history = history_columns(records) | earlier_attempts(attempts, attempt)
            last = records[-1] if records else {}
            self.status = {"step": start, "target": target, "eta": None,
                           "state": meta.get("status", "idle") if records else "idle",
                           "message": "", "last": {k: last.get(k) for k in _LAST}}

    def __repr__(self) -> str:
        """Text form (terminals, nbconvert, screen readers): where the run stands."""
        st, last = self.status, self.status.get("last") or {}
        parts = [f"{st.get('state', 'idle')}: step {st.get('step', 0)}/{st.get('target')}"]
        for key, fmt in (("loss", "loss {:.4f}"), ("mfu", "MFU {:.1%}"),
                         ("mfu_fp8", "MFU {:.1%} of the fp8 peak"),
                         ("step_time", "{:.3f} s/step"), ("tokens_per_s", "{:,.0f} tok/s")):
            if isinstance(last.get(key), (int, float)):
                parts.append(fmt.format(last[key]))
        pred = self.info.get("prediction") or {}
        if "step_seconds" in pred:
            parts.append(f"predicted {pred['step_seconds']:.3f} s/step")
        if st.get("message"):
            parts.append(str(st["message"]))
        return f"TrainPanel {self.info.get('name')!r} ({self.info.get('run_dir')}): " \
            + ", ".join(parts)

    def display(self) -> None:
        """Shows the panel in the current cell's output (nothing outside a kernel)."""
        from IPython.display import display

        if in_notebook():
            display(self)

    def update(self, rec: dict[str, Any]) -> None:
        """Buffers one step record; sends the buffer if ``1/rate`` s passed since the last."""
        if isinstance(rec.get("step_time"), (int, float)):
            self._times = [*self._times[-19:], float(rec["step_time"])]
        cleaned = history_columns([rec])
        self._rows.append([cleaned[c][0] for c in COLUMNS])
        self._latest: dict[str, Any] | None = rec
        if time.monotonic() - self._last_send >= self.interval or rec["step"] >= self.target:
            self.flush(state="running")

    def flush(self, state: str = "running", message: str = "") -> None:
        """Sends the buffered rows and the status in one go."""
        rec = self._latest
        eta = None
        if rec is not None and self._times:
            eta = max(0, self.target - rec["step"]) * sum(self._times) / len(self._times)
        with self.hold_sync():
            status = dict(self.status, state=state, message=message, eta=eta)
            if rec is not None:
                status.update(step=rec["step"], last={k: rec.get(k) for k in _LAST})
            self.status = status
        if self._rows:
            self.send({"type": "append", "rows": self._rows})
            self._rows = []
        self.messages_sent += 1
        self._last_send = time.monotonic()

    def event(self, kind: str, **fields: Any) -> None:
        """Shows the compile phase: ``compiling``, then ``compile`` (with its seconds)."""
        if kind == "compiling":
            self.flush(state="compiling", message="compiling the train step (XLA)…")
        elif kind == "compile":
            self.flush(state="running",
                       message=f"compiled in {fields.get('seconds') or 0.0:.1f} s")

    def finish(self, status: str, message: str | None = None) -> None:
        """Final update: remaining rows, the final status and the run's message."""
        self.flush(state=status, message=message or "")


def train_widget(trainer: Any, **options: Any) -> TrainPanel:
    """``wb.show(trainer)``: the run's panel, with the whole run read from its directory."""
    options.setdefault("prediction", getattr(trainer, "prediction", None))
    options.setdefault("attempt", getattr(trainer, "attempt", 1))
    panel = TrainPanel(trainer.run_dir, target=options.pop("target", trainer.config.steps),
                       start=trainer.step, **options)
    panel.flush(state="finished" if trainer.step >= panel.target else "idle")
    return panel
