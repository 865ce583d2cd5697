"""Mixture-of-experts feed-forward with expert parallelism over an ``expert`` mesh axis.

A top-k router (float32 softmax, optional renormalisation of the k weights), SwiGLU experts
held as stacked ``(experts, ...)`` parameters, and capacity-based dispatch with fixed
shapes (``capacity_factor=None`` is dropless: each expert gets room for every token of
its group). Under active rules the layer runs in ``jax.shard_map`` over the whole mesh:
each device routes its own tokens (one *group*) and the experts dimension is split over
the mesh axes of the ``experts`` rule, with one of two dispatches
(``GPTConfig.moe_dispatch``):

- ``"all_to_all"``: every device fills an ``(experts, capacity, D)`` buffer from its
  tokens and an all-to-all over the expert axis hands each device the slots of its own
  experts from every peer, ``(experts / n, n * capacity, D)``; a second all-to-all returns
  the outputs (GShard, Lepikhin et al. 2020, section 2.2).
- ``"all_gather"``: every device all-gathers the tokens (and their routes) of its expert
  group, runs its own experts on those routed to them, and a reduce-scatter sums the
  partial outputs back to the tokens' devices; fewer, larger collectives that pay off on
  small meshes and short groups.

How the experts compute (``GPTConfig.moe_matmul``, "auto" resolving to "grouped" when
dropless and "dense" with a capacity factor): "dense" runs each expert on its fixed
``(capacity, D)`` buffer of slots, empty ones included (dropless: ``E/k`` times the routed
rows); "grouped" sorts the ``k*G`` assignments by expert and runs one
``jax.lax.ragged_dot`` per projection over exactly those rows (MaxText's megablox
``sparse_matmul``, torchtitan's grouped GEMM), dropless with no padding: on TPU megablox's
Pallas ``gmm``, whose weight gradient is its own transposed kernel ``tgmm`` over the routed
rows, elsewhere ``jax.lax.ragged_dot`` (``GPTConfig.moe_kernel``, :func:`grouped_kernel`).
A group of more than :data:`GROUPED_CHUNK_ROWS` routed rows whose experts the block's remat
recomputes runs them over equal slices of its tokens, one at a time (:func:`expert_chunks`):
the backward then holds one slice's ``(k*G/c, F)`` tensors. Under expert
parallelism its all-to-all carries fixed per-peer blocks of ``G*min(k, E/n)`` rows
(:func:`_group_grouped` says why); the all-gather dispatch gathers as the dense one does.

Each MoE layer returns its router statistics (load-balance loss, router z-loss, tokens
per expert, dropped assignments, router entropy) beside its output; the GPT passes them
out of its blocks, remat, scan and pipeline as values (``GPT.hidden_and_stats``), and the
train step (:func:`workbench._step.make_train_step`) adds ``router_loss`` to the loss and
reports the rest (:func:`summarize`). A pipeline runs each layer once per micro-batch;
:func:`merge_microbatches` turns those into the statistics of the whole batch (the
load-balance loss is a product of two token averages, so each layer also returns its mean
router probability per expert, ``router_prob``).

Shape letters: B batch, T sequence, D d_model, E experts, F expert d_ff, k experts per
token, G tokens of one group, C capacity (slots per expert and group).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from workbench.models._config import DEFAULT_TOP_K, MOE_DISPATCH, GPTConfig, current_platform
from workbench.models._layers import MLP, fan_in_init, param
from workbench.models._remat import resolve_remat
from workbench._sharding.rules import Rules, active, constrain

#: Token dispatch implementations accepted by ``GPTConfig.moe_dispatch``.
DISPATCH: tuple[str, ...] = MOE_DISPATCH

#: Per-layer statistics a MoE layer returns (each a scalar except ``tokens_per_expert`` and
#: ``router_prob``, both ``(E,)``).
STAT_KEYS: tuple[str, ...] = ("router_loss", "aux_loss", "z_loss", "tokens_per_expert",
                              "dropped", "entropy", "router_prob")


# -- statistics ----------------------------------------------------------------------

def summarize(stats: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Step metrics from per-layer statistics stacked over layers (``{}`` for a dense
    model: ``GPT.hidden_and_stats``).

    ``router_loss``: the mean over MoE layers of ``router_aux_loss * aux_loss +
    router_z_loss * z_loss`` (what the step adds to the loss); ``aux_loss``, ``z_loss``,
    ``entropy``: means over layers; ``dropped``: dropped (token, expert) assignments summed
    over layers; ``tokens_per_expert``: int32 ``(layers, E)`` assignments per expert
    before capacity (``router_prob`` is kept for :func:`merge_microbatches`, not
    reported).
    """
    s = stats
    if not s:
        return {}
    return {"router_loss": jnp.mean(s["router_loss"]), "aux_loss": jnp.mean(s["aux_loss"]),
            "z_loss": jnp.mean(s["z_loss"]), "entropy": jnp.mean(s["entropy"]),
            "dropped": jnp.sum(s["dropped"]),
            "tokens_per_expert": s["tokens_per_expert"].astype(jnp.int32)}


def merge_microbatches(stats: Mapping[str, jax.Array], cfg: GPTConfig) -> dict[str, jax.Array]:
    """The statistics of a batch from those of its ``M`` equal micro-batches.

    Args:
        stats: :data:`STAT_KEYS` with a leading micro-batch axis, ``(M, ...)``, each
            micro-batch as many tokens (a pipeline's micro-batches through the same layers).
        cfg: the MoE config (its router loss weights).

    Returns:
        The same keys without the micro-batch axis, as one run over the whole batch
        records them: per-token means (``z_loss``, ``entropy``, ``router_prob``) averaged,
        counts (``tokens_per_expert``, ``dropped``) summed, and ``aux_loss`` and
        ``router_loss`` recomputed from those (``aux_loss`` is not the mean of the
        micro-batches' ones). ``dropped`` equals the unpipelined count when dropless;
        with a capacity factor each micro-batch's groups have their own capacity.
    """
    counts = jnp.sum(stats["tokens_per_expert"], axis=0)
    out = {"tokens_per_expert": counts, "dropped": jnp.sum(stats["dropped"], axis=0),
           **{k: jnp.mean(stats[k], axis=0) for k in ("z_loss", "entropy", "router_prob")}}
    out["aux_loss"] = aux_loss(counts, out["router_prob"])
    out["router_loss"] = router_loss(cfg, out["aux_loss"], out["z_loss"])
    return out


# -- layout checks -----------------------------------------------------------------------

def expert_axes(rules: Rules) -> tuple[str, ...]:
    """Mesh axes the ``experts`` logical axis is sharded over (empty: unsharded)."""
    return rules.axes("experts")


def capacity(cfg: GPTConfig, group: int) -> int:
    """Slots per expert for a group of ``group`` tokens: the group itself when dropless
    (``capacity_factor=None``), else ``ceil(capacity_factor * group * k / E)`` (at most
    ``group``: a token picks an expert once)."""
    if cfg.capacity_factor is None:
        return group
    c = math.ceil(cfg.capacity_factor * group * cfg.experts_per_token / cfg.n_experts)
    return max(1, min(group, c))


def check_layout(cfg: GPTConfig, rules: Rules, mesh: Any) -> None:
    """Raise ``ValueError`` if ``rules`` on ``mesh`` cannot run ``cfg``'s experts (called
    before anything is compiled or written).

    Raises:
        ValueError: the experts are not divisible by their mesh axes, or the experts'
            hidden dim is sharded over a mesh axis that also shards the tokens.
    """
    if not cfg.n_experts:
        return
    shape = dict(mesh.shape)
    ea = tuple(a for a in expert_axes(rules) if a in shape)
    n = math.prod(shape[a] for a in ea)
    if cfg.n_experts % n:
        fits = [d for d in range(1, cfg.n_experts + 1) if cfg.n_experts % d == 0]
        raise ValueError(
            f"n_experts={cfg.n_experts} is not divisible by the expert mesh axes {ea} (size "
            f"{n}): each device must hold a whole number of experts. Use an expert axis "
            f"size in {fits}, or n_experts a multiple of {n}")
    tokens = set(rules.axes("batch")) | set(rules.axes("seq"))
    both = sorted(set(rules.axes("expert_mlp")) & tokens)
    if both:
        raise ValueError(
            f"expert_mlp is sharded over mesh axes {both}, which also shard the tokens "
            f"(batch/seq rules); the experts' hidden dim can only be split over an axis "
            f"whose devices hold the same tokens. Map expert_mlp to the model axis or None")


# -- the layer -----------------------------------------------------------------------------

class MoE(nnx.Module):
    """Top-k routed SwiGLU experts, plus optional always-on shared experts.

    Parameters: ``router`` (D, E) with logical axes ``("embed", None)`` (replicated over
    the expert axis: every device routes its own tokens); ``gate``/``up`` (E, D, F) and
    ``down`` (E, F, D) with ``("experts", "embed", "expert_mlp")``; ``shared`` a dense
    SwiGLU of width ``n_shared_experts * expert_d_ff`` (logical ``mlp``).
    """

    def __init__(self, cfg: GPTConfig, *, key: jax.Array) -> None:
        cfg = cfg.resolved()   # dtype "auto": for the platform built for
        d, e, f, pd = cfg.d_model, cfg.n_experts, cfg.moe_d_ff, cfg.param_dtype
        kr, kg, ku, kd, ks = jax.random.split(key, 5)
        self.router = param(kr, fan_in_init(d), (d, e), ("embed", None), pd)
        self.gate = param(kg, fan_in_init(d), (e, d, f), ("experts", "embed", "expert_mlp"), pd)
        self.up = param(ku, fan_in_init(d), (e, d, f), ("experts", "embed", "expert_mlp"), pd)
        self.down = param(kd, fan_in_init(f), (e, f, d), ("experts", "expert_mlp", "embed"), pd)
        self.shared = MLP(cfg.replace(d_ff=cfg.n_shared_experts * f, n_experts=0,
                                      experts_per_token=DEFAULT_TOP_K), key=ks) \
            if cfg.n_shared_experts else None
        self.shared_gate = param(ks, fan_in_init(d), (d, 1), ("embed", None), pd) \
            if cfg.n_shared_experts and cfg.shared_expert_gate else None   # Qwen-MoE
        self.cfg = cfg

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x`` (B, T, D) -> the output (B, T, D) (:meth:`with_stats` without them)."""
        return self.with_stats(x)[0]

    def with_stats(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """``x`` (B, T, D) -> the output (B, T, D) and this layer's router statistics
        (:data:`STAT_KEYS`: :func:`router_stats`, ``router_loss`` and ``dropped``)."""
        cfg = self.cfg
        k, e = cfg.experts_per_token, cfg.n_experts
        logits = jnp.einsum("btd,de->bte", x.astype(jnp.float32),
                            self.router[...].astype(jnp.float32))          # (B, T, E) f32
        logits = constrain(logits, ("batch", "seq", None), name="router_logits")
        probs = jax.nn.softmax(logits, axis=-1)
        weights, idx = jax.lax.top_k(probs, k)                              # (B, T, k)
        if cfg.router_norm_topk:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        stats = router_stats(logits, probs, idx, e)
        stats["router_loss"] = router_loss(cfg, stats["aux_loss"], stats["z_loss"])
        y, stats["dropped"] = dispatch_combine(
            cfg, x, idx, weights, self.gate[...], self.up[...], self.down[...])
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:   # sigmoid(x @ w) per token, (B, T, 1)
                shared = shared * jax.nn.sigmoid(
                    jnp.einsum("btd,do->bto", x, self.shared_gate[...].astype(x.dtype)))
            y = y + shared
        return y, stats


def router_stats(logits: jax.Array, probs: jax.Array, idx: jax.Array,
                 n_experts: int) -> dict[str, jax.Array]:
    """Load-balance statistics over all tokens (global: the same under any sharding).

    - ``aux_loss``: ``E * sum_e f_e * P_e`` with ``f_e`` the fraction of the ``B*T*k``
      assignments routed to expert ``e`` and ``P_e`` its mean router probability (Switch
      Transformer, Fedus et al. 2021, eq. 4, with k choices per token); 1.0 when balanced.
    - ``z_loss``: mean of ``logsumexp(logits)^2`` (ST-MoE, Zoph et al. 2022, eq. 5).
    - ``tokens_per_expert``: (E,) assignments per expert, before capacity.
    - ``entropy``: mean over tokens of the router distribution's entropy (nats; ``log E``
      is uniform, 0 is one expert).
    - ``router_prob``: (E,) ``P_e``, the mean router probability of each expert.
    """
    counts = jnp.sum(jax.nn.one_hot(idx, n_experts, dtype=jnp.float32), axis=(0, 1, 2))
    mean_prob = jnp.mean(probs, axis=(0, 1))
    z = jax.nn.logsumexp(logits, axis=-1)
    return {"aux_loss": aux_loss(counts, mean_prob), "z_loss": jnp.mean(z * z),
            "tokens_per_expert": counts, "router_prob": mean_prob,
            "entropy": jnp.mean(jnp.sum(jax.scipy.special.entr(probs), axis=-1))}


def aux_loss(counts: jax.Array, mean_prob: jax.Array) -> jax.Array:
    """Load-balance loss ``E * sum_e f_e * P_e`` of assignments ``counts`` (..., E) and mean
    router probabilities ``mean_prob`` (..., E) (:func:`router_stats`)."""
    frac = counts / jnp.maximum(jnp.sum(counts, axis=-1, keepdims=True), 1.0)
    return counts.shape[-1] * jnp.sum(frac * mean_prob, axis=-1)


def router_loss(cfg: GPTConfig, aux: jax.Array, z: jax.Array) -> jax.Array:
    """What a MoE layer adds to the loss: ``router_aux_loss * aux + router_z_loss * z``."""
    return cfg.router_aux_loss * aux + cfg.router_z_loss * z


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


def _rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """``x[index]`` with index ``len(x)`` reading a zero row."""
    return jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[index]


def _experts(buf: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
             dtype: str) -> jax.Array:
    """SwiGLU of each expert on its slots: (E', C', D) -> (E', C', D)."""
    g = checkpoint_name(jnp.einsum("ecd,edf->ecf", buf, gate.astype(dtype)), "mlpwi_0")
    u = checkpoint_name(jnp.einsum("ecd,edf->ecf", buf, up.astype(dtype)), "mlpwi_1")
    out = jnp.einsum("ecf,efd->ecd", jax.nn.silu(g) * u, down.astype(dtype))
    return checkpoint_name(out, "mlpwo")   # the remat policies' names (config.CHECKPOINT_NAMES)


def _combine(out: jax.Array, slot: jax.Array, keep: jax.Array, weights: jax.Array,
             dtype: str) -> jax.Array:
    """Each token's weighted sum over its kept choices: out (rows, D), slot/keep (k*G,),
    weights (G, k) -> (G, D)."""
    g, k = weights.shape
    picked = _rows(out, slot).reshape(k, g, -1).astype(jnp.float32)        # (k, G, D)
    w = weights.T.astype(jnp.float32) * keep.reshape(k, g)                 # (k, G)
    return jnp.einsum("kgd,kg->gd", picked, w).astype(dtype)


def _group_all_to_all(cfg: GPTConfig, x: jax.Array, idx: jax.Array, w: jax.Array,
                      gate: jax.Array, up: jax.Array, down: jax.Array,
                      ea: tuple[str, ...], mlp: tuple[str, ...]
                      ) -> tuple[jax.Array, jax.Array]:
    """One group (G tokens) through the experts with the all-to-all dispatch."""
    e, g = cfg.n_experts, x.shape[0]
    cap = capacity(cfg, g)
    slot, keep, slot_token = route(idx, e, cap)
    buf = _rows(x, slot_token).reshape(e, cap, -1)                          # (E, C, D)
    if ea:
        buf = jax.lax.all_to_all(buf, ea, 0, 1, tiled=True)                 # (E/n, n*C, D)
    out = _experts(buf, gate, up, down, cfg.dtype)
    if mlp:
        out = jax.lax.psum(out, mlp)
    if ea:
        out = jax.lax.all_to_all(out, ea, 1, 0, tiled=True)                 # (E, C, D)
    y = _combine(out.reshape(e * cap, -1), slot, keep, w, cfg.dtype)
    return y, jnp.sum(~keep).astype(jnp.float32)


def _group_all_gather(cfg: GPTConfig, x: jax.Array, idx: jax.Array, w: jax.Array,
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
    buf = _rows(xs, slot_token).reshape(e_local, cap, -1)                   # (E/n, C, D)
    out = _experts(buf, gate, up, down, cfg.dtype)
    if mlp:
        out = jax.lax.psum(out, mlp)
    ys = _combine(out.reshape(e_local * cap, -1), slot, keep, ws, cfg.dtype)  # (nG, D)
    y = jax.lax.psum_scatter(ys, ea, scatter_dimension=0, tiled=True)       # (G, D)
    dropped = jnp.sum(mine.T.reshape(-1) & ~keep).astype(jnp.float32)
    return y, jax.lax.psum(dropped, ea) / n


# -- grouped matmul (moe_matmul="grouped"): routed rows only, no padding, dropless ------------

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


def grouped_kernel(cfg: GPTConfig, platform: str | None = None) -> str:
    """The grouped matmul of ``cfg`` on ``platform`` (default: the one traced for,
    :func:`~workbench.models._config.current_platform`): ``cfg.moe_kernel``, "auto"
    resolving to "megablox" on TPU where d_model and the experts' width are multiples of
    128 (the kernel's lane tiles), and to "ragged_dot" elsewhere.

    On TPU, ``ragged_dot``'s weight gradient (ragged contracting dim) is expanded by XLA
    into a masked dense matmul over every expert, E times its routed FLOPs (libtpu
    0.0.42.1: "fall through to ragged_dot_expander"); megablox's ``tgmm`` computes it
    over the routed rows (docs/performance.md). On GPU and CPU ``ragged_dot`` is XLA's own
    grouped GEMM; megablox there runs in Pallas' interpret mode (tests only: slow)."""
    if cfg.moe_kernel != "auto":
        return cfg.moe_kernel
    if (platform or current_platform()) != "tpu":
        return "ragged_dot"
    # the kernel's blocks are whole (8, 128) tiles or whole dims: an expert of widths that
    # are not multiples of 128 (moe-tiny's 64) is left to ragged_dot
    lanes = all(n % 128 == 0 for n in (cfg.d_model, cfg.moe_d_ff))
    return "megablox" if lanes else "ragged_dot"


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


def _group_grouped(cfg: GPTConfig, x: jax.Array, idx: jax.Array, w: jax.Array,
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
        per_peer = jnp.sum(counts.reshape(n, e_local), axis=1)                 # (n,)
        start = jnp.cumsum(per_peer) - per_peer
        rank = start[:, None] + jnp.arange(s)[None]                            # (n, S)
        ok = jnp.arange(s)[None] < per_peer[:, None]
        token = jnp.where(ok, order[jnp.minimum(rank, k * g - 1)] % g, g)
        send = _rows(x, token.reshape(-1)).reshape(n, s, -1)                   # (n, S, D)
        recv = jax.lax.all_to_all(send, ea, 0, 0, tiled=True)                  # (n, S, D)
        got = jax.lax.all_to_all(counts.reshape(n, e_local), ea, 0, 0, tiled=True)
        rorder, sizes = _by_local_expert(recv, got)
        rows = recv.reshape(n * s, -1)[rorder]                                 # (nS, D)
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
    y = _combine(out, slot, jnp.ones(flat.shape, bool), w, cfg.dtype)
    return y, jnp.zeros((), jnp.float32)


def _group_grouped_all_gather(cfg: GPTConfig, x: jax.Array, idx: jax.Array, w: jax.Array,
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
    ys = _combine(out, slot, mine, ws, cfg.dtype)                           # (nG, D)
    y = jax.lax.psum_scatter(ys, ea, scatter_dimension=0, tiled=True)       # (G, D)
    return y, jnp.zeros((), jnp.float32)


def dispatch_combine(cfg: GPTConfig, x: jax.Array, idx: jax.Array, weights: jax.Array,
                     gate: jax.Array, up: jax.Array, down: jax.Array
                     ) -> tuple[jax.Array, jax.Array]:
    """Route ``x`` (B, T, D) to the experts and back.

    Without active rules the whole batch is one group. Under ``Rules.activate(mesh)`` it
    runs in ``jax.shard_map`` over every mesh axis: tokens split by the ``batch``/``seq``
    rules (each device's tokens are a group), experts by the ``experts`` rule, their
    hidden dim by ``expert_mlp`` (partial outputs summed with a psum).

    Returns:
        ``(y, dropped)``: (B, T, D) and the float32 number of dropped assignments.
    """
    cfg = cfg.resolved()   # dtype "auto": for the platform traced for
    b, t, d = x.shape
    k = idx.shape[-1]
    ctx = active()
    if ctx is None:
        run = in_chunks(_group_for(cfg, False), expert_chunks(cfg, b * t))
        y, dropped = run(cfg, x.reshape(-1, d), idx.reshape(-1, k), weights.reshape(-1, k),
                         gate, up, down, (), ())
        return y.reshape(b, t, d), dropped
    rules, mesh = ctx
    check_layout(cfg, rules, mesh)
    ea, mlp = expert_axes(rules), rules.axes("expert_mlp")
    batch, seq = rules.axes("batch"), rules.axes("seq")
    spec = lambda axes: None if not axes else axes[0] if len(axes) == 1 else axes
    tok = PartitionSpec(spec(batch), spec(seq), None)
    w_in = PartitionSpec(spec(ea), None, spec(mlp))
    w_out = PartitionSpec(spec(ea), spec(mlp), None)
    token_axes = tuple(a for a in mesh.axis_names if a in batch + seq)
    group = _group_for(cfg, bool(ea))

    def body(x, idx, w, gate, up, down):
        bl, tl, _ = x.shape
        run = in_chunks(group, expert_chunks(cfg, bl * tl))
        y, dropped = run(cfg, x.reshape(-1, d), idx.reshape(-1, k), w.reshape(-1, k),
                         gate, up, down, ea, mlp)
        return y.reshape(bl, tl, d), dropped[None]

    # megablox's pallas_calls give their outputs no varying mesh axes, which check_vma
    # needs; MaxText runs them with it off too (its transposes then psum and divide over
    # the unmentioned axes: the same gradients, tests/test_moe_gmm.py)
    megablox = cfg.moe_matmul_resolved == "grouped" and grouped_kernel(cfg) == "megablox"
    y, dropped = jax.shard_map(
        body, mesh=mesh, in_specs=(tok, tok, tok, w_in, w_in, w_out),
        out_specs=(tok, PartitionSpec(spec(token_axes))), check_vma=not megablox,
    )(x, idx, weights, gate, up, down)
    return y, jnp.sum(dropped)


def _group_for(cfg: GPTConfig, expert_parallel: bool) -> Any:
    """The per-group function of ``cfg``'s ``moe_matmul`` and ``moe_dispatch``."""
    gather = cfg.moe_dispatch == "all_gather" and expert_parallel
    if cfg.moe_matmul_resolved == "grouped":
        return _group_grouped_all_gather if gather else _group_grouped
    return _group_all_gather if gather else _group_all_to_all


# -- chunks of a group (dropless grouped experts under remat) ----------------------------------

#: The most routed rows (k * tokens) one pass of the grouped experts holds when the block's
#: remat recomputes them: a larger group runs in :func:`expert_chunks` slices.
GROUPED_CHUNK_ROWS = 65536

#: The checkpoint names of the expert projections (a remat policy that keeps or offloads one
#: of them keeps what chunks would recompute: such groups run whole).
_EXPERT_NAMES = ("mlpwi_0", "mlpwi_1", "mlpwo")


def expert_chunks(cfg: GPTConfig, group: int) -> int:
    """Slices of a ``group``-token group that the experts run one after another: 1 unless
    the experts are grouped (dropless), the block's remat recomputes them, and the
    ``k * group`` routed rows exceed :data:`GROUPED_CHUNK_ROWS`; then the fewest slices of
    equal size (a divisor of ``group``) with at most that many rows each, or 1 if no
    divisor up to 8 times the fewest needed has them (slices of a few tokens would pad
    every expert's rows to the kernel's tiles).

    Under remat the backward pass recomputes a whole layer, and a group's grouped experts
    hold several ``(k*G, F)`` tensors at once (gate, up, their product, its gradient):
    7.9 GiB each for Mixtral-8x7B at 147,456 tokens per chip. A token's output depends on
    its own routes only, so dropless slices compute exactly the whole group's outputs, and
    under :func:`in_chunks` the backward holds one slice's tensors at a time. (Dense
    experts with a capacity factor run whole: a slice would get its own capacity.)
    """
    p = resolve_remat(cfg.remat)
    recomputed = cfg.remat != "none" and not set(_EXPERT_NAMES) & set(p.saved + p.offloaded)
    rows = cfg.experts_per_token * group
    if cfg.moe_matmul_resolved != "grouped" or not recomputed or rows <= GROUPED_CHUNK_ROWS:
        return 1
    need = -(-rows // GROUPED_CHUNK_ROWS)
    return next((c for c in range(need, 8 * need + 1) if group % c == 0), 1)


def in_chunks(group_fn: Callable[..., tuple[jax.Array, jax.Array]], chunks: int
              ) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """``group_fn`` (a per-group function of :func:`_group_for`) over ``chunks`` equal
    slices of its tokens in a ``jax.lax.scan``, each slice under ``jax.checkpoint``: the
    forward keeps a slice's inputs only and the backward recomputes one slice at a time.
    The outputs are the slices' outputs in token order, ``dropped`` their sum; the weight
    gradients are summed over the slices by the scan's transpose."""
    if chunks == 1:
        return group_fn

    def run(cfg: GPTConfig, x: jax.Array, idx: jax.Array, w: jax.Array, gate: jax.Array,
            up: jax.Array, down: jax.Array, ea: tuple[str, ...], mlp: tuple[str, ...]
            ) -> tuple[jax.Array, jax.Array]:
        g = x.shape[0]
        split = lambda a: a.reshape(chunks, g // chunks, *a.shape[1:])     # (c, G/c, ...)

        @functools.partial(jax.checkpoint, prevent_cse=False)
        def one(xc: jax.Array, ic: jax.Array, wc: jax.Array) -> tuple[jax.Array, jax.Array]:
            return group_fn(cfg, xc, ic, wc, gate, up, down, ea, mlp)

        _, (ys, dropped) = jax.lax.scan(lambda c, a: (c, one(*a)), None,
                                        (split(x), split(idx), split(w)))
        return ys.reshape(g, -1), jnp.sum(dropped)                          # (G, D)

    return run
