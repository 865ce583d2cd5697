"""Physical bounds every prediction is checked against: what no step can beat, and the
sanity envelope above which a prediction is a modelling fault, not a fast layout.

* **Below the roofline.** One step cannot take less than its own FLOPs at the chip's peak
  FLOP/s, nor less than its own HBM bytes at the HBM bandwidth (``max(compute, memory)``
  of the same FLOPs and bytes the prediction used).
* **Above the best published MFU.** Large-model training runs report model FLOPs
  utilisation well below peak: PaLM 540B 46.2% (57.8% with rematerialisation FLOPs,
  Chowdhery et al. 2022, table 3), Megatron-LM 1T 52% of peak on 3072 A100s (Narayanan et
  al. 2021, table 1). ``MFU_CEILING`` leaves a margin above the best of them; a prediction
  above it claims more than any published run and is flagged.
* **Far above its own roofline.** Local work timed by the compiler's cycle estimates at
  more than ``LOCAL_CEILING`` times the roofline of its FLOPs and bytes is an estimate the
  compiler could not make (e.g. an instruction marked unknown), not a slow program.
* Non-finite or non-positive step times, negative compiler estimates.
"""
from __future__ import annotations

import math

__all__ = ["LOCAL_CEILING", "MFU_CEILING", "implausible"]

#: The sanity envelope on predicted MFU (see the module docstring for the sources).
MFU_CEILING = 0.80
#: Compiler-timed local work at most this many times its own roofline.
LOCAL_CEILING = 1000.0


def implausible(*, step: float, roofline: float, local: float, mfu: float | None,
                compiler_local: bool) -> tuple[str, ...]:
    """Why a prediction breaks a physical bound (empty when it holds).

    Args:
      step: predicted seconds per step.
      roofline: ``max(FLOPs / peak, bytes / HBM bandwidth)`` of the step's own FLOPs and
        bytes (on CPU their sum), in seconds.
      local: the local work the prediction used (the roofline, or the compiler's cycles).
      mfu: predicted model FLOPs utilisation, or None.
      compiler_local: ``local`` comes from the compiler's cycle estimates.
    """
    if not math.isfinite(step) or step <= 0:
        return (f"step time {step!r} s is not a positive finite number",)
    out = []
    if step < roofline * (1 - 1e-9):
        out.append(f"step {step:.4g} s is below the roofline of its own FLOPs and bytes "
                   f"({roofline:.4g} s): faster than the chip's peak")
    if mfu is not None and mfu > MFU_CEILING:
        out.append(f"MFU {mfu:.0%} is above {MFU_CEILING:.0%}, more than any published "
                   "large-model training run reaches (workbench.perf._bounds)")
    if compiler_local and roofline > 0 and local > LOCAL_CEILING * roofline:
        out.append(f"the compiler's cycle estimates put local work at {local:.4g} s, "
                   f"{local / roofline:.3g}x the roofline of its FLOPs and bytes "
                   f"({roofline:.4g} s): an estimate the compiler could not make")
    return tuple(out)
