"""The layers a GPT is built from: annotated parameters, RMSNorm, RoPE, attention, MLP.

Every parameter carries its logical axes as NNX ``out_sharding`` metadata; activations
are constrained with :func:`workbench.rules.constrain`, which follows the active
``Rules``. Attention runs by ``cfg.attention`` (XLA, the Pallas splash kernel or cuDNN
flash attention: :mod:`workbench.models.attention`), or by ``cfg.context_attention`` when
the rules shard the sequence (:mod:`workbench.models.context`). The transformer block and
the model are in :mod:`workbench.models.gpt`, the mixture-of-experts layer in
:mod:`workbench.models.moe`.

Shape letters: B batch, T sequence, D d_model, N query heads, K kv heads, H head_dim,
F d_ff.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from workbench.models import attention as attention_impl
from workbench.models import context as context_parallel
from workbench.models.config import GPTConfig
from workbench.rules import constrain

__all__ = ["MLP", "Attention", "Init", "RMSNorm", "Segments", "fan_in_init", "param", "rope"]

Init = Callable[..., jax.Array]
#: Packed rows: ``(segment_ids, positions)``, int32 (B, T) each (``workbench.data.packing``).
Segments = tuple[jax.Array, jax.Array]

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


def fan_in_init(fan_in: int) -> Init:
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
    zig-zag order under context parallelism, :func:`workbench.models.context.positions`);
    or (B, T): each token's position within its document (packed rows).
    """
    _, t, _, h = x.shape
    pos = jnp.arange(t) if positions is None else positions
    inv_freq = 1.0 / theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h)   # (H/2,)
    angles = pos.astype(jnp.float32)[..., None] * inv_freq                  # ([B,] T, H/2)
    if angles.ndim == 2:
        angles = angles[None]                                                # (1, T, H/2)
    sin = jnp.sin(angles)[:, :, None, :]                                     # (B|1, T, 1, H/2)
    cos = jnp.cos(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)                   # 2 x (B, T, n, H/2)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query causal self-attention with RoPE."""

    def __init__(self, cfg: GPTConfig, *, key: jax.Array) -> None:
        d, n, k, h, pd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.param_dtype
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.q = param(kq, fan_in_init(d), (d, n, h), ("embed", "heads", "head_dim"), pd)
        self.k = param(kk, fan_in_init(d), (d, k, h), ("embed", "kv_heads", "head_dim"), pd)
        self.v = param(kv, fan_in_init(d), (d, k, h), ("embed", "kv_heads", "head_dim"), pd)
        self.o = param(ko, fan_in_init(n * h), (n, h, d), ("heads", "head_dim", "embed"), pd)
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

    def __call__(self, x: jax.Array, segments: Segments | None = None) -> jax.Array:
        """``x`` (B, T, D) -> (B, T, D); ``segments``: packed rows' ``(segment_ids,
        positions)`` (B, T) each: attention within each document, RoPE from its start."""
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
        pos = context_parallel.positions(x.shape[1], zigzag=self.context_zigzag) \
            if segments is None else segments[1]    # global, or within each document
        q = constrain(rope(q, self.theta, pos), ("batch", "seq", "heads", "head_dim"), name="q")
        k = constrain(rope(k, self.theta, pos), ("batch", "seq", "kv_heads", "head_dim"),
                      name="k")
        v = constrain(v, ("batch", "seq", "kv_heads", "head_dim"), name="v")
        y = None if segments is not None else context_parallel.attend(
            q, k, v, variant=self.context_attention,
            zigzag=self.context_zigzag)                                   # None: seq not sharded
        if y is None:
            y = attention_impl.attend(
                q, k, v, impl=self.impl, block_sizes=self.block_sizes,
                segment_ids=None if segments is None else segments[0])   # (B, T, N, H)
        y = checkpoint_name(y, "context")
        y = constrain(y, ("batch", "seq", "heads", "head_dim"), name="attn_out")
        out = jnp.einsum("btnh,nhd->btd", y, self.o[...].astype(dt))     # (B, T, D)
        return checkpoint_name(out, "out_proj")


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(x @ gate) * (x @ up))."""

    def __init__(self, cfg: GPTConfig, *, key: jax.Array) -> None:
        d, f, pd = cfg.d_model, cfg.d_ff, cfg.param_dtype
        kg, ku, kd = jax.random.split(key, 3)
        self.gate = param(kg, fan_in_init(d), (d, f), ("embed", "mlp"), pd)
        self.up = param(ku, fan_in_init(d), (d, f), ("embed", "mlp"), pd)
        self.down = param(kd, fan_in_init(f), (f, d), ("mlp", "embed"), pd)
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
