"""Context parallelism: causal attention with the sequence sharded over a mesh axis.

When the active rules map the logical ``seq`` axis to mesh axes of size > 1 (the ``cp`` /
``fsdp_cp`` presets map it to ``context``), every device holds ``T / n`` positions of each
sequence. Everything in a transformer block is position-wise except attention, which
needs the keys and values of all earlier positions. ``GPTConfig.context_attention`` picks
how they reach each device, inside ``jax.shard_map`` over the mesh:

- ``"allgather"``: all-gather K and V along the sequence (every device then holds the
  whole sequence's K/V, ``2·B·T·K·H`` values per layer), attend the local queries to all
  of them with a causal mask on *global* positions. One collective, K/V memory O(T).
- ``"ring"``: ring attention (Liu et al. 2023, "Ring Attention with Blockwise
  Transformers"). K/V blocks travel around the ring with ``jax.lax.ppermute`` (a
  collective permute per block, issued before the block it overlaps); each device
  combines its queries' partial results with an online softmax (running log-sum-exp),
  and skips blocks entirely in the causal future (``lax.cond``). The backward pass
  (``jax.custom_vjp``) runs the ring again, passing dK/dV with their blocks and sending
  them home at the end, so no device ever holds more than two K/V blocks: K/V memory
  O(T / n).

``GPTConfig.context_zigzag`` balances causal work: with contiguous blocks device ``i``
attends to ``i + 1`` blocks (device ``n - 1`` does ``n`` times the work of device 0);
zig-zag cuts the sequence into ``2n`` chunks and gives device ``i`` chunks ``i`` and
``2n - 1 - i`` (the order of Brandon et al. 2023, "Striped attention" / Megatron-LM's CP),
so every device does the same work (:func:`blocks_per_device`). The model reorders its
residual stream once after the embedding and once before the output head
(:func:`to_model_order`, :func:`to_token_order`: two collective permutes of ``(B, T/n,
D)``), so logits, targets and the loss mask stay in token order; RoPE gets each row's
global position (:func:`positions`).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from workbench._validate import check_int
from workbench.models._config import CONTEXT_VARIANTS
from workbench._sharding.rules import Rules, active

__all__ = ["VARIANTS", "ContextLayout", "attend", "blocks_per_device", "check_layout",
           "check_sequence", "seq_axes",
           "layout", "local_attention", "positions", "to_model_order",
           "to_token_order", "zigzag_order"]

#: Values of ``GPTConfig.context_attention``.
VARIANTS: tuple[str, ...] = CONTEXT_VARIANTS

_NEG = float(np.finfo(np.float32).min)


@dataclasses.dataclass(frozen=True)
class ContextLayout:
    """How the active rules shard the sequence.

    Attributes:
        axes: mesh axes (size > 1) that the logical ``seq`` axis is sharded over.
        size: their product ``n`` (the context-parallel degree).
        rules: the active ``Rules``.
        mesh: the active mesh.
    """

    axes: tuple[str, ...]
    size: int
    rules: Any
    mesh: Any


def layout() -> ContextLayout | None:
    """The context-parallel layout of the active rules, or None (sequence not sharded,
    or no rules active)."""
    ctx = active()
    if ctx is None:
        return None
    rules, mesh = ctx
    axes = rules.axes("seq", mesh)
    if not axes:
        return None
    return ContextLayout(axes=axes, size=math.prod(mesh.shape[a] for a in axes),
                         rules=rules, mesh=mesh)


def check_sequence(seq: int, size: int, *, zigzag: bool = False,
                   axes: tuple[str, ...] | str = "context") -> None:
    """Raise unless ``size`` context shards (``2 * size`` zig-zag chunks) divide ``seq``.

    Raises:
        ValueError: naming the sequence length, the axis and a length that works.
    """
    parts = size * (2 if zigzag else 1)
    if size > 1 and seq % parts:
        what = f"2 x {size} = {parts} zig-zag chunks" if zigzag else f"{size} shards"
        ok = max(parts, seq - seq % parts)
        raise ValueError(
            f"sequence length {seq} is not divisible by the context axis {axes!r} of size "
            f"{size} ({what}); every device must hold an equal slice of the sequence. Use "
            f"seq={ok} or {ok + parts}, a context axis that divides {seq}"
            + (", or context_zigzag=False" if zigzag and seq % size == 0 else ""))


def seq_axes(rules: Any, mesh_shape: Mapping[str, int]) -> tuple[str, ...]:
    """Mesh axes (size != 1) that ``rules`` shard the logical ``seq`` axis over."""
    if "seq" not in rules:
        return ()
    return tuple(a for a in rules.mesh_axes("seq") if mesh_shape.get(a, 1) != 1)


def check_layout(seq: int, mesh_shape: Mapping[str, int], rules: Any, *,
                 zigzag: bool = False) -> None:
    """Raise before anything is traced when the context axes do not divide ``seq``.

    Args:
        seq: tokens per sequence.
        mesh_shape: mesh axis -> size (an axis of size -1, still to be inferred, is
            skipped).
        rules: a ``Rules``, or a preset name (resolved for the mesh's axis names; an
            unresolvable preset is left to the code that resolves it).
        zigzag: ``GPTConfig.context_zigzag`` (then ``2 x`` the context size must divide).
    """
    if isinstance(rules, str):
        try:
            rules = Rules.preset(rules, _Names(tuple(mesh_shape)))
        except ValueError:
            return
    axes = seq_axes(rules, mesh_shape)
    if not axes or any(int(mesh_shape[a]) < 1 for a in axes):
        return
    size = math.prod(int(mesh_shape[a]) for a in axes)
    check_sequence(seq, size, zigzag=zigzag, axes=axes[0] if len(axes) == 1 else axes)


@dataclasses.dataclass(frozen=True)
class _Names:
    axis_names: tuple[str, ...]


#: The most devices a context axis may have (a pod's worth; larger is a typo, not a mesh).
MAX_CONTEXT = 1 << 16


def zigzag_order(seq: int, size: int) -> np.ndarray:
    """The zig-zag permutation: row ``r`` of the model's order holds token ``order[r]``.

    The sequence is cut into ``2 * size`` chunks; shard ``i`` (rows ``i*T/n ..``) holds
    chunks ``i`` and ``2*size - 1 - i``.
    """
    seq = check_int(seq, "seq", maximum=1 << 24, where="zigzag_order: ",
                    fix="a sequence length in tokens")
    size = check_int(size, "size", maximum=MAX_CONTEXT, where="zigzag_order: ",
                     fix="the number of devices on the context axis")
    check_sequence(seq, size, zigzag=True)
    c = seq // (2 * size)
    chunks = [j for i in range(size) for j in (i, 2 * size - 1 - i)]
    return np.concatenate([np.arange(j * c, (j + 1) * c) for j in chunks]).astype(np.int32)


def _order(seq: int, size: int, zigzag: bool) -> np.ndarray:
    return zigzag_order(seq, size) if zigzag and size > 1 else np.arange(seq, dtype=np.int32)


def positions(seq: int, *, zigzag: bool = False) -> jax.Array:
    """Global position of each row of the residual stream (for RoPE), shape ``(seq,)``.

    ``arange(seq)``, or the zig-zag order when the active rules shard the sequence and
    ``zigzag`` is set (the model then holds its rows in that order).
    """
    lay = layout()
    return jnp.asarray(_order(seq, lay.size if lay else 1, zigzag and lay is not None))


def blocks_per_device(size: int, *, zigzag: bool) -> list[float]:
    """Score blocks each device computes in ring attention, in units of one
    ``(T/n) x (T/n)`` block (the causal critical path is the largest entry).

    Contiguous: device ``i`` computes its masked diagonal block and the ``i`` earlier
    blocks, skipping the rest: ``i + 1``. Zig-zag: the masked diagonal block of its chunk
    pair, then half a block (two chunk x chunk products) per other step:
    ``1 + (n - 1) / 2`` on every device.
    """
    size = check_int(size, "size", maximum=MAX_CONTEXT, where="blocks_per_device: ",
                     fix="the number of devices on the context axis")
    if not isinstance(zigzag, bool):
        raise TypeError(f"blocks_per_device: zigzag={zigzag!r} must be True or False")
    if not zigzag:
        return [float(i + 1) for i in range(size)]
    return [1.0 + (size - 1) / 2 for _ in range(size)]


# -- reordering the residual stream --------------------------------------------------------

def _spec(*dims: tuple[str, ...]) -> PartitionSpec:
    return PartitionSpec(*(None if not d else d[0] if len(d) == 1 else d for d in dims))


def _axes(lay: ContextLayout, logical: str) -> tuple[str, ...]:
    return tuple(a for a in lay.rules.axes(logical, lay.mesh) if a not in lay.axes)


def _reorder(x: jax.Array, *, to_zigzag: bool) -> jax.Array:
    lay = layout()
    if lay is None:
        return x
    n = lay.size
    check_sequence(x.shape[1], n, zigzag=True, axes=lay.axes)
    batch = _axes(lay, "batch")
    if x.shape[0] % math.prod(lay.mesh.shape[a] for a in batch):
        batch = ()
    spec = _spec(batch, lay.axes, *([()] * (x.ndim - 2)))

    def even_odd_dest(chunk: int) -> int:   # device of ``chunk`` in the zig-zag layout
        return chunk if chunk < n else 2 * n - 1 - chunk

    def body(xl: jax.Array) -> jax.Array:
        e = jax.lax.axis_index(lay.axes)
        h0, h1 = jnp.split(xl, 2, axis=1)
        if to_zigzag:   # device d holds chunks 2d (h0) and 2d + 1 (h1)
            r0 = jax.lax.ppermute(h0, lay.axes, [(d, even_odd_dest(2 * d)) for d in range(n)])
            r1 = jax.lax.ppermute(h1, lay.axes,
                                  [(d, even_odd_dest(2 * d + 1)) for d in range(n)])
            # device e receives chunk e (slot 0) and 2n-1-e (slot 1); chunk e has e's parity
            even = e % 2 == 0
            return jnp.where(even, jnp.concatenate([r0, r1], 1), jnp.concatenate([r1, r0], 1))
        # zig-zag -> contiguous: device e holds chunk e (h0) and 2n-1-e (h1)
        even = e % 2 == 0
        ev, od = jnp.where(even, h0, h1), jnp.where(even, h1, h0)   # its even / odd chunk
        even_src = [e_ if e_ % 2 == 0 else 2 * n - 1 - e_ for e_ in range(n)]
        odd_src = [2 * n - 1 - e_ if e_ % 2 == 0 else e_ for e_ in range(n)]
        r0 = jax.lax.ppermute(ev, lay.axes, [(d, even_src[d] // 2) for d in range(n)])
        r1 = jax.lax.ppermute(od, lay.axes, [(d, odd_src[d] // 2) for d in range(n)])
        return jnp.concatenate([r0, r1], 1)

    return jax.shard_map(body, mesh=lay.mesh, in_specs=spec, out_specs=spec,
                         check_vma=False)(x)


def to_model_order(x: jax.Array, *, zigzag: bool) -> jax.Array:
    """``(B, T, ...)`` in token order -> the model's row order (zig-zag under context
    parallelism with ``zigzag``; else ``x`` unchanged). Equals ``x[:, zigzag_order(T, n)]``."""
    return _reorder(x, to_zigzag=True) if zigzag else x


def to_token_order(x: jax.Array, *, zigzag: bool) -> jax.Array:
    """Inverse of :func:`to_model_order`."""
    return _reorder(x, to_zigzag=False) if zigzag else x


# -- attention ------------------------------------------------------------------------------

def attend(q: jax.Array, k: jax.Array, v: jax.Array, *, variant: str = "allgather",
           zigzag: bool = False) -> jax.Array | None:
    """Causal GQA attention with the sequence sharded over the active context axes.

    Args:
        q: (B, T, N, H) queries after RoPE (rows in the model's order).
        k, v: (B, T, K, H).
        variant: "allgather" or "ring" (module docstring).
        zigzag: the rows are in :func:`zigzag_order` (the model reordered them).

    Returns:
        (B, T, N, H), or None when the active rules do not shard the sequence (the caller
        then runs ordinary attention).

    Raises:
        ValueError: an unknown variant, or a sequence the context axes do not divide.
    """
    if variant not in VARIANTS:
        raise ValueError(f"context_attention={variant!r}; choose one of {VARIANTS}")
    lay = layout()
    if lay is None:
        return None
    b, t, n_heads, _ = q.shape
    check_sequence(t, lay.size, zigzag=zigzag, axes=lay.axes)
    size = lambda axes: math.prod(lay.mesh.shape[a] for a in axes)
    batch = _axes(lay, "batch")
    if b % size(batch):
        batch = ()
    heads, kv_heads = _axes(lay, "heads"), _axes(lay, "kv_heads")
    if heads != kv_heads or set(heads) & set(batch) or n_heads % size(heads) \
            or k.shape[2] % size(heads):
        heads = ()
    q_spec = _spec(batch, lay.axes, heads, ())
    fn = functools.partial(local_attention, variant=variant, axes=lay.axes, size=lay.size,
                           zigzag=zigzag)
    return jax.shard_map(fn, mesh=lay.mesh, in_specs=(q_spec, q_spec, q_spec),
                         out_specs=q_spec, check_vma=False)(q, k, v)


def local_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, variant: str,
                    axes: tuple[str, ...] | str, size: int, zigzag: bool) -> jax.Array:
    """The per-device body of :func:`attend` (call inside ``shard_map`` over ``axes``).

    Args:
        q: (B, T/n, N, H) this device's queries; k, v: (B, T/n, K, H).
        variant: "allgather" or "ring".
        axes: the mesh axis name(s) the sequence is sharded over; ``size`` their product.
        zigzag: shards hold zig-zag chunk pairs instead of contiguous blocks.
    """
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    if variant == "allgather":
        return _allgather_local(q, k, v, axes=axes, size=size, zigzag=zigzag)
    b, tl, n, h = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, tl, kh, n // kh, h)
    out = _ring(qg, k, v, axes, size, zigzag)
    return out.reshape(b, tl, n, h)


def _local_positions(tl: int, size: int, zigzag: bool, index: jax.Array) -> jax.Array:
    """Global positions of the ``tl`` rows of shard ``index``."""
    if not zigzag:
        return index * tl + jnp.arange(tl, dtype=jnp.int32)
    c = tl // 2
    ar = jnp.arange(c, dtype=jnp.int32)
    return jnp.concatenate([index * c + ar, (2 * size - 1 - index) * c + ar])


def _allgather_local(q: jax.Array, k: jax.Array, v: jax.Array, *, axes: tuple[str, ...],
                     size: int, zigzag: bool) -> jax.Array:
    tl = q.shape[1]
    kg = jax.lax.all_gather(k, axes, axis=1, tiled=True)    # (B, T, K, H)
    vg = jax.lax.all_gather(v, axes, axis=1, tiled=True)
    i = jax.lax.axis_index(axes)
    q_pos = _local_positions(tl, size, zigzag, i)
    k_pos = jnp.asarray(_order(tl * size, size, zigzag))
    mask = q_pos[:, None] >= k_pos[None, :]                  # (T/n, T) causal on global pos
    return jax.nn.dot_product_attention(q, kg, vg, mask=mask[None, None],
                                        implementation="xla")


# -- ring attention: blocks, forward, backward ----------------------------------------------
# Local shapes: q (B, Tq, K, G, H) with G = N / K query heads per kv head; k, v (B, Tk, K, H);
# o like q (float32 while accumulating); lse (B, K, G, Tq) float32.

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
    pos = _local_positions(tl, size, zigzag, i)
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
def _ring(q: jax.Array, k: jax.Array, v: jax.Array, axes: tuple[str, ...], size: int,
          zigzag: bool) -> jax.Array:
    o, _ = _ring_forward(q, k, v, axes, size, zigzag)
    return o.astype(q.dtype)


def _ring_fwd(q, k, v, axes, size, zigzag):  # noqa: ANN001, ANN202 - custom_vjp rule
    o, lse = _ring_forward(q, k, v, axes, size, zigzag)
    o = o.astype(q.dtype)
    return o, (q, k, v, o, lse)


def _ring_bwd(axes, size, zigzag, res, do):  # noqa: ANN001, ANN202 - custom_vjp rule
    q, k, v, o, lse = res
    return _ring_backward(q, k, v, o, lse, do, axes, size, zigzag)


_ring.defvjp(_ring_fwd, _ring_bwd)
