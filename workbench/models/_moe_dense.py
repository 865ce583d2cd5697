"""Capacity-based dispatch of a mixture-of-experts group (``moe_matmul="dense"``).

Each expert runs on a fixed ``(capacity, D)`` buffer of slots, empty ones included:
:func:`route` queues a group's assignments per expert (GShard's priority) and drops those
past the capacity (:func:`workbench.models._moe_choice.capacity`); the buffer is filled,
the experts run as einsums over it, and :func:`combine` sums each token's weighted
outputs. :func:`group_all_to_all` and :func:`group_all_gather` run one group with either
dispatch (:mod:`workbench.models._moe` says when each is used); the grouped matmuls there
read their rows and combine their outputs with the same :func:`gather_rows` and
:func:`combine`.

Shape letters as in :mod:`workbench.models._moe`: D d_model, E experts, k experts per
token, G tokens of one group, C capacity (slots per expert and group).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from workbench.models._config import GPTConfig
from workbench.models._moe_choice import capacity


def route(idx: jax.Array, n_experts: int, cap: int, valid: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Slots of one group's assignments.

    Assignments are queued per expert in choice-major order (every token's first choice
    before any second choice, tokens in order: GShard's priority), and those past
    ``cap`` are dropped.

    Args:
        idx: int (G, k) expert of each token's choices (values >= ``n_experts`` or
            ``valid`` False: not for these experts).
        n_experts: experts of the buffer.
        cap: slots per expert.
        valid: optional bool (G, k).

    Returns:
        ``(slot, keep, slot_token)``: int (k*G,) buffer row of each assignment
        (choice-major; ``n_experts*cap`` when dropped), bool (k*G,) kept, and int
        (n_experts*cap,) the token of each buffer row (``G``: empty).
    """
    g, k = idx.shape
    flat = idx.T.reshape(-1)                                                # (kG,)
    ok = flat < n_experts
    if valid is not None:
        ok = ok & valid.T.reshape(-1)
    onehot = jax.nn.one_hot(jnp.where(ok, flat, n_experts), n_experts, dtype=jnp.int32)
    pos = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)      # (kG,)
    keep = ok & (pos < cap)
    slot = jnp.where(keep, flat * cap + pos, n_experts * cap)
    token = jnp.tile(jnp.arange(g, dtype=jnp.int32), k)
    slot_token = jnp.full((n_experts * cap,), g, jnp.int32).at[slot].set(token, mode="drop")
    return slot, keep, slot_token


def gather_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """``x[index]`` with index ``len(x)`` reading a zero row."""
    return jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[index]


def _experts(buf: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
             dtype: str) -> jax.Array:
    """SwiGLU of each expert on its slots: (E', C', D) -> (E', C', D)."""
    g = checkpoint_name(jnp.einsum("ecd,edf->ecf", buf, gate.astype(dtype)), "mlpwi_0")
    u = checkpoint_name(jnp.einsum("ecd,edf->ecf", buf, up.astype(dtype)), "mlpwi_1")
    out = jnp.einsum("ecf,efd->ecd", jax.nn.silu(g) * u, down.astype(dtype))
    return checkpoint_name(out, "mlpwo")   # the remat policies' names (config.CHECKPOINT_NAMES)


def combine(out: jax.Array, slot: jax.Array, keep: jax.Array, weights: jax.Array,
             dtype: str) -> jax.Array:
    """Each token's weighted sum over its kept choices: out (rows, D), slot/keep (k*G,),
    weights (G, k) -> (G, D)."""
    g, k = weights.shape
    picked = gather_rows(out, slot).reshape(k, g, -1).astype(jnp.float32)        # (k, G, D)
    w = weights.T.astype(jnp.float32) * keep.reshape(k, g)                 # (k, G)
    return jnp.einsum("kgd,kg->gd", picked, w).astype(dtype)


def group_all_to_all(cfg: GPTConfig, x: jax.Array, idx: jax.Array, w: jax.Array,
                      gate: jax.Array, up: jax.Array, down: jax.Array,
                      ea: tuple[str, ...], mlp: tuple[str, ...]
                      ) -> tuple[jax.Array, jax.Array]:
    """One group (G tokens) through the experts with the all-to-all dispatch."""
    e, g = cfg.n_experts, x.shape[0]
    cap = capacity(cfg, g)
    slot, keep, slot_token = route(idx, e, cap)
    buf = gather_rows(x, slot_token).reshape(e, cap, -1)                          # (E, C, D)
    if ea:
        buf = jax.lax.all_to_all(buf, ea, 0, 1, tiled=True)                 # (E/n, n*C, D)
    out = _experts(buf, gate, up, down, cfg.dtype)
    if mlp:
        out = jax.lax.psum(out, mlp)
    if ea:
        out = jax.lax.all_to_all(out, ea, 1, 0, tiled=True)                 # (E, C, D)
    y = combine(out.reshape(e * cap, -1), slot, keep, w, cfg.dtype)
    return y, jnp.sum(~keep).astype(jnp.float32)


def group_all_gather(cfg: GPTConfig, x: jax.Array, idx: jax.Array, w: jax.Array,
                      gate: jax.Array, up: jax.Array, down: jax.Array,
                      ea: tuple[str, ...], mlp: tuple[str, ...]
                      ) -> tuple[jax.Array, jax.Array]:
    """One group through the experts with the all-gather dispatch (``ea`` non-empty)."""
    n = jax.lax.psum(1, ea)
    e_local = gate.shape[0]
    xs = jax.lax.all_gather(x, ea, axis=0, tiled=True)                      # (nG, D)
    ids = jax.lax.all_gather(idx, ea, axis=0, tiled=True)                   # (nG, k)
    ws = jax.lax.all_gather(w, ea, axis=0, tiled=True)
    local = ids - jax.lax.axis_index(ea) * e_local
    mine = (local >= 0) & (local < e_local)
    cap = capacity(cfg, xs.shape[0])
    slot, keep, slot_token = route(jnp.where(mine, local, e_local), e_local, cap, mine)
    buf = gather_rows(xs, slot_token).reshape(e_local, cap, -1)                   # (E/n, C, D)
    out = _experts(buf, gate, up, down, cfg.dtype)
    if mlp:
        out = jax.lax.psum(out, mlp)
    ys = combine(out.reshape(e_local * cap, -1), slot, keep, ws, cfg.dtype)  # (nG, D)
    y = jax.lax.psum_scatter(ys, ea, scatter_dimension=0, tiled=True)       # (G, D)
    dropped = jnp.sum(mine.T.reshape(-1) & ~keep).astype(jnp.float32)
    return y, jax.lax.psum(dropped, ea) / n

