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
  O(T / n) (:mod:`workbench.models._ring_attention`).

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
from workbench.models._ring_attention import local_positions, ring
from workbench._sharding.rules import Rules, active

__all__ = ["VARIANTS", "ContextLayout", "attend", "blocks_per_device", "check_layout",
           "check_sequence", "seq_axes",
           "layout", "local_attention", "positions", "to_model_order",
           "to_token_order", "zigzag_order"]

#: Values of ``GPTConfig.context_attention``.
VARIANTS: tuple[str, ...] = CONTEXT_VARIANTS


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
    out = ring(qg, k, v, axes, size, zigzag)
    return out.reshape(b, tl, n, h)


def _allgather_local(q: jax.Array, k: jax.Array, v: jax.Array, *, axes: tuple[str, ...],
                     size: int, zigzag: bool) -> jax.Array:
    tl = q.shape[1]
    kg = jax.lax.all_gather(k, axes, axis=1, tiled=True)    # (B, T, K, H)
    vg = jax.lax.all_gather(v, axes, axis=1, tiled=True)
    i = jax.lax.axis_index(axes)
    q_pos = local_positions(tl, size, zigzag, i)
    k_pos = jnp.asarray(_order(tl * size, size, zigzag))
    mask = q_pos[:, None] >= k_pos[None, :]                  # (T/n, T) causal on global pos
    return jax.nn.dot_product_attention(q, kg, vg, mask=mask[None, None],
                                        implementation="xla")
