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
dropless and "dense" with a capacity factor), one module each: "dense"
(:mod:`workbench.models._moe_dense`) runs each expert on its fixed ``(capacity, D)``
buffer of slots, empty ones included (dropless: ``E/k`` times the routed rows); "grouped"
(:mod:`workbench.models._moe_grouped`) sorts the ``k*G`` assignments by expert and runs
one grouped matmul per projection over exactly those rows, dropless with no padding
(megablox's ``gmm`` on TPU, ``jax.lax.ragged_dot`` elsewhere: ``GPTConfig.moe_kernel``).
A group of more than :data:`~workbench.models._moe_choice.GROUPED_CHUNK_ROWS` routed rows
whose experts the block's remat recomputes runs them over equal slices of its tokens, one
at a time (:func:`in_chunks`): the backward then holds one slice's ``(k*G/c, F)`` tensors.
This module holds the layer and :func:`dispatch_combine`, which runs one of the four
per-group functions (two dispatches by two matmuls) on every group; each layer returns its
router statistics beside its output (:mod:`workbench.models._moe_stats`), and what the
config and rules decide before tracing (expert axes, capacity, kernel, slices) is
:mod:`workbench.models._moe_choice`.

Shape letters: B batch, T sequence, D d_model, E experts, F expert d_ff, k experts per
token, G tokens of one group, C capacity (slots per expert and group).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from workbench.models._config import DEFAULT_TOP_K, MOE_DISPATCH, GPTConfig
from workbench.models._layers import MLP, fan_in_init, param
from workbench.models._moe_choice import check_layout, expert_axes, expert_chunks, grouped_kernel
from workbench.models._moe_dense import group_all_gather, group_all_to_all
from workbench.models._moe_grouped import group_grouped, group_grouped_all_gather
from workbench.models._moe_stats import router_loss, router_stats
from workbench._sharding.rules import active, constrain

#: Token dispatch implementations accepted by ``GPTConfig.moe_dispatch``.
DISPATCH: tuple[str, ...] = MOE_DISPATCH


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
        (:data:`~workbench.models._moe_stats.STAT_KEYS`: ``router_stats``, ``router_loss``
        and ``dropped``)."""
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
        return group_grouped_all_gather if gather else group_grouped
    return group_all_gather if gather else group_all_to_all


# -- chunks of a group (dropless grouped experts under remat) ----------------------------------

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
