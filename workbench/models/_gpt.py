"""A Llama-style decoder-only GPT in Flax NNX that names logical axes only.

Pre-norm blocks of the layers in :mod:`workbench.models._layers` (RMSNorm, RoPE,
grouped-query attention, SwiGLU MLP) or a mixture of experts (:mod:`workbench.models._moe`),
optional tied embeddings and per-block remat; the blocks run unrolled, in one
``lax.scan`` (``cfg.scan_layers``) or as pipeline stages (:mod:`workbench.models._pipeline`,
when the trace context names a pipeline). Every block returns its MoE router statistics
(``{}`` when dense) beside its output; remat, the scan and the pipeline pass them on as
values and :meth:`GPT.hidden_and_stats` returns them, stacked over layers.

Shape letters: B batch, T sequence, D d_model, N query heads, K kv heads, H head_dim,
F d_ff, V vocab.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from workbench._sharding import tracing
from workbench.models import _attention as attention_impl
from workbench.models import _context as context_parallel
from workbench.models import _moe as moe, _moe_stats as moe_stats
from workbench.models._config import GPTConfig
from workbench.models._remat import remat_policy
from workbench.models._layers import (
    MLP,
    Attention,
    KVCache,
    Normal,
    RMSNorm,
    Segments,
    check_layer_args,
    fan_in_init,
    param,
    rope,
)
from workbench.models._pipeline import run_pipeline
from workbench._sharding.rules import constrain

__all__ = ["GPT", "LAYERS_AXIS", "MLP", "Attention", "Block", "KVCache", "RMSNorm",
           "RouterStats", "rope", "stack_blocks", "unstack_blocks"]

#: MoE router statistics by name (:data:`workbench.models._moe_stats.STAT_KEYS`); ``{}`` for a
#: dense block or model.
RouterStats = dict[str, jax.Array]
#: A block applied to the residual stream: ``(block, x) -> (x, router statistics)``.
RunBlock = Callable[["Block", jax.Array], tuple[jax.Array, RouterStats]]

#: Logical name of the stacked blocks' leading axis (``cfg.scan_layers``).
LAYERS_AXIS = "layers"
_LAYERS_METADATA = {nnx.PARTITION_NAME: LAYERS_AXIS}


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: GPTConfig, *, key: jax.Array) -> None:
        check_layer_args(cfg, key, "Block")
        cfg = cfg.resolved()   # dtype "auto": for the platform built for
        norm = {"eps": cfg.norm_eps, "dtype": cfg.dtype, "param_dtype": cfg.param_dtype}
        k_attn, k_mlp = jax.random.split(key)
        self.attn_norm = RMSNorm(cfg.d_model, **norm)
        self.attn = Attention(cfg, key=k_attn)
        self.mlp_norm = RMSNorm(cfg.d_model, **norm)
        self.mlp = moe.MoE(cfg, key=k_mlp) if cfg.n_experts else MLP(cfg, key=k_mlp)

    def __call__(self, x: jax.Array, segments: Segments | None = None,
                 cache: KVCache | None = None) -> Any:
        """``x`` (B, T, D) -> the block's output (B, T, D) and its MoE router statistics
        (``{}`` for a dense MLP); ``segments``: packed rows' ``(segment_ids, positions)``.
        Decode mode: with ``cache`` (this layer's ``KVCache``, see :class:`Attention`) the
        updated cache comes third, ``(out, stats, cache)``."""
        x = checkpoint_name(x, "decoder_layer_input")
        if cache is None:
            x = x + self.attn(self.attn_norm(x), segments)
        else:
            a, cache = self.attn(self.attn_norm(x), segments, cache)
            x = x + a
        x = constrain(x, ("batch", "seq", None), name="residual")
        if isinstance(self.mlp, moe.MoE):
            y, stats = self.mlp.with_stats(self.mlp_norm(x))
        else:
            y, stats = self.mlp(self.mlp_norm(x)), {}
        x = x + y
        x = constrain(x, ("batch", "seq", None), name="residual")
        return (x, stats) if cache is None else (x, stats, cache)


class GPT(nnx.Module):
    """Decoder-only language model: int32 tokens (B, T) -> logits (B, T, vocab_size).

    Example:
        >>> model = GPT(GPTConfig.preset("tiny"), rngs=nnx.Rngs(0))
        >>> model(jnp.zeros((2, 16), jnp.int32)).shape
        (2, 16, 256)
    """

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs) -> None:
        if not isinstance(cfg, GPTConfig):
            raise TypeError(f"GPT: cfg={cfg!r} is a {type(cfg).__name__}; give a "
                            "wb.models.GPTConfig, e.g. GPTConfig.preset('tiny')")
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(f"GPT: rngs={rngs!r} is a {type(rngs).__name__}; give flax's "
                            "nnx.Rngs, e.g. rngs=nnx.Rngs(0)")
        # dtype "auto" made concrete for the platform built for (the active rules' mesh,
        # else JAX's default backend); the Trainer and wb.plan pass resolved configs
        self.cfg = cfg = cfg.resolved()
        pd = cfg.param_dtype
        keys = jax.random.split(rngs.params(), cfg.n_layers + 2)   # one draw from rngs
        self.embed = param(keys[0], Normal(0.02),
                           (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), pd)
        if cfg.scan_layers:   # one Block whose params stack the n_layers blocks' params
            self.blocks = _stacked_blocks(cfg, keys[2:])
        else:
            self.blocks = nnx.List([Block(cfg, key=keys[2 + i]) for i in range(cfg.n_layers)])
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=cfg.dtype,
                                  param_dtype=pd)
        self.lm_head = None if cfg.tie_embeddings else param(
            keys[1], fan_in_init(cfg.d_model), (cfg.d_model, cfg.vocab_size),
            ("embed", "vocab"), pd)

    def __call__(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None, cache: KVCache | None = None) -> Any:
        """Logits ``(B, T, vocab_size)`` of ``tokens`` (B, T) int32.

        Decode mode: with ``cache`` (:meth:`init_cache`) ``tokens`` are the ones at
        positions ``cache.pos..cache.pos+T`` and the result is ``(logits, cache)``
        (:meth:`decode_hidden`): the prompt in one call, then one token at a time, each
        position's logits those of the whole sequence's forward.
        """
        if cache is not None:
            if segment_ids is not None or positions is not None:
                raise ValueError("GPT: packed rows (segment_ids, positions) have no decode "
                                 "mode; give them or cache, not both")
            h, cache = self.decode_hidden(tokens, cache)
            return self.head(h), cache
        return self.head(self.hidden(tokens, segment_ids=segment_ids, positions=positions))

    def hidden(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
               positions: jax.Array | None = None) -> jax.Array:
        """The final-normed residual stream ``(B, T, d_model)`` the output projection reads
        (``model(tokens) == model.head(model.hidden(tokens))``).

        Packed rows (:mod:`workbench.data._packing`): ``segment_ids`` (B, T) int32 keeps
        attention inside each document (0 is padding) and ``positions`` (B, T), each
        token's position within its document, restarts RoPE per document; give both.
        """
        return self.hidden_and_stats(tokens, segment_ids=segment_ids, positions=positions)[0]

    def hidden_and_stats(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                         positions: jax.Array | None = None
                         ) -> tuple[jax.Array, RouterStats]:
        """:meth:`hidden` and the router statistics of the MoE layers, each stacked over
        layers in layer order (``tokens_per_expert`` ``(n_layers, n_experts)``; ``{}`` for
        a dense model): what the train step adds to the loss and reports
        (:func:`workbench.models._moe_stats.summarize`)."""
        cfg = self.cfg
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be (batch, seq) int32, got shape {tokens.shape}")
        segments = _segments(tokens, segment_ids, positions)
        x = self._embed(tokens)                                        # (B, T, D)
        x = context_parallel.to_model_order(x, zigzag=cfg.context_zigzag)  # CP zig-zag
        run_block: RunBlock = lambda blk, h: blk(h, segments)
        policy = remat_policy(cfg.remat, attention_impl.current_platform())
        if policy is not None:
            # jax.checkpoint: prevent_cse=False is safe inside a scan (the loop keeps XLA
            # from merging the recomputation into the forward) and spares the barriers.
            run_block = nnx.remat(run_block, policy=policy,
                                  prevent_cse=not cfg.scan_layers)
        ctx = tracing.current()
        if cfg.scan_layers and ctx.pipeline is not None:   # inside a pipelined step
            if segments is not None:
                raise ValueError("packed rows (segment_ids) are not supported with pipeline "
                                 "parallelism; train packed data without TrainConfig.pipeline")
            x, per_micro = run_pipeline(run_block, self.blocks, x, ctx.pipeline, ctx.stages)
            stats = moe_stats.merge_microbatches(per_micro, cfg) if per_micro else {}
        elif cfg.scan_layers:
            x, stats = _scan_blocks(run_block, self.blocks, x)
        else:
            per_layer = []
            for block in self.blocks:
                x, layer_stats = run_block(block, x)
                per_layer.append(layer_stats)
            stats = jax.tree.map(lambda *v: jnp.stack(v), *per_layer) if per_layer[0] else {}
        x = context_parallel.to_token_order(x, zigzag=cfg.context_zigzag)
        return self.final_norm(x), stats

    def _embed(self, tokens: jax.Array) -> jax.Array:
        """The token embeddings ``(B, T, D)`` in the compute dtype."""
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be (batch, seq) int32, got shape {tokens.shape}")
        # the table gathered over its embed axis first, as FSDP gathers every weight before
        # use: its gradient is then a scatter-add into (vocab, D) and one reduce-scatter,
        # where a table sharded on D (fsdp_tp) made XLA reshard the batch-sharded gradient
        # of the embeddings ("Involuntary full rematerialization")
        table = constrain(self.embed[...], ("vocab", None), name="embedding table")
        x = jnp.take(table, tokens, axis=0).astype(self.cfg.dtype)  # (B, T, D)
        return constrain(x, ("batch", "seq", None), name="embedded")

    def init_cache(self, batch: int, length: int, *, sharding: Any = None) -> KVCache:
        """An empty decode cache for ``batch`` sequences of up to ``length`` positions:
        keys and values ``(n_layers, batch, length, n_kv_heads, head_dim)`` in the compute
        dtype (placed by ``sharding``, e.g. a ``NamedSharding``), ``pos`` 0."""
        cfg = self.cfg
        shape = (cfg.n_layers, batch, length, cfg.n_kv_heads, cfg.head_dim)
        return KVCache(jnp.zeros(shape, cfg.dtype, device=sharding),
                       jnp.zeros(shape, cfg.dtype, device=sharding), jnp.int32(0))

    def decode_hidden(self, tokens: jax.Array, cache: KVCache
                      ) -> tuple[jax.Array, KVCache]:
        """:meth:`hidden` in decode mode: ``tokens`` (B, t) at positions
        ``cache.pos..cache.pos+t`` through the same blocks (unrolled or scanned, dense or
        MoE), each attending to the keys and values in ``cache`` (``(n_layers, ...)``,
        :meth:`init_cache`) after writing its own. Returns the final-normed hidden states
        ``(B, t, d_model)`` and the cache with ``pos + t``. No remat, pipeline or context
        parallelism: decoding runs without gradients on rules that keep the sequence whole.
        """
        x = self._embed(tokens)                                        # (B, t, D)
        if self.cfg.scan_layers:
            x, (ks, vs) = _scan_blocks(None, self.blocks, x, cache)
        else:
            ks, vs = [], []
            for i, block in enumerate(self.blocks):
                x, _, layer = block(x, cache=KVCache(cache.k[i], cache.v[i], cache.pos))
                ks.append(layer.k)
                vs.append(layer.v)
            ks, vs = jnp.stack(ks), jnp.stack(vs)                      # (L, B, S, K, H)
        return self.final_norm(x), KVCache(ks, vs, cache.pos + tokens.shape[1])

    def head(self, x: jax.Array) -> jax.Array:
        """Logits ``(B, T, vocab_size)`` of hidden states ``x`` ``(B, T, d_model)``: the
        output projection (the embedding table when ``tie_embeddings``)."""
        dt = self.cfg.dtype
        if self.lm_head is None:
            logits = jnp.einsum("btd,vd->btv", x, self.embed[...].astype(dt))   # (B, T, V)
        else:
            logits = jnp.einsum("btd,dv->btv", x, self.lm_head[...].astype(dt))  # (B, T, V)
        return constrain(logits, ("batch", "seq", "vocab"), name="logits")


def _segments(tokens: jax.Array, segment_ids: jax.Array | None,
              positions: jax.Array | None) -> Segments | None:
    """``(segment_ids, positions)`` of packed rows, checked; None for ordinary rows."""
    if segment_ids is None and positions is None:
        return None
    if segment_ids is None or positions is None:
        raise ValueError("packed rows need both segment_ids and positions (B, T); got only "
                         + ("positions" if segment_ids is None else "segment_ids"))
    for name, a in (("segment_ids", segment_ids), ("positions", positions)):
        if a.shape != tokens.shape:
            raise ValueError(f"{name} has shape {a.shape}; it must match tokens {tokens.shape}")
    if context_parallel.layout() is not None:
        raise ValueError("packed rows (segment_ids) with the sequence sharded over a context "
                         "axis are not supported; use rules with seq=None for packed data")
    seg = constrain(segment_ids, ("batch", "seq"), name="segment_ids")
    return seg, constrain(positions, ("batch", "seq"), name="positions")


def _stacked_blocks(cfg: GPTConfig, keys: jax.Array) -> Block:
    """``n_layers`` blocks as one ``Block`` whose params have a leading "layers" axis; block
    ``i`` is initialised from ``keys[i]`` exactly as the unrolled model's block ``i``."""
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata=_LAYERS_METADATA)
    def make(key: jax.Array) -> Block:
        return Block(cfg, key=key)
    return make(keys)


def _scan_blocks(run_block: RunBlock | None, blocks: Block, x: jax.Array,
                 cache: KVCache | None = None) -> tuple[jax.Array, Any]:
    """``x`` through the stacked ``blocks`` in order: ``jax.lax.scan`` over the layers axis
    of their parameters with the residual stream as carry; ``run_block`` (remat included)
    is the loop body, whose router statistics are the scan's outputs (stacked over layers).
    Decode mode (``cache``, ``(L, ...)``): the blocks run on their layer's keys and values,
    which the scan returns updated, ``(x, (k, v))``.

    A plain ``lax.scan`` over the parameter arrays: ``nnx.scan`` would also return the
    unchanged stacked state as a loop output (XLA drops it, but the jaxpr carries it).
    """
    graphdef, state = nnx.split(blocks)
    params = nnx.to_pure_dict(state)
    if cache is None:
        def body(h: jax.Array, layer: Any) -> tuple[jax.Array, RouterStats]:
            return run_block(nnx.merge(graphdef, layer), h)

        return jax.lax.scan(body, x, params)       # stats: (n_layers, ...) each

    def decode(h: jax.Array, layer: Any) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        p, k, v = layer
        h, _, out = nnx.merge(graphdef, p)(h, cache=KVCache(k, v, cache.pos))
        return h, (out.k, out.v)

    return jax.lax.scan(decode, x, (params, cache.k, cache.v))


def stack_blocks(params: Mapping[str, Any]) -> dict[str, Any]:
    """Unrolled parameters -> the ``scan_layers=True`` layout.

    Args:
        params: a pure parameter dict of ``GPT(cfg)`` (``nnx.to_pure_dict``) whose
            ``"blocks"`` maps layer index -> block params.

    Returns:
        The same dict with ``"blocks"`` one block's tree whose leaves stack the layers'
        leaves along a new leading axis (layer ``i`` at index ``i``); other entries shared.

    Example::

        params = nnx.to_pure_dict(nnx.state(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param))
        graphdef, _ = nnx.split(nnx.eval_shape(
            lambda: GPT(cfg.replace(scan_layers=True), rngs=nnx.Rngs(0))))
        scanned = nnx.merge(graphdef, stack_blocks(params))   # the same function
    """
    blocks = _blocks_of(params, "stack_blocks")
    if not isinstance(blocks, Mapping) or not blocks or \
            not all(isinstance(k, int) for k in blocks):
        raise ValueError(
            f"stack_blocks expects unrolled blocks keyed by layer index (0, 1, ...), got keys "
            f"{list(blocks)[:4] if isinstance(blocks, Mapping) else type(blocks).__name__}; "
            f"these params may already be stacked (scan_layers=True)")
    order = sorted(blocks)
    if order != list(range(len(order))):
        raise ValueError(f"stack_blocks needs layers 0..{len(order) - 1}, got {order}")
    layers = [blocks[i] for i in order]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    return {**params, "blocks": stacked}


def unstack_blocks(params: Mapping[str, Any]) -> dict[str, Any]:
    """``scan_layers=True`` parameters -> the unrolled layout (inverse of
    :func:`stack_blocks`): ``"blocks"`` becomes ``{0: block 0's params, 1: ...}``."""
    blocks = _blocks_of(params, "unstack_blocks")
    leaves = jax.tree.leaves(blocks)
    if not isinstance(blocks, Mapping) or not leaves or any(isinstance(k, int) for k in blocks):
        raise ValueError(
            f"unstack_blocks expects stacked blocks (scan_layers=True: one block's tree with a "
            f"leading layers axis), got keys "
            f"{list(blocks)[:4] if isinstance(blocks, Mapping) else type(blocks).__name__}")
    n = leaves[0].shape[0]
    if any(x.shape[:1] != (n,) for x in leaves):
        raise ValueError(f"stacked block leaves disagree on the layers axis: "
                         f"{sorted({x.shape[:1] for x in leaves})}")
    return {**params, "blocks": {i: jax.tree.map(lambda x, i=i: x[i], blocks)
                                 for i in range(n)}}


def _blocks_of(params: Mapping[str, Any], what: str) -> Any:
    if not isinstance(params, Mapping) or "blocks" not in params:
        raise ValueError(f"{what} expects GPT parameters as a pure dict with a 'blocks' entry "
                         f"(nnx.to_pure_dict(nnx.state(model, nnx.Param))), got "
                         f"{type(params).__name__}")
    return params["blocks"]
