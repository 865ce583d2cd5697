"""Grouped matmuls of a mixture-of-experts group (``moe_matmul="grouped"``): routed rows only.

The ``k*G`` assignments of a group are sorted by expert and each projection is one grouped
matmul over exactly those rows (MaxText's megablox ``sparse_matmul``, torchtitan's grouped
GEMM), dropless with no padding: on TPU megablox's Pallas ``gmm``, whose weight gradient is
its own transposed kernel ``tgmm`` over the routed rows, elsewhere ``jax.lax.ragged_dot``
(:func:`workbench.models._moe_choice.grouped_kernel`). Under expert parallelism the
all-to-all dispatch carries fixed per-peer blocks of ``G*min(k, E/n)`` rows
(:func:`group_grouped` says why); the all-gather dispatch gathers as the dense one does,
and both combine through :func:`workbench.models._moe_dense.combine`.

Shape letters as in :mod:`workbench.models._moe`: D d_model, E experts (E' on one device),
F expert d_ff, k experts per token, G tokens of one group.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from workbench.models._config import GPTConfig, current_platform
from workbench.models._moe_choice import grouped_kernel
from workbench.models._moe_dense import combine, gather_rows

def _count(expert: jax.Array, n_experts: int) -> jax.Array:
    """int32 (n_experts,) occurrences of each expert in ``expert`` (ids >= n_experts: none)."""
    return jnp.zeros((n_experts,), jnp.int32).at[expert].add(1, mode="drop")


def _inverse(order: jax.Array) -> jax.Array:
    """The inverse of the permutation ``order``: ``_inverse(o)[o[i]] == i``."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


#: megablox tiles: rows of one tile (m, rounded up to a multiple of 128 below it) and the
#: widest contracting/output tile (k and n): MaxText's ``tile_batch_seq`` 512 and
#: ``tile_embed_dim`` / ``tile_mlp_dim`` 1024 (configs/base.yml).
GMM_TILE_ROWS, GMM_TILE = 512, 1024


def _megablox(rows: jax.Array, w: jax.Array, sizes: jax.Array, interpret: bool
              ) -> jax.Array:
    """megablox's ``gmm`` of ``rows`` (M, K) sorted by group and ``w`` (E', K, N):
    (M, N), rows past ``sum(sizes)`` zero.

    The rows are padded to whole tiles and the rows past the groups are given to one more
    group that ``w`` has no weights for, so the kernel zeroes them in the output and in
    the gradients (it leaves rows outside every group uninitialized) and ``tgmm`` never
    visits them."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    m, k = rows.shape
    n = w.shape[2]
    tm = min(GMM_TILE_ROWS, -(-m // 128) * 128)
    pad = -m % tm
    rows = jnp.pad(rows, ((0, pad), (0, 0)))                                # (Mp, K)
    rest = (m + pad - jnp.sum(sizes)).astype(jnp.int32)
    groups = jnp.concatenate([sizes.astype(jnp.int32), rest[None]])         # (E'+1,)
    t = min(GMM_TILE, k, n)   # square: the input gradient runs the transposed problem
    out = gmm(rows, w, groups, preferred_element_type=rows.dtype, tiling=(tm, t, t),
              interpret=interpret)
    return out[:m]


def _grouped_experts(rows: jax.Array, sizes: jax.Array, gate: jax.Array, up: jax.Array,
                     down: jax.Array, dtype: str, kernel: str) -> jax.Array:
    """SwiGLU of each expert on its rows: rows (M, D) sorted by expert, ``sizes`` (E',)
    rows per expert (rows past their sum are in no group and come out zero) -> (M, D),
    with ``kernel`` ("ragged_dot" or "megablox": :func:`grouped_kernel`).

    The remat policies "dots"/"minimal" save neither these nor the dense path's
    per-expert einsums (only batch-free ``dot_general``s); the checkpoint names are the
    same."""
    if kernel == "megablox":
        interpret = current_platform() != "tpu"
        rd = lambda a, w: _megablox(a, w.astype(dtype), sizes, interpret)
    else:
        rd = lambda a, w: jax.lax.ragged_dot(a, w.astype(dtype), sizes)
    g = checkpoint_name(rd(rows, gate), "mlpwi_0")                          # (M, F)
    u = checkpoint_name(rd(rows, up), "mlpwi_1")                            # (M, F)
    return checkpoint_name(rd(jax.nn.silu(g) * u, down), "mlpwo")           # (M, D)


def _by_local_expert(recv: jax.Array, counts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The rows received from each peer (n, S, D), each peer's sorted by local expert with
    ``counts`` (n, E') of them per expert, in expert-major order: ``(order, sizes)``, int
    (n*S,) the received row at each position (peers in order within an expert, the empty
    rows last) and (E',) rows per local expert."""
    n, s, _ = recv.shape
    ends = jnp.cumsum(counts, axis=1)                                        # (n, E')
    local = jnp.sum(jnp.arange(s)[None, :, None] >= ends[:, None, :], -1)   # (n, S); E': empty
    return jnp.argsort(local.reshape(-1), stable=True), jnp.sum(counts, axis=0)


def _from_peers(x: jax.Array, order: jax.Array, counts: jax.Array, n: int, s: int,
                ea: tuple[str, ...]) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The all-to-all of :func:`group_grouped` over ``ea``: each of the ``n`` peers is sent
    an ``(s, D)`` block of the rows of ``x`` (G, D) routed to its experts (``order``: the
    k*G assignments sorted by expert, ``counts`` (E,) of them per expert), then zero rows.

    Returns:
        ``(rows, sizes, rorder, start)``: the ``n*s`` received rows in local-expert order,
        (E',) rows per local expert, the received row at each position of ``rows``, and
        (n,) the rank in ``order`` of the first assignment sent to each peer.
    """
    g, e_local = x.shape[0], counts.shape[0] // n
    per_peer = jnp.sum(counts.reshape(n, e_local), axis=1)                     # (n,)
    start = jnp.cumsum(per_peer) - per_peer
    rank = start[:, None] + jnp.arange(s)[None]                                # (n, S)
    ok = jnp.arange(s)[None] < per_peer[:, None]
    token = jnp.where(ok, order[jnp.minimum(rank, order.shape[0] - 1)] % g, g)
    send = gather_rows(x, token.reshape(-1)).reshape(n, s, -1)                 # (n, S, D)
    recv = jax.lax.all_to_all(send, ea, 0, 0, tiled=True)                      # (n, S, D)
    got = jax.lax.all_to_all(counts.reshape(n, e_local), ea, 0, 0, tiled=True)
    rorder, sizes = _by_local_expert(recv, got)
    return recv.reshape(n * s, -1)[rorder], sizes, rorder, start


def group_grouped(cfg: GPTConfig, x: jax.Array, idx: jax.Array, w: jax.Array,
                   gate: jax.Array, up: jax.Array, down: jax.Array,
                   ea: tuple[str, ...], mlp: tuple[str, ...]
                   ) -> tuple[jax.Array, jax.Array]:
    """One group (G tokens) through the experts with grouped matmuls (the all-to-all
    dispatch over ``ea`` when non-empty).

    The k*G assignments are sorted by expert. Without an expert axis they are the rows of
    the ragged matmuls. With one (n devices, E' = E/n experts each) every peer gets a
    fixed ``(S, D)`` block, ``S = G * min(k, E')`` (a token sends at most ``min(k, E')``
    of its choices to one peer: the most a peer can be owed, so nothing is dropped),
    holding the rows routed to its experts, sorted, then zero rows; an all-to-all of the
    ``(n, E')`` counts tells each receiver where its experts' rows end. The receiver
    puts the ``n*S`` rows in expert order and runs the ragged matmuls on the routed ones;
    the outputs return by the inverse all-to-all. What the exchange carries is therefore
    ``n*S = n*G*min(k, E')`` rows, of which ``k*G`` are routed (XLA's all-to-all has
    static shapes; ``jax.lax.ragged_all_to_all`` would carry only those, but XLA:CPU does
    not implement it): ``E*G`` rows with ``moe_matmul="dense"``, so the same when
    ``k >= E'`` and ``k/E'`` of it otherwise.
    """
    g, k = idx.shape
    e_local = gate.shape[0]
    n = cfg.n_experts // e_local
    flat = idx.T.reshape(-1)                                  # (kG,) choice-major
    order = jnp.argsort(flat, stable=True)                    # assignments by expert
    counts = _count(flat, cfg.n_experts)                      # (E,)
    if ea:
        s = g * min(k, e_local)
        rows, sizes, rorder, start = _from_peers(x, order, counts, n, s, ea)   # (nS, D)
    else:
        rows, sizes = x[order % g], counts                                     # (kG, D)
    out = _grouped_experts(rows, sizes, gate, up, down, cfg.dtype, grouped_kernel(cfg))
    if mlp:
        out = jax.lax.psum(out, mlp)
    if ea:
        out = out[_inverse(rorder)].reshape(n, s, -1)
        out = jax.lax.all_to_all(out, ea, 0, 0, tiled=True).reshape(n * s, -1)  # (nS, D)
        peer = flat // e_local                                                 # (kG,)
        slot = peer * s + _inverse(order) - start[peer]
    else:
        slot = _inverse(order)
    y = combine(out, slot, jnp.ones(flat.shape, bool), w, cfg.dtype)
    return y, jnp.zeros((), jnp.float32)


def group_grouped_all_gather(cfg: GPTConfig, x: jax.Array, idx: jax.Array, w: jax.Array,
                              gate: jax.Array, up: jax.Array, down: jax.Array,
                              ea: tuple[str, ...], mlp: tuple[str, ...]
                              ) -> tuple[jax.Array, jax.Array]:
    """One group through grouped matmuls with the all-gather dispatch (``ea`` non-empty):
    the gathered ``n*G`` tokens' assignments to this device's experts, sorted, at most
    ``n*G*min(k, E')`` rows (the gather and reduce-scatter are the dense path's)."""
    e_local = gate.shape[0]
    xs = jax.lax.all_gather(x, ea, axis=0, tiled=True)                      # (nG, D)
    ids = jax.lax.all_gather(idx, ea, axis=0, tiled=True)                   # (nG, k)
    ws = jax.lax.all_gather(w, ea, axis=0, tiled=True)
    ng, k = ids.shape
    local = ids - jax.lax.axis_index(ea) * e_local
    mine = ((local >= 0) & (local < e_local)).T.reshape(-1)                 # (k*nG,)
    flat = jnp.where(mine, local.T.reshape(-1), e_local)
    order = jnp.argsort(flat, stable=True)                    # this device's first
    m = ng * min(k, e_local)
    rows = xs[order[:m] % ng]                                                # (m, D)
    out = _grouped_experts(rows, _count(flat, e_local), gate, up, down, cfg.dtype,
                           grouped_kernel(cfg))
    if mlp:
        out = jax.lax.psum(out, mlp)
    slot = jnp.where(mine, _inverse(order), m)
    ys = combine(out, slot, mine, ws, cfg.dtype)                           # (nG, D)
    y = jax.lax.psum_scatter(ys, ea, scatter_dimension=0, tiled=True)       # (G, D)
    return y, jnp.zeros((), jnp.float32)

