"""A Llama-style decoder-only GPT in Flax NNX that names logical axes only.

RMSNorm, RoPE, grouped-query attention by ``cfg.attention`` (XLA, the Pallas splash kernel
or cuDNN flash attention: :mod:`workbench.models.attention`), SwiGLU MLP, optional tied embeddings and per-block remat. Every
parameter carries its logical axes as NNX ``out_sharding`` metadata; activations are
constrained with :func:`workbench.rules.constrain`, which follows the active ``Rules``.

Shape letters: B batch, T sequence, D d_model, N query heads, K kv heads, H head_dim,
F d_ff, V vocab.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax.ad_checkpoint import checkpoint_name

from workbench.models import attention as attention_impl
from workbench.models import context as context_parallel
from workbench.models.config import GPTConfig, remat_policy
from workbench.models.pipeline import active as active_pipeline
from workbench.models.pipeline import run_pipeline
from workbench.rules import constrain

Init = Callable[..., jax.Array]

#: Logical name of the stacked blocks' leading axis (``cfg.scan_layers``).
LAYERS_AXIS = "layers"
_LAYERS_METADATA = {nnx.PARTITION_NAME: LAYERS_AXIS}


def param(key: jax.Array | None, init: Init, shape: Sequence[int],
          axes: tuple[str | None, ...], dtype: str) -> nnx.Param:
    """An ``nnx.Param`` annotated with logical axes (never sharded eagerly).

    Sub-modules take explicit PRNG keys: drawing from ``nnx.Rngs`` once per parameter makes
    ``nnx.eval_shape`` of a 70B model quadratic in its size.
    """
    if len(shape) != len(axes):
        raise ValueError(f"shape {tuple(shape)} and logical axes {axes} differ in rank")
    value = init(key, tuple(shape), jnp.dtype(dtype))
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def _fan_in_init(fan_in: int) -> Init:
    return nnx.initializers.normal(stddev=fan_in ** -0.5)


class RMSNorm(nnx.Module):
    """Root-mean-square layer norm with a learned scale (computed in float32)."""

    def __init__(self, dim: int, *, eps: float, dtype: str, param_dtype: str,
                 axis: str = "embed") -> None:
        self.scale = param(None, nnx.initializers.ones, (dim,), (axis,), param_dtype)
        self.eps, self.dtype = eps, dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...].astype(jnp.float32)).astype(self.dtype)


def rope(x: jax.Array, theta: float, positions: jax.Array | None = None) -> jax.Array:
    """Rotary position embedding on ``x`` of shape (B, T, heads, H), rotate-half form.

    ``positions`` (T,): the global position of each row (default ``arange(T)``; the
    zig-zag order under context parallelism, :func:`workbench.models.context.positions`).
    """
    _, t, _, h = x.shape
    pos = jnp.arange(t) if positions is None else positions
    inv_freq = 1.0 / theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h)   # (H/2,)
    angles = pos.astype(jnp.float32)[:, None] * inv_freq[None, :]           # (T, H/2)
    sin = jnp.sin(angles)[None, :, None, :]                                  # (1, T, 1, H/2)
    cos = jnp.cos(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)                   # 2 x (B, T, n, H/2)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query causal self-attention with RoPE."""

    def __init__(self, cfg: GPTConfig, *, key: jax.Array) -> None:
        d, n, k, h, pd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.param_dtype
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.q = param(kq, _fan_in_init(d), (d, n, h), ("embed", "heads", "head_dim"), pd)
        self.k = param(kk, _fan_in_init(d), (d, k, h), ("embed", "kv_heads", "head_dim"), pd)
        self.v = param(kv, _fan_in_init(d), (d, k, h), ("embed", "kv_heads", "head_dim"), pd)
        self.o = param(ko, _fan_in_init(n * h), (n, h, d), ("heads", "head_dim", "embed"), pd)
        zeros = nnx.initializers.zeros
        self.bias = nnx.Dict(   # Qwen2: q, k, v biases
            q=param(None, zeros, (n, h), ("heads", "head_dim"), pd),
            k=param(None, zeros, (k, h), ("kv_heads", "head_dim"), pd),
            v=param(None, zeros, (k, h), ("kv_heads", "head_dim"), pd)) if cfg.qkv_bias else None
        norm = {"eps": cfg.norm_eps, "dtype": cfg.dtype, "param_dtype": pd, "axis": "head_dim"}
        self.q_norm = RMSNorm(h, **norm) if cfg.qk_norm else None   # Qwen3: per-head norms
        self.k_norm = RMSNorm(h, **norm) if cfg.qk_norm else None
        self.window = cfg.sliding_window
        self.theta, self.dtype = cfg.rope_theta, cfg.dtype
        self.impl, self.block_sizes = cfg.attention, cfg.attention_block_sizes
        self.context_attention, self.context_zigzag = cfg.context_attention, cfg.context_zigzag

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = self.dtype
        if self.window is not None and x.shape[1] > self.window:
            raise ValueError(
                f"sequence of {x.shape[1]} tokens is longer than the model's sliding_window="
                f"{self.window}; windowed attention is not implemented here: use sequences "
                f"of at most {self.window} tokens")
        q = jnp.einsum("btd,dnh->btnh", x, self.q[...].astype(dt))   # (B, T, N, H)
        k = jnp.einsum("btd,dkh->btkh", x, self.k[...].astype(dt))   # (B, T, K, H)
        v = jnp.einsum("btd,dkh->btkh", x, self.v[...].astype(dt))   # (B, T, K, H)
        if self.bias is not None:
            q, k, v = (y + self.bias[n][...].astype(dt) for y, n in ((q, "q"), (k, "k"), (v, "v")))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = checkpoint_name(q, "query_proj")
        k = checkpoint_name(k, "key_proj")
        v = checkpoint_name(v, "value_proj")
        pos = context_parallel.positions(x.shape[1], zigzag=self.context_zigzag)  # global
        q = constrain(rope(q, self.theta, pos), ("batch", "seq", "heads", "head_dim"), name="q")
        k = constrain(rope(k, self.theta, pos), ("batch", "seq", "kv_heads", "head_dim"),
                      name="k")
        v = constrain(v, ("batch", "seq", "kv_heads", "head_dim"), name="v")
        y = context_parallel.attend(q, k, v, variant=self.context_attention,
                                    zigzag=self.context_zigzag)   # None: seq not sharded
        if y is None:
            y = attention_impl.attend(q, k, v, impl=self.impl,
                                      block_sizes=self.block_sizes)       # (B, T, N, H)
        y = checkpoint_name(y, "context")
        y = constrain(y, ("batch", "seq", "heads", "head_dim"), name="attn_out")
        out = jnp.einsum("btnh,nhd->btd", y, self.o[...].astype(dt))     # (B, T, D)
        return checkpoint_name(out, "out_proj")


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(x @ gate) * (x @ up))."""

    def __init__(self, cfg: GPTConfig, *, key: jax.Array) -> None:
        d, f, pd = cfg.d_model, cfg.d_ff, cfg.param_dtype
        kg, ku, kd = jax.random.split(key, 3)
        self.gate = param(kg, _fan_in_init(d), (d, f), ("embed", "mlp"), pd)
        self.up = param(ku, _fan_in_init(d), (d, f), ("embed", "mlp"), pd)
        self.down = param(kd, _fan_in_init(f), (f, d), ("mlp", "embed"), pd)
        self.dtype = cfg.dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = self.dtype
        g = checkpoint_name(jnp.einsum("btd,df->btf", x, self.gate[...].astype(dt)),
                            "mlpwi_0")                                  # (B, T, F)
        u = checkpoint_name(jnp.einsum("btd,df->btf", x, self.up[...].astype(dt)),
                            "mlpwi_1")                                  # (B, T, F)
        hidden = constrain(jax.nn.silu(g) * u, ("batch", "seq", "mlp"), name="mlp_hidden")
        out = jnp.einsum("btf,fd->btd", hidden, self.down[...].astype(dt))  # (B, T, D)
        return checkpoint_name(out, "mlpwo")


class Block(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: GPTConfig, *, key: jax.Array) -> None:
        norm = {"eps": cfg.norm_eps, "dtype": cfg.dtype, "param_dtype": cfg.param_dtype}
        k_attn, k_mlp = jax.random.split(key)
        self.attn_norm = RMSNorm(cfg.d_model, **norm)
        self.attn = Attention(cfg, key=k_attn)
        self.mlp_norm = RMSNorm(cfg.d_model, **norm)
        if cfg.n_experts:   # mixture of experts (workbench.models.moe)
            from workbench.models.moe import MoE
            self.mlp = MoE(cfg, key=k_mlp)
        else:
            self.mlp = MLP(cfg, key=k_mlp)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = checkpoint_name(x, "decoder_layer_input")
        x = x + self.attn(self.attn_norm(x))
        x = constrain(x, ("batch", "seq", None), name="residual")
        x = x + self.mlp(self.mlp_norm(x))
        return constrain(x, ("batch", "seq", None), name="residual")


class GPT(nnx.Module):
    """Decoder-only language model: int32 tokens (B, T) -> logits (B, T, vocab_size).

    Example:
        >>> model = GPT(GPTConfig.preset("tiny"), rngs=nnx.Rngs(0))
        >>> model(jnp.zeros((2, 16), jnp.int32)).shape
        (2, 16, 256)
    """

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        pd = cfg.param_dtype
        keys = jax.random.split(rngs.params(), cfg.n_layers + 2)   # one draw from rngs
        self.embed = param(keys[0], nnx.initializers.normal(stddev=0.02),
                           (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), pd)
        if cfg.scan_layers:   # one Block whose params stack the n_layers blocks' params
            self.blocks = _stacked_blocks(cfg, keys[2:])
        else:
            self.blocks = nnx.List([Block(cfg, key=keys[2 + i]) for i in range(cfg.n_layers)])
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=cfg.dtype,
                                  param_dtype=pd)
        self.lm_head = None if cfg.tie_embeddings else param(
            keys[1], _fan_in_init(cfg.d_model), (cfg.d_model, cfg.vocab_size),
            ("embed", "vocab"), pd)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.head(self.hidden(tokens))

    def hidden(self, tokens: jax.Array) -> jax.Array:
        """The final-normed residual stream ``(B, T, d_model)`` the output projection reads
        (``model(tokens) == model.head(model.hidden(tokens))``)."""
        cfg, dt = self.cfg, self.cfg.dtype
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be (batch, seq) int32, got shape {tokens.shape}")
        x = jnp.take(self.embed[...], tokens, axis=0).astype(dt)      # (B, T, D)
        x = constrain(x, ("batch", "seq", None), name="embedded")
        x = context_parallel.to_model_order(x, zigzag=cfg.context_zigzag)  # CP zig-zag
        run_block: Callable[[Block, jax.Array], jax.Array] = lambda blk, h: blk(h)
        if cfg.n_experts:   # MoE router statistics leave the remat as outputs
            from workbench.models import moe
            run_block = moe.returning_stats(run_block)
        policy = remat_policy(cfg.remat, attention_impl.current_platform())
        if policy is not None:
            # jax.checkpoint: prevent_cse=False is safe inside a scan (the loop keeps XLA
            # from merging the recomputation into the forward) and spares the barriers.
            run_block = nnx.remat(run_block, policy=policy,
                                  prevent_cse=not cfg.scan_layers)
        if cfg.n_experts:
            run_block = moe.recording_stats(run_block)
        if cfg.scan_layers and active_pipeline() is not None:   # inside a pipelined step
            x = run_pipeline(run_block, self.blocks, x, *active_pipeline())
        elif cfg.scan_layers:
            x = _scan_blocks(run_block, self.blocks, x)
        else:
            for block in self.blocks:
                x = run_block(block, x)
        x = context_parallel.to_token_order(x, zigzag=cfg.context_zigzag)
        return self.final_norm(x)

    def head(self, x: jax.Array) -> jax.Array:
        """Logits ``(B, T, vocab_size)`` of hidden states ``x`` ``(B, T, d_model)``: the
        output projection (the embedding table when ``tie_embeddings``)."""
        dt = self.cfg.dtype
        if self.lm_head is None:
            logits = jnp.einsum("btd,vd->btv", x, self.embed[...].astype(dt))   # (B, T, V)
        else:
            logits = jnp.einsum("btd,dv->btv", x, self.lm_head[...].astype(dt))  # (B, T, V)
        return constrain(logits, ("batch", "seq", "vocab"), name="logits")


def _stacked_blocks(cfg: GPTConfig, keys: jax.Array) -> Block:
    """``n_layers`` blocks as one ``Block`` whose params have a leading "layers" axis; block
    ``i`` is initialised from ``keys[i]`` exactly as the unrolled model's block ``i``."""
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata=_LAYERS_METADATA)
    def make(key: jax.Array) -> Block:
        return Block(cfg, key=key)
    return make(keys)


def _scan_blocks(run_block: Callable[[Block, jax.Array], jax.Array], blocks: Block,
                 x: jax.Array) -> jax.Array:
    """``x`` through the stacked ``blocks`` in order: ``jax.lax.scan`` over the layers axis
    of their parameters with the residual stream as carry; ``run_block`` (remat included)
    is the loop body.

    A plain ``lax.scan`` over the parameter arrays: ``nnx.scan`` would also return the
    unchanged stacked state as a loop output (XLA drops it, but the jaxpr carries it).
    """
    graphdef, state = nnx.split(blocks)
    params = nnx.to_pure_dict(state)

    def body(h: jax.Array, layer: Any) -> tuple[jax.Array, None]:
        from workbench.models import moe   # MoE router statistics: scan outputs
        with moe.collect() as stats:
            h = run_block(nnx.merge(graphdef, layer), h)
        return h, moe.stack(stats)

    x, stats = jax.lax.scan(body, x, params)
    if stats:
        from workbench.models import moe
        moe.record({k: v.reshape(-1, *v.shape[2:]) for k, v in stats.items()}, stacked=True)
    return x


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
