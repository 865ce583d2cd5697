"""A predicted step (``Prediction``): its time, MFU, throughput, what bounds it, the
breakdown term by term with each collective timed, where every number comes from, and
how sure it is; with its JSON form (``to_dict`` / ``from_dict``, what run.json and a
plan's report store) and its text. ``perf._predict``'s roofline makes one."""
from __future__ import annotations

import dataclasses
from typing import Any

from workbench.perf._band import Band
from workbench.perf._collective_time import CollectiveTime

__all__ = ["Prediction", "mfu_text"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prediction:
    """A predicted step: time, MFU, throughput, what bounds it, and why.

    Attributes:
      step_seconds: predicted time of one step.
      mfu: model FLOPs / (step x devices x peak); None without model FLOPs. The peak is
        the chip's bf16 (dense) one, also for a step with fp8 matmuls.
      mfu_fp8: model FLOPs / (step x devices x the chip's fp8 peak), for a step with fp8
        matmuls (``StepCost.fp8_flops``) on a chip whose table has an fp8 peak: the
        other convention (MaxText's Ironwood fp8 rows quote TFLOP/s against the bf16
        peak, fp8 datasheets against the fp8 one); None otherwise.
      tokens_per_s: tokens per step / step time; None without tokens.
      bound: "compute", "memory" or "communication": the largest term.
      breakdown: seconds per term: "compute", "memory", "communication" (after overlap),
        "communication_total" (before), "host_transfers" (the offloaded activations'
        host-link time not hidden behind compute; 0 without offload), "host_link" (the
        host link's busy time per step), "no_overlap_step" (upper bound), the bytes per
        step "host_bytes_to_host" and "host_bytes_to_device", and "collectives": a
        tuple of ``CollectiveTime``.
      sources: where each number comes from, by name ("flops", "bytes", "peak_flops",
        "hbm_bandwidth", "overlap", "mfu", "compiler_seconds").
      compiler_seconds: the TPU compiler's own estimate (``optimal_seconds`` of its cost
        analysis) where the plan was TPU-compiled, shown beside ours; else None (also when
        the compiler's number is negative: its "unknown").
      implausible: why the prediction breaks a physical bound
        (``workbench.perf._bounds``: below its own roofline, MFU above the published
        envelope, ...); empty when it holds. ``wb.search`` never ranks such a plan.
      band: how sure it is (``workbench.perf._band.Band``): the factors of the step time
        the measured step has been seen in, from the calibration's residuals or the
        reference rows of the chip's generation, or why there is no band; None only in a
        prediction made without one.
    """

    step_seconds: float
    mfu: float | None
    tokens_per_s: float | None
    bound: str
    breakdown: dict[str, Any]
    sources: dict[str, str]
    compiler_seconds: float | None = None
    implausible: tuple[str, ...] = ()
    band: Band | None = None
    mfu_fp8: float | None = None

    def mfu_text(self) -> str:
        """``"MFU 41.2%"``, or with fp8 matmuls ``"MFU 41.2% of the bf16 peak, 20.6% of the
        fp8 peak"``; "" without MFU."""
        return mfu_text(self.mfu, self.mfu_fp8)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (run.json, the plan widget, the lab dashboard)."""
        b = self.breakdown
        return {"step_seconds": self.step_seconds, "mfu": self.mfu, "mfu_fp8": self.mfu_fp8,
                "tokens_per_s": self.tokens_per_s, "bound": self.bound,
                "compiler_seconds": self.compiler_seconds, "sources": dict(self.sources),
                "implausible": list(self.implausible),
                "band": self.band.to_dict() if self.band is not None else None,
                "breakdown": {k: v for k, v in b.items() if k != "collectives"}
                | {"collectives": [dataclasses.asdict(c) | {"axes": list(c.axes),
                                                           "parts": [dict(p) for p in c.parts]}
                                   for c in b["collectives"]]}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Prediction:
        """The prediction of ``to_dict()``'s data (after a JSON round trip): equal to the
        one written.

        Raises:
          ValueError: ``d`` is not a prediction's ``to_dict()``.
        """
        try:
            b = dict(d["breakdown"])
            b["collectives"] = tuple(CollectiveTime(**c | {
                "axes": tuple(c["axes"]), "parts": tuple(dict(p) for p in c["parts"])})
                for c in b["collectives"])
            band = None if d["band"] is None else Band(
                **{k: v for k, v in d["band"].items() if k not in ("summary", "rows")},
                rows=tuple(dict(r) for r in d["band"]["rows"]))
            return cls(step_seconds=d["step_seconds"], mfu=d["mfu"], mfu_fp8=d["mfu_fp8"],
                       tokens_per_s=d["tokens_per_s"], bound=d["bound"], breakdown=b,
                       sources=dict(d["sources"]), compiler_seconds=d["compiler_seconds"],
                       implausible=tuple(d["implausible"]), band=band)
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"Prediction.from_dict: not a prediction's to_dict() "
                             f"({type(e).__name__}: {e}); write one with "
                             "prediction.to_dict()") from None

    def __str__(self) -> str:
        b = self.breakdown
        lines = [f"predicted step {self.step_seconds * 1e3:.3g} ms ({self.bound}-bound)"
                 + (f", {self.mfu_text()}" if self.mfu is not None else "")
                 + (f", {self.tokens_per_s:,.0f} tokens/s" if self.tokens_per_s else ""),
                 *([f"  {self.band.describe(self.step_seconds)}"]
                   if self.band is not None else []),
                 f"  compute {b['compute'] * 1e3:.3g} ms, HBM {b['memory'] * 1e3:.3g} ms, "
                 f"communication {b['communication_total'] * 1e3:.3g} ms "
                 f"({b['communication'] * 1e3:.3g} ms not overlapped)"]
        if b.get("host_link"):
            lines.append(f"  host transfers {b['host_transfers'] * 1e3:.3g} ms not hidden, of "
                         f"{b['host_link'] * 1e3:.3g} ms on the host link "
                         f"({b['host_bytes_to_host'] / 1e9:.3g} GB to host, "
                         f"{b['host_bytes_to_device'] / 1e9:.3g} GB back)")
        if b.get("roofline_local") is not None and b["local"] != b["roofline_local"]:
            lines.insert(1, f"  local work {b['local'] * 1e3:.3g} ms by the compiler's "
                            f"estimates (roofline {b['roofline_local'] * 1e3:.3g} ms)")
        lines += [f"  {c.kind} over {','.join(c.axes) or '-'} x{c.count}: {c.seconds * 1e3:.3g}"
                  f" ms at {c.bandwidth / 1e9:.3g} GB/s ({c.links})" for c in b["collectives"]]
        if self.compiler_seconds is not None:
            lines.append(f"  TPU compiler's estimate: {self.compiler_seconds * 1e3:.3g} ms")
        lines += [f"  IMPLAUSIBLE: {why}" for why in self.implausible]
        return "\n".join(lines)


def mfu_text(mfu: float | None, mfu_fp8: float | None) -> str:
    """MFU as the views write it: against the bf16 peak, and the fp8 peak beside it when
    the step has fp8 matmuls (``Prediction.mfu_fp8``, the run's ``mfu_fp8``)."""
    if mfu is None:
        return ""
    if mfu_fp8 is None:
        return f"MFU {mfu:.1%}"
    return f"MFU {mfu:.1%} of the bf16 peak, {mfu_fp8:.1%} of the fp8 peak"
