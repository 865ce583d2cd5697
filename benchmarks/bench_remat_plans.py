"""Custom remat, counted by the TPU compiler (issue 57, item 4): MaxText's Ironwood
Llama-3.1-70B step (``bench_reference``'s tpu7x-128 row: 4 x 8192 tokens per chip, fsdp over
128 TensorCores) planned under named and custom policies, each compiled by the TPU compiler
for tpu7x:4x4x4.

Per policy: the compiled memory per TensorCore beside the formula's, what it moves to host
memory per chip per step (read from the HLO) and the time of it the compute does not hide,
and the predicted step. ``python -m benchmarks bench_remat_plans`` (a 70B compile is ~3 min of
one core here; the plan cache keeps them).
"""
from __future__ import annotations

import time
from typing import Any

from benchmarks.bench_reference import REFERENCES, TPU7X_REMAT, host_bytes, plan_reference
from workbench.models._remat import remat_label

IRONWOOD = next(r for r in REFERENCES if r.hardware.startswith("tpu7x"))
GIB = 2**30

#: The recipe's custom policy, named policies around it, and custom ones that offload.
POLICIES: tuple[Any, ...] = (
    TPU7X_REMAT,
    "full",
    "save_qkv_proj",
    {"save": ["query_proj", "key_proj", "value_proj", "context"],
     "offload": ["decoder_layer_input"]},
    {"save": ["context"], "offload": ["decoder_layer_input", "query_proj", "key_proj",
                                      "value_proj"]},
)


def _row(remat: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    p = plan_reference(IRONWOOD, remat=remat, progress=False)
    seconds = time.perf_counter() - t0
    pred, b = p.predicted, p.predicted.breakdown
    est = p.report.memory_estimate or {}
    formula = est.get("total")
    to_host = b.get("host_bytes_to_host", 0.0)       # one TensorCore's (2 per chip)
    by_formula = host_bytes(IRONWOOD, remat) / 2        # the formula counts a chip's
    label = remat_label(remat)
    return {"name": f"remat {label}: Llama-3.1-70B tpu7x-128 memory per TensorCore",
            "value": round(p.memory["total"] / GIB, 2), "unit": "GiB",
            "target": f"<= {p.memory['limit'] / GIB:.0f} GiB (fits)", "ok": bool(p.fits),
            "notes": (f"{p.source}; formula {formula / GIB:.1f} GiB" if formula else p.source)
            + f" (compiled/formula {p.memory['total'] / formula:.2f}x)" * bool(formula)
            + f"; temp {p.memory['temp'] / GIB:.1f} GiB; to host {to_host / 1e9:.1f} GB per "
            f"TensorCore per step read from the HLO (formula {by_formula / 1e9:.1f} GB), the "
            f"chip's link busy {b.get('host_link', 0.0):.2f} s (its 2 cores' bytes), "
            f"{b.get('host_transfers', 0.0):.2f} s of it not hidden; predicted "
            f"{pred.step_seconds:.2f} s/step, {pred.tokens_per_s / IRONWOOD.chips:,.0f} "
            f"tokens/s/chip; plan {seconds:.0f} s"}


def run() -> list[dict[str, Any]]:
    return [_row(remat) for remat in POLICIES]


if __name__ == "__main__":
    for r in run():
        print(r)
