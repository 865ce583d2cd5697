"""The formula's step refitted to the TPU compiler's: one factor on an uncompiled TPU plan
of a scanned model, from its layout, so that the formula ranks layouts as the compiled
predictions do (issue 59 item 3; the fit and its check: docs/predictions.md, "The
formula refitted to the compiler", and tests/test_formula_refit.py).

The roofline the formula times a step with leaves out what the TPU compiler's schedule
adds, and that depends on the layout: the compiled/formula step ratio of the 7B on
v5p-128 runs from 1.16x (fsdp_tp, model=2, remat=dots) to 2.3x (model=16), tp's
replicated gradients cost more than fsdp_tp's sharded ones, fsdp without a model axis
more than either. The refit models the log of that ratio as linear in the layout's
features (:data:`FEATURES`)::

    log(compiled / formula) = b0 + b_tp log2(TP degree) + b_rep [weights replicated over a
                              batch axis] + b_fsdp [FSDP, no TP axis]
                              + b_none [remat="none"] + b_full [remat="full"]

least squares over :data:`FIT_SET` (the 7B's exhaustive table at 4096 tokens, libtpu
0.0.42). It applies where it was fitted: GPT plans by formula on a TPU slice, layers
scanned (the presets above "small"), no pipeline stages; elsewhere the factor is 1
(toy and unrolled models on the TPU are per-op overheads, 5-25x their formula, which no
layout feature predicts).
"""
from __future__ import annotations

import math
from typing import Any

__all__ = ["COEFFICIENTS", "FEATURES", "FIT_SET", "RESIDUAL_SD", "features", "refit_factor"]

#: the features of the log-ratio model, in the order of :data:`COEFFICIENTS`
FEATURES = ("intercept", "log2_tp", "replicated", "fsdp_only", "remat_none", "remat_full")
#: least squares of log(compiled / formula step) on :data:`FEATURES` over the fit set
#: (tests/test_formula_refit.py recomputes them from the table)
COEFFICIENTS = (0.0411, 0.1572, 0.1767, 0.5587, 0.1014, -0.0286)
#: the residual standard deviation of that fit (log ratio, 12 degrees of freedom): a
#: compiled step lies within x/exp(RESIDUAL_SD) = 1.10 of its refitted formula step about
#: two times in three (fit set: -0.16 to +0.15; held out, LONG_7B and the reference rows:
#: -0.27 to +0.28). ``wb.search``'s stopping rule allows a compiled step at least that far
#: below its formula (``_search.ranking``); tests/test_formula_refit.py recomputes it
RESIDUAL_SD = 0.0972
#: what they were fitted on
FIT_SET = ("7b on v5p-128, batch 128 x 4096: the 18 compiled steps that fit of the "
           "exhaustive search (BENCHMARKS.md bench_search; tests/test_search_exact.py "
           "DENSE_7B), libtpu 0.0.42")


def features(report: Any) -> dict[str, float] | None:
    """The refit's features of ``report`` (a ``PlanReport``), or None where the refit does
    not apply (not a TPU slice, not a GPT config with scanned layers, pipelined).

    - ``log2_tp``: log2 of the product of the mesh axes that shard weights but split
      neither batch nor sequence (tensor parallelism; an expert axis does not count);
    - ``replicated``: 1 when some weight is replicated over a batch axis (its gradient
      is all-reduced: tp, dp);
    - ``fsdp_only``: 1 when weights are sharded over a batch axis (FSDP) and no axis is
      tensor-parallel;
    - ``remat_none``, ``remat_full``: the remat policy (dots and the named or custom
      policies that keep some tensors are the baseline, 0).
    """
    from workbench.perf._analytic import batch_axes, fsdp_axes, weight_axes

    cfg, mesh = report.cfg, report.mesh
    if cfg is None or mesh.platform != "tpu" or not getattr(cfg, "scan_layers", False) \
            or mesh.shape.get("stage", 1) > 1:
        return None
    params = {k: v for k, v in report.layouts.items() if k.startswith("params.")}
    bat = set(batch_axes(report.rules, mesh))
    experts = set(report.rules.axes("experts"))
    tp = math.prod(mesh.shape[a] for a in weight_axes(params)
                   if a not in bat and a not in experts and a in mesh.shape)
    sharded = [{a for axes in lay.spec for a in axes} for lay in params.values()]
    replicated = any(bat - s for s in sharded)
    fsdp = any(fsdp_axes(lay, bat) for lay in params.values())
    remat = cfg.remat if isinstance(cfg.remat, str) else ""
    return {"intercept": 1.0, "log2_tp": math.log2(tp), "replicated": float(replicated),
            "fsdp_only": float(fsdp and tp == 1), "remat_none": float(remat == "none"),
            "remat_full": float(remat == "full")}


def refit_factor(report: Any) -> float:
    """``compiled / formula`` step predicted for ``report``'s layout (1.0 where the refit
    does not apply: :func:`features`)."""
    f = features(report)
    if f is None:
        return 1.0
    return math.exp(sum(c * f[name] for name, c in zip(FEATURES, COEFFICIENTS)))

