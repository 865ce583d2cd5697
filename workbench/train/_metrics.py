"""Per-step metrics of a run (throughput, MFU, HFU) and the progress line.

Definitions (shown with the numbers):

- ``step_time``: wall-clock seconds from the end of the previous step to the end of this
  one, as the host sees it (the step's data fetch, compute and checkpoint blocking time;
  compilation excluded: it is logged once as a ``compile`` event).
- ``data_time``: host seconds spent fetching this step's batches; ``ckpt_time``: seconds
  the step was blocked by its checkpoint save (the rest of the save is asynchronous).
- ``mfu`` = model FLOPs per step ÷ (step_time × devices × peak FLOP/s per device), with
  the analytic model FLOPs of ``workbench._flops`` (no rematerialisation) and the peak's
  source (``workbench.hardware.peak_flops``: a table, or measured on CPUs).
- ``mfu_fp8`` (a model with fp8 matmuls, ``GPTConfig.quantization``, on a device with an
  fp8 peak): the same model FLOPs against the device's fp8 peak (``mfu`` stays against
  the bf16 peak: the two conventions fp8 results are quoted in).
- ``hfu`` = FLOPs XLA compiled for one device per step ÷ (step_time × peak): hardware
  FLOPs, rematerialisation included.
"""
from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO

import numpy as np

from workbench._flops import mfu


def step_record(*, step: int, loss: float, grad_norm: float, lr: float, step_time: float,
                data_time: float, ckpt_time: float, tokens: int, model_flops: float | None,
                n_devices: int, peak: float | None, peak_source: str | None,
                compiled_flops: float | None, fp8_peak: float | None = None
                ) -> dict[str, Any]:
    """One ``metrics.jsonl`` line for step ``step`` (see the module docstring)."""
    rec: dict[str, Any] = {
        "step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr,
        "step_time": step_time, "data_time": data_time, "ckpt_time": ckpt_time,
        "tokens_per_s": tokens / step_time if step_time > 0 else None,
        "model_flops": model_flops, "mfu": None, "hfu": None, "peak_source": peak_source,
    }
    if peak and step_time > 0:
        if model_flops:
            rec["mfu"] = mfu(model_flops, step_time, n_devices, peak)
            if fp8_peak:
                rec["mfu_fp8"] = mfu(model_flops, step_time, n_devices, fp8_peak)
        if compiled_flops:
            rec["hfu"] = compiled_flops / (step_time * peak)
    return rec


def moe_record(values: list[dict[str, Any]]) -> dict[str, Any]:
    """The mixture-of-experts entries of a ``metrics.jsonl`` line from the step's
    micro-batch metrics (``moe_*`` keys of :func:`workbench._step.make_train_step`; {} for a
    dense model).

    ``moe_tokens_per_expert``: (token, expert) assignments per MoE layer and expert, a list
    of lists summed over micro-batches; ``moe_dropped``: assignments dropped by the
    capacity, summed; the losses and the router entropy: means over micro-batches.
    """
    keys = [k for k in values[0] if k.startswith("moe_")] if values else []
    out: dict[str, Any] = {}
    for k in keys:
        if k == "moe_tokens_per_expert":
            out[k] = sum(np.asarray(v[k], dtype=np.int64) for v in values).tolist()
        elif k == "moe_dropped":
            out[k] = int(round(math.fsum(float(v[k]) for v in values)))
        else:
            out[k] = math.fsum(float(v[k]) for v in values) / len(values)
    return out


def fmt_duration(seconds: float | None) -> str:
    """62.3 -> '1:02'; 3725 -> '1:02:05'; None -> '?'."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = round(seconds)
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def summary_line(rec: dict[str, Any], target: int, eta: float | None) -> str:
    """``step 120/200 | loss 2.314 | 45.2 ms/step | 9.1k tok/s | MFU 3.10% | ETA 0:04``."""
    parts = [f"step {rec['step']}/{target}", f"loss {rec['loss']:.4f}"]
    if rec.get("step_time"):
        parts.append(f"{1e3 * rec['step_time']:.1f} ms/step")
    if rec.get("tokens_per_s"):
        parts.append(f"{rec['tokens_per_s'] / 1e3:.1f}k tok/s")
    if rec.get("mfu") is not None:
        parts.append(f"MFU {100 * rec['mfu']:.2f}%" + (
            f" (fp8 peak {100 * rec['mfu_fp8']:.2f}%)" if rec.get("mfu_fp8") is not None
            else ""))
    parts.append(f"ETA {fmt_duration(eta)}")
    return " | ".join(parts)


class Eta:
    """Remaining time from the mean of the recent step times."""

    def __init__(self, window: int = 20) -> None:
        self.window = window
        self.times: list[float] = []

    def add(self, step_time: float) -> None:
        self.times = [*self.times[-(self.window - 1):], step_time]

    def remaining(self, step: int, target: int) -> float | None:
        if not self.times:
            return None
        return max(0, target - step) * sum(self.times) / len(self.times)


class ProgressLine:
    """Progress outside notebooks: one line, rewritten in place on a terminal (at most
    ``rate`` times a second), or a new line every ``every`` seconds when piped to a log."""

    def __init__(self, target: int, *, stream: TextIO | None = None, rate: float = 4.0,
                 every: float = 10.0) -> None:
        self.target = target
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = 1.0 / rate if self.tty else every
        self.eta = Eta()
        self._last = 0.0
        self._pending: str | None = None

    def update(self, rec: dict[str, Any]) -> None:
        if rec.get("step_time"):
            self.eta.add(rec["step_time"])
        line = summary_line(rec, self.target, self.eta.remaining(rec["step"], self.target))
        now = time.monotonic()
        if now - self._last >= self.interval or rec["step"] >= self.target:
            self._write(line)
            self._last, self._pending = now, None
        else:
            self._pending = line

    def _write(self, line: str) -> None:
        if self.tty:
            self.stream.write("\r\x1b[2K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def event(self, kind: str, **fields: Any) -> None:
        """Shows the compile phase (``compiling``, then ``compile``) on its own line."""
        if kind == "compiling":
            self._write("compiling the train step (XLA)...")
        elif kind == "compile":
            attention = fields.get("attention") or ""
            impl, _, why = attention.partition(": ")
            dtype, _, dtype_why = (fields.get("dtype") or "").partition(": ")
            self._write(f"compiled in {fields.get('seconds') or 0.0:.1f} s"
                        + (f"; attention {impl} ({why})" if impl else "")
                        + (f"; dtype {dtype_why or dtype}" if dtype else ""))
        if self.tty and kind in ("compiling", "compile"):
            self.stream.write("\n")

    def finish(self, status: str, message: str | None = None) -> None:
        if self._pending:
            self._write(self._pending)
        if self.tty:
            self.stream.write("\n")
        if message:
            self.stream.write(message + "\n")
        self.stream.flush()
