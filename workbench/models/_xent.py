"""Token cross-entropy over the vocabulary logits, without float32 copies of the logits.

``optax.softmax_cross_entropy_with_integer_labels(logits.astype(float32), targets)`` is
the reference, and :func:`token_cross_entropy` equals it (values and gradients) to float32
rounding. It differs in what the compiled step moves through memory. On an H200 the
reference's backward for the ``small`` preset (32 x 1024 tokens, 50,304 words) wrote the
``(B, T, V)`` float32 softmax, scatter-added the one-hot of the targets into it (the
transpose of ``take_along_axis``) and converted it to bf16: three float32 passes over a
6.6 GB tensor, besides the forward's. A third of that step was such memory-bound fusions
(benchmarks/gpu_runs/2026-11-28-h200-a-*).

Here the forward reads the logits in their own dtype and keeps only the ``(B, T)``
log-normaliser; the backward is one elementwise pass, ``(softmax - onehot) * g`` from the
saved logits, written in the logits' dtype. The one-hot is a comparison with an iota, not
a gather or a scatter, so a vocabulary sharded over a mesh axis stays sharded (the sums
become partial sums and one all-reduce of ``(B, T)``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _hits(targets: jax.Array, vocab: int) -> jax.Array:
    """``(..., V)`` booleans: position ``v`` is the target word."""
    return jax.lax.broadcasted_iota(jnp.int32, (*targets.shape, vocab), targets.ndim) == \
        targets[..., None]


def _forward(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    lf = logits.astype(jnp.float32)                                   # fused into the reads
    lse = jax.nn.logsumexp(lf, axis=-1)                               # (..., )
    target = jnp.sum(jnp.where(_hits(targets, logits.shape[-1]), lf, 0.0), axis=-1)
    return lse - target, lse


@jax.custom_vjp
def token_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Per-token cross-entropy ``(...,)`` float32 of ``logits (..., V)`` (any float dtype)
    against integer ``targets (...,)``: ``logsumexp(logits) - logits[target]``.

    Equal to optax's ``softmax_cross_entropy_with_integer_labels`` of the float32 logits;
    the gradient has the logits' dtype. A target outside ``[0, V)`` picks no word: its loss
    is the log-normaliser (callers mask such positions).
    """
    return _forward(logits, targets)[0]


def _fwd(logits: jax.Array, targets: jax.Array
         ) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    loss, lse = _forward(logits, targets)
    return loss, (logits, lse, targets)


def _bwd(residuals: tuple[jax.Array, jax.Array, jax.Array], g: jax.Array
         ) -> tuple[jax.Array, None]:
    logits, lse, targets = residuals
    p = jnp.exp(logits.astype(jnp.float32) - lse[..., None])          # softmax
    d = (p - _hits(targets, logits.shape[-1]).astype(jnp.float32)) * g[..., None]
    return d.astype(logits.dtype), None


token_cross_entropy.defvjp(_fwd, _bwd)
