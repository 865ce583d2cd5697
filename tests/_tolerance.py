"""Float comparisons whose tolerance follows from float32 arithmetic, not from one CPU.

Two float32 computations of the same sum in a different order (sharded vs unsharded,
pipelined vs not, scanned vs unrolled) differ by rounding that scales with the *terms*
of each sum, not with the result: an element that nearly cancels (a gradient of 2.7e-4
summed from contributions of 1e-2) may differ by many of its own ulps. So each element is
allowed ``rtol`` of its own value plus ``rtol`` of the tensor's largest magnitude (the
scale of the terms that were summed). With float32's eps = 1.19e-7, rtol = 1e-5 admits
~80 eps of reordering error at the tensor's scale: reductions of a few hundred terms, as
in these tests, stay well inside it (the error of a sum of n terms grows ~sqrt(n) eps for
random rounding), while a wrong result (a missing micro-batch, a dropped term) is off by
a large fraction of the tensor's scale.

Scalars (a loss: the mean of n per-token cross-entropies of ~ln V) are compared relative to
their own value, which is their scale: the terms are positive (no cancellation), so one
reordered forward errs by a few eps of the loss: rtol 1e-6 (8 eps); a loss after k training steps also carries the parameters' reordered
updates, compounding per step, so rtol 1e-5 (80 eps) for a few steps. Adam is where this
stops: it divides each gradient by its own RMS, so a near-zero gradient whose last bits
differ moves its parameter by up to lr either way, and losses after several Adam steps at
lr 1e-2 may differ by ~1e-4 (a test comparing those says so and why its bound is larger).
A wrong computation (a lost micro-batch, a skipped layer) moves the first step's loss by
far more than any of these bounds.
"""
from __future__ import annotations

import jax
import numpy as np


def assert_close_at_scale(got, want, *, rtol: float = 1e-5, err_msg: str = "") -> None:
    """``|got - want| <= rtol * |want| + rtol * max|want|`` elementwise."""
    got, want = np.asarray(got), np.asarray(want)
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale, err_msg=err_msg)


def assert_trees_close_at_scale(got, want, *, rtol: float = 1e-5) -> None:
    """:func:`assert_close_at_scale` for every leaf of two pytrees of the same structure."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for path, (a, b) in zip(
            (jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(want)),
            zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True), strict=True):
        assert_close_at_scale(a, b, rtol=rtol, err_msg=path)
