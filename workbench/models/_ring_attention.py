"""Ring attention's per-device part: K/V blocks passed around the context axes, forward and
backward (:func:`ring`, a ``jax.custom_vjp``), for :func:`workbench.models._context.attend`.

Each device holds ``T / n`` rows of the sequence. The forward pass attends its queries to
its own block (causally masked), then to each block received with ``jax.lax.ppermute``,
combining the partial results with an online softmax (running log-sum-exp) and skipping
blocks in the causal future (``lax.cond``). The backward pass runs the ring again from
the saved log-sum-exp, passing dK/dV with their blocks and sending them home at the end,
so no device holds more than two K/V blocks. With zig-zag rows (each device holds chunks
``i`` and ``2n - 1 - i``) a block is half visible instead (:func:`local_positions`).

Local shapes: q (B, Tq, K, G, H) with G = N / K query heads per kv head; k, v (B, Tk, K,
H); o like q (float32 while accumulating); lse (B, K, G, Tq) float32.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

_NEG = float(np.finfo(np.float32).min)


def local_positions(tl: int, size: int, zigzag: bool, index: jax.Array) -> jax.Array:
    """Global positions of the ``tl`` rows of shard ``index``."""
    if not zigzag:
        return index * tl + jnp.arange(tl, dtype=jnp.int32)
    c = tl // 2
    ar = jnp.arange(c, dtype=jnp.int32)
    return jnp.concatenate([index * c + ar, (2 * size - 1 - index) * c + ar])


def _scores(q: jax.Array, k: jax.Array, mask: jax.Array | None) -> jax.Array:
    s = jnp.einsum("bqkgh,bskh->bkgqs", q, k, preferred_element_type=jnp.float32)
    s = s * (q.shape[-1] ** -0.5)
    return s if mask is None else jnp.where(mask, s, _NEG)


def _block_fwd(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None
               ) -> tuple[jax.Array, jax.Array]:
    """Softmax attention of ``q`` over one K/V block: normalized output and log-sum-exp."""
    s = _scores(q, k, mask)                                        # (B, K, G, Tq, Tk)
    m = jnp.max(s, axis=-1)
    p = jnp.exp(s - m[..., None])
    denom = jnp.sum(p, axis=-1)                                    # (B, K, G, Tq)
    o = jnp.einsum("bkgqs,bskh->bqkgh", p.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
    o = o / jnp.moveaxis(denom, -1, 1)[..., None]
    return o, m + jnp.log(denom)


def _merge(o: jax.Array, lse: jax.Array, o_b: jax.Array, lse_b: jax.Array
           ) -> tuple[jax.Array, jax.Array]:
    """Online-softmax combine of two partial results over disjoint key sets."""
    new = jnp.logaddexp(lse, lse_b)
    w, w_b = jnp.exp(lse - new), jnp.exp(lse_b - new)              # (B, K, G, Tq)
    t = lambda a: jnp.moveaxis(a, -1, 1)[..., None]                # -> (B, Tq, K, G, 1)
    return o * t(w) + o_b * t(w_b), new


def _block_bwd(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None,
               lse: jax.Array, do: jax.Array, delta: jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients of one block given the final ``lse`` and ``delta = sum(do * o, -1)``."""
    s = _scores(q, k, mask)
    p = jnp.exp(s - lse[..., None])                                # (B, K, G, Tq, Tk)
    f32 = jnp.float32
    dv = jnp.einsum("bkgqs,bqkgh->bskh", p, do.astype(f32))
    dp = jnp.einsum("bqkgh,bskh->bkgqs", do, v, preferred_element_type=f32)
    ds = p * (dp - delta[..., None]) * (q.shape[-1] ** -0.5)
    dq = jnp.einsum("bkgqs,bskh->bqkgh", ds, k.astype(f32))
    dk = jnp.einsum("bkgqs,bqkgh->bskh", ds, q.astype(f32))
    return dq, dk, dv


def _diag_mask(tl: int, size: int, zigzag: bool, i: jax.Array) -> jax.Array:
    pos = local_positions(tl, size, zigzag, i)
    return pos[:, None] >= pos[None, :]


def _ring_perm(size: int) -> list[tuple[int, int]]:
    return [(j, (j + 1) % size) for j in range(size)]


def _ring_forward(q: jax.Array, k: jax.Array, v: jax.Array, axes: tuple[str, ...],
                  size: int, zigzag: bool) -> tuple[jax.Array, jax.Array]:
    tl = q.shape[1]
    c = tl // 2
    i = jax.lax.axis_index(axes)
    perm = _ring_perm(size)
    o, lse = _block_fwd(q, k, v, _diag_mask(tl, size, zigzag, i))   # own block first
    kv = (k, v)
    for s in range(1, size):
        kv = tuple(jax.lax.ppermute(x, axes, perm) for x in kv)      # from device i - s
        kb, vb = kv
        if zigzag:
            def earlier(o, lse, kb=kb, vb=vb):   # source chunks (j, 2n-1-j), j < i
                return _merge(o, lse, *_block_fwd(q, kb[:, :c], vb[:, :c], None))

            def later(o, lse, kb=kb, vb=vb):     # j > i: only our second chunk sees them
                o2, l2 = _merge(o[:, c:], lse[..., c:], *_block_fwd(q[:, c:], kb, vb, None))
                return (jnp.concatenate([o[:, :c], o2], 1),
                        jnp.concatenate([lse[..., :c], l2], -1))
        else:
            def earlier(o, lse, kb=kb, vb=vb):   # source block i - s < i: all visible
                return _merge(o, lse, *_block_fwd(q, kb, vb, None))

            def later(o, lse):                   # causal future: skipped
                return o, lse
        o, lse = jax.lax.cond(i >= s, earlier, later, o, lse)
    return o, lse


def _ring_backward(q: jax.Array, k: jax.Array, v: jax.Array, o: jax.Array, lse: jax.Array,
                   do: jax.Array, axes: tuple[str, ...], size: int, zigzag: bool
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    tl = q.shape[1]
    c = tl // 2
    i = jax.lax.axis_index(axes)
    perm = _ring_perm(size)
    delta = jnp.moveaxis(jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), -1), 1, -1)
    dq, dk, dv = _block_bwd(q, k, v, _diag_mask(tl, size, zigzag, i), lse, do, delta)
    # K and V travel stacked as one array: separate permutes of K and V would be identical
    # to the forward ring's, and XLA would merge them and keep every received block alive
    # until the backward pass (K/V memory O(T) instead of two blocks).
    kv = jnp.stack([k, v])
    for s in range(1, size):
        kv, dk, dv = (jax.lax.ppermute(x, axes, perm) for x in (kv, dk, dv))
        kb, vb = kv[0], kv[1]
        if zigzag:
            def earlier(dq, dk, dv, kb=kb, vb=vb):
                g_q, g_k, g_v = _block_bwd(q, kb[:, :c], vb[:, :c], None, lse, do, delta)
                return (dq + g_q, dk.at[:, :c].add(g_k), dv.at[:, :c].add(g_v))

            def later(dq, dk, dv, kb=kb, vb=vb):
                g_q, g_k, g_v = _block_bwd(q[:, c:], kb, vb, None, lse[..., c:], do[:, c:],
                                           delta[..., c:])
                return dq.at[:, c:].add(g_q), dk + g_k, dv + g_v
        else:
            def earlier(dq, dk, dv, kb=kb, vb=vb):
                g_q, g_k, g_v = _block_bwd(q, kb, vb, None, lse, do, delta)
                return dq + g_q, dk + g_k, dv + g_v

            def later(dq, dk, dv):
                return dq, dk, dv
        dq, dk, dv = jax.lax.cond(i >= s, earlier, later, dq, dk, dv)
    if size > 1:   # dK/dV of block i + 1 are here: send them home
        dk, dv = (jax.lax.ppermute(x, axes, perm) for x in (dk, dv))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def ring(q: jax.Array, k: jax.Array, v: jax.Array, axes: tuple[str, ...], size: int,
          zigzag: bool) -> jax.Array:
    """Causal attention of this device's queries ``q`` (B, T/n, K, G, H) over the whole
    sequence's keys and values, ``k, v`` (B, T/n, K, H) on each of the ``size`` devices of
    ``axes`` (call inside ``shard_map`` over them); ``zigzag``: the rows are zig-zag chunk
    pairs. Returns (B, T/n, K, G, H) in q's dtype."""
    o, _ = _ring_forward(q, k, v, axes, size, zigzag)
    return o.astype(q.dtype)


def _ring_fwd(q, k, v, axes, size, zigzag):  # noqa: ANN001, ANN202 - custom_vjp rule
    o, lse = _ring_forward(q, k, v, axes, size, zigzag)
    o = o.astype(q.dtype)
    return o, (q, k, v, o, lse)


def _ring_bwd(axes, size, zigzag, res, do):  # noqa: ANN001, ANN202 - custom_vjp rule
    q, k, v, o, lse = res
    return _ring_backward(q, k, v, o, lse, do, axes, size, zigzag)


ring.defvjp(_ring_fwd, _ring_bwd)

